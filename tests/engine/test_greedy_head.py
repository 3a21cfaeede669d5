"""The greedy head's token is the full float32 product's argmax, bit for bit, ties included."""

import itertools

import pytest
import torch

from reader_spec.engine import kernels
from reader_spec.engine.greedy_head import UNBOUNDED, UNNEEDED, GreedyHead, tree_rows
from reader_spec.engine.kernel_choice import ROW_BUCKETS
from reader_spec.engine.tree import DraftTree
from reader_spec.engine.weights import pack_linears
from tests.conftest import KERNELS_MISSING


@pytest.fixture(scope="module", autouse=True)
def built():
    if not kernels.available():
        pytest.fail(KERNELS_MISSING)


def head_of(weight: torch.Tensor, bounded: bool = True):
    """The packed layer and its greedy head, made to take the bounded int8 path at every row count
    where it may (``bounded``), whichever the timing would pick, or never."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight.clone()
    head, _ = pack_linears([linear])
    greedy = GreedyHead(head)
    greedy._seconds_by_bucket = dict.fromkeys(ROW_BUCKETS, (0.0, 1.0) if bounded else (1.0, 0.0))
    return head, greedy


def full_argmax(head, hidden: torch.Tensor) -> torch.Tensor:
    """What greedy decoding on the compiled product picks: the first of the largest logits."""
    return torch.ops.reader_spec.blocked_linear(hidden, head.weight, None, head.out_features).argmax(-1)


@pytest.mark.parametrize("bounded", [True, False])
# vocabularies not a multiple of 32; features not a multiple of 4 (the integer product's groups)
@pytest.mark.parametrize("shape", [(1000, 64), (4100, 576), (37, 40), (300, 66)])
def test_the_token_is_the_full_products_argmax_at_every_row_count(shape, bounded):
    """Beyond the last row bucket (80 rows), and where the timing picks it, the whole layer runs."""
    torch.manual_seed(0)
    head, greedy = head_of(torch.randn(shape) * 0.05, bounded)
    for rows in (1, 2, 3, 7, 8, 9, 16, 33, 80):
        hidden = torch.randn(rows, shape[1]) * 3
        assert torch.equal(greedy(hidden), full_argmax(head, hidden))


def test_equal_columns_give_the_first_index_and_near_equal_ones_the_larger():
    torch.manual_seed(1)
    weight = torch.randn(300, 64) * 0.05
    hidden = torch.randn(4, 64)
    best = int(full_argmax(*head_of(weight)[:1], hidden)[0])
    weight[[17, 250]] = weight[best] * 1.5  # two copies of a winning column: a tie int8 cannot resolve
    head, greedy = head_of(weight)
    assert torch.equal(greedy(hidden[:1]), torch.tensor([17]))
    # Columns one float32 step apart at one weight: the int8 copy cannot tell them apart, the product can.
    nudged = weight.clone()
    k = int(hidden[0].abs().argmax())
    nudged[250, k] = torch.nextafter(nudged[250, k], nudged[250, k] * 2 * hidden[0, k].sign())
    head, greedy = head_of(nudged)
    logits = torch.ops.reader_spec.blocked_linear(hidden[:1], head.weight, None, head.out_features)[0]
    assert logits[250] > logits[17]  # the nudge moved the product
    assert torch.equal(greedy(hidden), full_argmax(head, hidden))
    assert int(greedy(hidden[:1])[0]) == 250


def test_outliers_widen_the_bound_without_changing_the_token():
    """A column with one huge weight quantizes the rest of it coarsely: more candidates, same token."""
    torch.manual_seed(2)
    weight = torch.randn(2000, 96) * 0.05
    weight[::7, 3] = 40.0
    head, greedy = head_of(weight)
    hidden = torch.randn(64, 96)
    hidden[:, 3] = 0.0  # the outliers do not decide the logits; their quantization error does
    assert torch.equal(greedy(hidden), full_argmax(head, hidden))


def test_hidden_states_with_a_few_huge_features_keep_the_token():
    """A model's hidden state often has a few features far larger than the rest: one int8 level's
    scale would be too coarse for the others; two int8 levels, or one int16 level, keep the bound
    tight enough."""
    torch.manual_seed(4)
    head, greedy = head_of(torch.randn(3000, 128) * 0.05)
    hidden = torch.randn(40, 128)
    hidden[:, [5, 77]] *= 40.0
    assert torch.equal(greedy(hidden), full_argmax(head, hidden))


@pytest.mark.parametrize(
    "largest, second",
    [
        (127.0, 127 / 256),  # two int8 levels (AVX-512 VNNI): scales 1 and 2^-8
        (32767 / 256, 0.0),  # one int16 level of 32,767 steps (64 features; elsewhere): scale 2^-8
    ],
)
def test_the_hidden_states_own_quantization_error_is_in_the_bound(largest, second):
    """Two columns whose order the hidden state's quantization reverses: one large feature sets a
    scale that leaves each of the other features 0.45 of a 2^-8 step off, in the direction that
    favours column 0 exactly (each case does so for one of the two quantizations the kernel has).
    Column 0's weights are exact in int8, so only the hidden state's error can keep it among the
    candidates."""
    rng = torch.Generator().manual_seed(6)
    sign = torch.randint(0, 2, (62,), generator=rng) * 2 - 1
    steps = torch.randint(-60, 61, (62,), generator=rng)
    excess = int((sign * steps).sum()) + 12  # the integer parts must leave column 0 behind by 12 steps
    for i in range(abs(excess)):
        steps[i % 62] -= sign[i % 62] * (1 if excess > 0 else -1)
    hidden = torch.zeros(1, 64)
    hidden[0, 0], hidden[0, 1] = largest, second
    hidden[0, 2:] = (steps + 0.45 * sign) / 256
    weight = torch.zeros(2, 64)
    weight[0, 2:] = sign / 128.0
    head, greedy = head_of(weight)
    logits = torch.ops.reader_spec.blocked_linear(hidden, head.weight, None, head.out_features)[0]
    assert logits[0] > logits[1] == 0  # exactly, column 0; its approximation says column 1
    assert torch.equal(greedy(hidden), torch.tensor([0]))


def test_integer_sums_beyond_float32s_exact_range_keep_the_token():
    """Sums above 2^24 round when converted to float; the bound covers it."""
    torch.manual_seed(5)
    weight = 0.5 + torch.rand(200, 2048) * 0.01  # every column near the largest weight: q near 127
    head, greedy = head_of(weight)
    hidden = 1.0 + torch.rand(6, 2048) * 0.001
    assert torch.equal(greedy(hidden), full_argmax(head, hidden))


def test_a_zero_row_gets_the_first_column():
    """Every logit is 0: every column is a candidate and the first of the equal maxima wins."""
    _, greedy = head_of(torch.randn(100, 64))
    assert torch.equal(greedy(torch.zeros(2, 64)), torch.zeros(2, dtype=torch.long))


def test_rows_that_are_not_finite_take_the_full_products_argmax():
    torch.manual_seed(3)
    head, greedy = head_of(torch.randn(500, 64))
    hidden = torch.randn(3, 64)
    hidden[1, 5] = float("inf")
    hidden[2, 9] = float("nan")
    assert torch.equal(greedy(hidden), head(hidden).argmax(-1))


def test_the_kernel_says_whether_any_row_is_not_finite():
    """The caller reads the flag instead of the tokens: it must be set exactly when a row is UNBOUNDED."""
    torch.manual_seed(3)
    _, greedy = head_of(torch.randn(500, 64))
    hidden = torch.randn(3, 64)
    tokens, unbounded, _ = greedy._bounded(hidden)
    assert unbounded is False and UNBOUNDED not in tokens.tolist()
    hidden[2, 9] = float("nan")
    tokens, unbounded, _ = greedy._bounded(hidden)
    assert unbounded is True and tokens.tolist()[2] == UNBOUNDED and UNBOUNDED not in tokens.tolist()[:2]


def test_it_applies_to_float32_heads_without_bias_only():
    float_head, _ = pack_linears([torch.nn.Linear(64, 100, bias=False)])
    assert GreedyHead.applies(float_head)
    biased, _ = pack_linears([torch.nn.Linear(64, 100)])
    int8, _ = pack_linears([torch.nn.Linear(64, 100, bias=False)], weight_format="int8")
    assert not GreedyHead.applies(biased) and not GreedyHead.applies(int8)


def test_given_the_trees_only_rows_greedy_acceptance_reads_are_resolved():
    """Rows below a rejected draft are left UNNEEDED; rows along the accepted path, found in rounds
    down the tree, and roots are the full product's argmax. A zero row makes every column a candidate,
    so it is resolved only if needed; a row that is not finite leaves its children needed."""
    torch.manual_seed(7)
    head, greedy = head_of(torch.randn(500, 64) * 0.05)
    hidden = torch.randn(9, 64) * 3
    first = int(full_argmax(head, hidden[:1])[0])
    # Tree A: root 0; 1 accepted (zero row: token 0), 2 rejected; 3 under 1 accepted (zero row), 4 under 2.
    a = DraftTree([5, first, (first + 1) % 500, 0, 7], [-1, 0, 0, 1, 2])
    hidden[[1, 2, 3, 4]] = 0.0
    # Tree B: a zero root. Tree C: a root that is not finite, its one child a zero row.
    b = DraftTree([3], [-1])
    c = DraftTree([4, 9], [-1, 0])
    hidden[5] = 0.0
    hidden[6, 2] = float("inf")
    hidden[7] = 0.0
    tokens = greedy(hidden[:8], tree_rows([a, b, c]))
    expected = full_argmax(head, hidden[:8])
    expected[6] = head(hidden[6:7]).argmax(-1)[0]
    for row in (0, 1, 3, 5, 6, 7):
        assert tokens[row] == expected[row], row
    assert tokens[2] == tokens[4] == UNNEEDED
    assert a.walk(tokens[:5].tolist().__getitem__) == a.walk(expected[:5].tolist().__getitem__)


def test_random_trees_walk_as_with_every_token_resolved():
    rng = torch.Generator().manual_seed(8)
    head, greedy = head_of(torch.randn(300, 64, generator=rng) * 0.05)

    def draw(high: int) -> int:
        return int(torch.randint(0, high, (1,), generator=rng))

    unneeded = 0
    for _ in range(20):
        shapes = [[-1] + [draw(i) for i in range(1, 1 + draw(8))] for _ in range(1 + draw(4))]
        starts = list(itertools.accumulate([0] + [len(parents) for parents in shapes]))
        hidden = torch.randn(starts[-1], 64, generator=rng) * 3
        hidden[torch.rand(starts[-1], generator=rng) < 0.3] = 0.0  # rows where every column is a candidate
        full = full_argmax(head, hidden).tolist()
        trees = []
        for parents, start in zip(shapes, starts, strict=False):
            # Half the drafts are what the model picks at their parent (accepted), half random.
            tokens = [draw(300) if parent < 0 or draw(2) else full[start + parent] for parent in parents]
            trees.append(DraftTree(tokens, parents))
        tokens = greedy(hidden, tree_rows(trees)).tolist()
        for tree, start in zip(trees, starts, strict=False):
            lazy, exact = tokens[start : start + len(tree)], full[start : start + len(tree)]
            assert all(t in (e, UNNEEDED) for t, e in zip(lazy, exact, strict=True))
            assert tree.walk(lazy.__getitem__) == tree.walk(exact.__getitem__)
            unneeded += lazy.count(UNNEEDED)
    assert unneeded > 0  # the case this is about happened


def test_a_draft_below_a_larger_logit_leaves_the_integer_sweep():
    """A rejected draft's row, and the rows below it, are dropped from the integer products as soon as
    its parent's row shows a larger logit: they come back UNNEEDED even where the row's own bound
    leaves one candidate (a row computed to the end would return that candidate). A draft below a
    likelier sibling is dropped too; the accepted path is resolved as before."""
    torch.manual_seed(9)
    weight = torch.randn(300, 64) * 0.05
    head, greedy = head_of(weight)

    def confident(token: int) -> torch.Tensor:  # a row whose argmax is `token`, by a wide margin
        return weight[token] / weight[token].norm() * 40

    # Root 0 picks 11; row 1 drafts 11 (accepted) and picks 22; row 2 drafts 5 (a sibling of 1, lower
    # logit at the root); row 3 under 2 picks 33; row 4 under 1 drafts 22 (accepted) and picks 44.
    hidden = torch.stack([confident(11), confident(22), confident(33), confident(33), confident(44)])
    tree = DraftTree([7, 11, 5, 33, 22], [-1, 0, 0, 2, 1])
    expected = full_argmax(head, hidden)
    assert expected.tolist() == [11, 22, 33, 33, 44]
    tokens = greedy(hidden, tree_rows([tree]))
    assert tokens.tolist() == [11, 22, UNNEEDED, UNNEEDED, 44]
    assert greedy._bounded(hidden, tree_rows([tree]))[2] == 3  # rows 0, 1 and 4 computed to the end
    # Without the tree every row is resolved, rows 2 and 3 included: their bounds leave one candidate.
    assert torch.equal(greedy(hidden), expected)


def test_the_head_is_priced_at_the_draft_rows_it_keeps():
    """A pass with drafts runs the bounded head where computing the rows it is expected to keep is
    faster than the whole layer on every row, however the two compare with every row computed; what
    it keeps is learned from the passes it runs."""
    torch.manual_seed(10)
    weight = torch.randn(300, 64) * 0.05
    head, greedy = head_of(weight)
    # the head wins up to 4 rows
    greedy._seconds_by_bucket = {bucket: (float(bucket), 6.0) for bucket in ROW_BUCKETS}
    assert greedy.kept_share == pytest.approx(0.5)  # the prior
    assert greedy.wins(4) and not greedy.wins(8) and not greedy.wins(8, roots=8)
    assert not greedy.wins(8, roots=1)  # 1 + 7 / 2 rows expected: the 8-row bucket
    # Passes of 4 rows whose first draft is rejected: the head keeps only the root.
    for _ in range(3):
        hidden = torch.randn(4, 64) * 3
        first = int(full_argmax(head, hidden[:1])[0])
        tokens = greedy(hidden, tree_rows([DraftTree([1, (first + 1) % 300, 2, 3], [-1, 0, 1, 2])]))
        assert tokens.tolist()[1:] == [UNNEEDED] * 3
    assert greedy.kept_share < 0.3
    assert greedy.wins(8, roots=1)  # now under 4 rows expected
    assert not greedy.wins(8)  # a pass without drafts keeps every row
