import pytest
import torch

from reader_spec.engine.tree import EMPTY_PROPOSAL, DraftTree, Proposal, chain_proposal


def sample_tree() -> DraftTree:
    #        0(10)
    #      /      \
    #    1(11)    2(12)
    #    /  \        \
    #  3(13) 4(14)   5(15)
    return DraftTree([10, 11, 12, 13, 14, 15], [-1, 0, 0, 1, 1, 2])


def test_depths_children_and_paths():
    tree = sample_tree()
    assert tree.depths == [0, 1, 1, 2, 2, 2]
    assert tree.children[0] == {11: 1, 12: 2}
    assert tree.path_to(4) == [0, 1, 4]
    assert tree.path_to(0) == [0]


def test_ancestor_mask_is_reflexive_and_follows_ancestry():
    mask = sample_tree().ancestor_mask()
    expected = torch.zeros(6, 6, dtype=torch.bool, device=mask.device)
    for node, ancestors in {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 2, 5]}.items():
        expected[node, ancestors] = True
    assert torch.equal(mask, expected)


def test_walk_descends_while_the_choice_is_a_child():
    tree = sample_tree()
    choices = {0: 11, 1: 14, 4: 99}
    assert tree.walk(choices.__getitem__) == ([0, 1, 4], 99)
    assert tree.walk(lambda node: 42) == ([0], 42)


def test_duplicate_siblings_keep_the_first():
    tree = DraftTree([1, 2, 2], [-1, 0, 0])
    assert tree.children[0] == {2: 1}


@pytest.mark.parametrize("parents", [[0, 0], [-1, 1], [-1, -1]])
def test_invalid_parents_are_rejected(parents):
    with pytest.raises(ValueError):
        DraftTree([1, 2], parents)


def test_proposal_truncation_keeps_a_tree():
    proposal = Proposal((5, 6, 7), (-1, 0, -1), (0.9, 0.5, 0.2), ("a", "a", "b"))
    cut = proposal.truncated(2)
    assert cut.tokens == (5, 6) and cut.parents == (-1, 0) and cut.sources == ("a", "a")
    assert proposal.truncated(0) == EMPTY_PROPOSAL
    tree = DraftTree.from_proposal(4, proposal)
    assert tree.tokens == [4, 5, 6, 7] and tree.parents == [-1, 0, 1, 0]


def test_proposal_validation():
    with pytest.raises(ValueError):
        Proposal((1,), (0,), (0.5,))
    with pytest.raises(ValueError):
        Proposal((1, 2), (-1,), (0.5, 0.4))


def test_chain_proposal():
    chain = chain_proposal([3, 4, 5], [0.8, 0.6, 0.3], "x")
    assert chain.parents == (-1, 0, 1) and chain.sources == ("x",) * 3
