"""SuffixDecoding: the drafter equals ArcticInference's algorithm run on explicit suffix tries.

The reference below builds, by brute force, the suffix trie ArcticInference keeps (every substring of at
most ``max_depth`` tokens of each sequence, with occurrence counts) and speculates on it the way
``SuffixTree::speculate`` does: every match length shorter than the context window, from the longest
down, a best-first heap (or a greedy descent) from the matched node with float32 probabilities
multiplied where the count drops (ArcticInference's compressed nodes), float32 scores with strict
improvement, and the global tree only when it scores strictly higher. Its float32 arithmetic is numpy's.
"""

from __future__ import annotations

import heapq
import random

import numpy as np
import pytest

from reader_spec.drafters import suffix
from reader_spec.drafters.base import Drafter
from reader_spec.drafters.suffix import SOURCE, SuffixDecodingDrafter, TokenCorpus
from reader_spec.engine.loop import Engine
from reader_spec.engine.tree import EMPTY_PROPOSAL
from tests.engine.test_engine import NO_EOS, random_prompts


class TrieNode:
    __slots__ = ("count", "kids", "newest")

    def __init__(self) -> None:
        self.count, self.kids, self.newest = 0, {}, (-1, -1)


def suffix_trie(sequences: list[list[int]], max_depth: int) -> TrieNode:
    root = TrieNode()
    for rank, sequence in enumerate(sequences):
        for start in range(len(sequence)):
            node = root
            for token in sequence[start : start + max_depth]:
                node = node.kids.setdefault(token, TrieNode())
                node.count += 1
                node.newest = max(node.newest, (rank, start))
    return root


f32 = np.float32


def reference_speculate(sequences, text, max_nodes, max_depth, factor, offset, min_prob, use_tree, to_beat):
    """ArcticInference's speculate on a brute-force trie. Ties: a chain takes the most frequent child,
    then the newest; a tree pops the highest probability, then count, then the shallower, then newest."""
    root = suffix_trie(sequences, max_depth)
    context = text[-max_depth:]
    min_prob = f32(min_prob)
    best, best_score = ((), (), ()), to_beat
    for length in range(len(context) - 1, 0, -1):  # never the whole context
        node = root
        for token in context[-length:]:
            node = node.kids.get(token)
            if node is None:
                break
        if node is None:
            continue
        limit = float(f32(length) * f32(factor) + f32(offset)) + 1e-6
        budget = max(0, min(max_nodes, int(limit)))
        tokens, parents, probs = [], [], []
        if use_tree:
            heap = []

            def push(above, prob, parent, depth, heap=heap):
                for token, kid in above.kids.items():
                    # A compressed node (same count) keeps its probability; a drop multiplies.
                    p = prob if kid.count == above.count else prob * f32(kid.count) / f32(above.count)
                    if p >= min_prob:
                        newest = (-kid.newest[0], -kid.newest[1])
                        heapq.heappush(heap, (-p, -kid.count, depth + 1, newest, token, kid, parent))

            push(node, f32(1), -1, 0)
            while heap and len(tokens) < budget:
                neg_prob, _, depth, _, token, kid, parent = heapq.heappop(heap)
                tokens.append(token)
                parents.append(parent)
                probs.append(-neg_prob)
                push(kid, -neg_prob, len(tokens) - 1, depth)
        else:
            prob = f32(1)
            while len(tokens) < budget and node.kids:
                token, kid = max(node.kids.items(), key=lambda item: (item[1].count, item[1].newest))
                if kid.count < node.count:
                    prob = prob * (f32(kid.count) / f32(node.count))
                if prob < min_prob:
                    break
                tokens.append(token)
                parents.append(len(tokens) - 2)
                probs.append(prob)
                node = kid
        score = f32(0)
        for p in probs:
            score = score + p
        if score > best_score:
            best, best_score = (tuple(tokens), tuple(parents), tuple(probs)), score
    return best, best_score


class ReferenceDrafter:
    """Per-request tries over prompt + output; a global trie over responses, finished ones first."""

    def __init__(self, max_depth=64, factor=1.0, offset=0.0, min_prob=0.1, use_tree=True):
        self.settings = (max_depth, factor, offset, min_prob, use_tree)
        self.texts, self.responses, self.finished = {}, {}, []

    def begin(self, request, prompt):
        self.texts[request], self.responses[request] = list(prompt), []

    def extend(self, request, tokens):
        self.texts[request] += tokens
        self.responses[request] += tokens

    def end(self, request):
        del self.texts[request]
        response = self.responses.pop(request)
        if response:
            self.finished.append(response)

    def propose(self, request, max_nodes):
        text = self.texts[request]
        local, score = reference_speculate([text], text, max_nodes, *self.settings, f32(0))
        shared_sequences = self.finished + list(self.responses.values())
        shared, _ = reference_speculate(shared_sequences, text, max_nodes, *self.settings, score)
        return shared if shared != ((), (), ()) else local


def repetitive(rng: random.Random, length: int, vocab: int) -> list[int]:
    out: list[int] = []
    while len(out) < length:
        if out and rng.random() < 0.5:
            start = rng.randrange(len(out))
            out += out[start : start + rng.randint(2, 12)]
        else:
            out += [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
    return out[:length]


def compare_with_reference(seed: int) -> tuple[int, int]:
    """Interleaved requests with random settings; every proposal must equal the reference's."""
    rng = random.Random(seed)
    max_depth = rng.choice([4, 8, 64])
    factor, offset = rng.choice([1.0, 0.5, 2.0]), rng.choice([0.0, 1.0])
    min_prob, use_tree = rng.choice([0.1, 0.3, 0.0]), rng.random() < 0.7
    drafter = SuffixDecodingDrafter(max_depth, factor, offset, min_prob, use_tree)
    reference = ReferenceDrafter(max_depth, factor, offset, min_prob, use_tree)
    vocab = rng.choice([3, 6, 20])
    pending: dict[int, list[int]] = {}
    steps = branched = 0
    for request in range(6):
        prompt = repetitive(rng, rng.randint(1, 60), vocab)
        drafter.begin(request, prompt)
        reference.begin(request, prompt)
        pending[request] = repetitive(rng, rng.randint(1, 80), vocab)
        while pending and (rng.random() < 0.7 or len(pending) > 2):
            r = rng.choice(list(pending))
            budget = rng.choice([1, 4, 16])
            proposal = drafter.propose(r, budget)
            tokens, parents, probs = reference.propose(r, budget)
            assert (proposal.tokens, proposal.parents) == (tokens, parents), (seed, r, steps)
            assert proposal.probs == tuple(float(p) for p in probs)  # float32 values, exactly
            assert set(proposal.sources) <= {SOURCE}
            steps += 1
            branched += len(set(parents)) < len(parents)
            k = rng.randint(1, 4)
            chunk, pending[r] = pending[r][:k], pending[r][k:]
            drafter.extend(r, chunk)
            reference.extend(r, chunk)
            if not pending[r]:
                drafter.end(r)
                reference.end(r)
                del pending[r]
    return steps, branched


@pytest.mark.parametrize("seed", range(12))
def test_proposals_equal_reference_suffix_tries(seed):
    steps, _ = compare_with_reference(seed)
    assert steps > 0


@pytest.mark.parametrize("seed", range(12, 18))
def test_vectorized_paths_equal_reference(monkeypatch, seed):
    """Force the index, the length-by-length filtering and the numpy trie builder everywhere."""
    monkeypatch.setattr(suffix, "REBUILD_RATIO", 0)
    monkeypatch.setattr(suffix, "ONE_SHOT_CELLS", 0)
    monkeypatch.setattr(suffix, "SMALL_TRIE_ROWS", 0)
    steps, _ = compare_with_reference(seed)
    assert steps > 0


def test_reference_comparison_exercises_trees():
    totals = [compare_with_reference(seed) for seed in range(3)]
    assert sum(branched for _, branched in totals) > 10


def brute_occurrences(sequences: list[list[int]], pattern: list[int]) -> int:
    n = len(pattern)
    return sum(seq[i : i + n] == pattern for seq in sequences for i in range(len(seq) - n + 1))


@pytest.mark.parametrize("rebuild_ratio", [0, suffix.REBUILD_RATIO])
def test_corpus_positions_counts_and_match_lengths(monkeypatch, rebuild_ratio):
    monkeypatch.setattr(suffix, "REBUILD_RATIO", rebuild_ratio)
    rng = random.Random(5)
    sequences = [repetitive(rng, rng.randint(1, 50), 4) for _ in range(5)]
    corpus = TokenCorpus()
    for sequence in sequences:
        corpus.start_sequence()
        for i in range(0, len(sequence), 7):  # appended piecewise, queried in between
            corpus.append(sequence[i : i + 7])
            corpus.positions(sequence[i])
    layout = [-1]
    for sequence in sequences:
        layout += [*sequence, -1]
    assert corpus.buffer[: len(corpus) + 1].tolist() == layout
    for token in range(4):
        assert corpus.positions(token).tolist() == [i for i, t in enumerate(layout) if t == token]
    for _ in range(40):
        pattern = np.asarray(repetitive(rng, rng.randint(1, 12), 4), dtype=np.int32)
        matches = suffix._Matches([corpus], pattern)
        for m in range(1, len(pattern) + 1):
            assert matches.counts[m] == brute_occurrences(sequences, pattern[-m:].tolist())
        longest = max((m for m in range(1, len(pattern) + 1) if matches.counts[m]), default=0)
        assert matches.longest == longest


def test_counts_include_the_texts_own_suffix():
    # [1, 2] occurs twice, once as the text's own end: the continuation has probability 1/2, and a
    # 2-token match with max_spec_factor 1 allows two tokens.
    drafter = SuffixDecodingDrafter()
    drafter.begin("r", [1, 2, 3, 4, 1, 2])
    proposal = drafter.propose("r", 16)
    assert proposal.tokens == (3, 4) and proposal.probs == (0.5, 0.5) and proposal.sources == (SOURCE,) * 2
    drafter.extend("r", [3, 4, 1])  # now [3, 4, 1, 2, 3, 4, 1] repeats: a 5-token match, 5 tokens
    assert drafter.propose("r", 16).tokens == (2, 3, 4, 1)  # cut where the earlier text ends


def test_depth_limit_and_chain_mode():
    text = list(range(10)) * 3
    deep = SuffixDecodingDrafter(max_depth=6, use_tree=False)
    deep.begin(0, text)
    proposal = deep.propose(0, 16)
    # Matched strings and their continuations together never exceed max_depth tokens.
    assert 0 < len(proposal) <= 5 and proposal.parents == tuple(range(-1, len(proposal) - 1))
    assert deep.propose(0, 2).tokens == proposal.tokens[:2]
    assert deep.propose(0, 0) == EMPTY_PROPOSAL
    # Patterns longer than a fresh buffer: the request's short response is matched back to its start.
    wide = SuffixDecodingDrafter(max_depth=200)
    wide.begin(0, text * 3)
    wide.extend(0, [0, 1, 2])
    assert wide.propose(0, 16).tokens == tuple(text[3:19])


def test_global_tree_serves_later_requests():
    drafter = SuffixDecodingDrafter()
    assert isinstance(drafter, Drafter)
    drafter.begin("first", [50, 51])
    drafter.extend("first", [7, 8, 9, 10, 11, 12, 13])
    drafter.end("first")
    drafter.begin("second", [60, 61, 7, 8, 9])  # its own text has no earlier 7 8 9
    proposal = drafter.propose("second", 16)
    assert proposal.tokens == (10, 11, 12) and proposal.probs == (1.0, 1.0, 1.0)
    # A running request's response is visible to the others as it is generated.
    drafter.begin("third", [70, 71])
    drafter.extend("third", [20, 21, 22, 23, 24])
    drafter.begin("fourth", [72, 20, 21])
    assert drafter.propose("fourth", 16).tokens == (22, 23)
    drafter.observe("fourth", proposal, [0])
    with pytest.raises(ValueError):
        drafter.begin("fourth", [1])


def test_matches_never_span_the_whole_context():
    drafter = SuffixDecodingDrafter()
    drafter.begin("a", [50])
    drafter.extend("a", [1, 2, 3, 4, 5, 6])
    drafter.end("a")
    drafter.begin("b", [1, 2, 3])  # the whole context occurs in the earlier response
    # As ArcticInference, only suffixes shorter than the context are matched: [2, 3], two tokens.
    assert drafter.propose("b", 16).tokens == (4, 5)


def responses_then(drafter: SuffixDecodingDrafter, responses: list[list[int]], prompt: list[int]) -> None:
    """Finished responses in the global tree, then a request with ``prompt``."""
    for i, response in enumerate(responses):
        drafter.begin(("done", i), [0])
        drafter.extend(("done", i), response)
        drafter.end(("done", i))
    drafter.begin("new", prompt)


@pytest.mark.parametrize(
    ("counts", "use_tree", "kept"),
    [
        ((10, 9, 1), True, False),
        ((10, 9, 1), False, True),
        ((30, 19, 3), True, True),
        ((30, 19, 3), False, False),
    ],
)
def test_probabilities_are_float32_products(counts, use_tree, kept):
    # [5, 6] occurs `total` times, `first` times followed by 7, `second` times by 7 8: exactly, 8 has
    # probability 1/10, on min_token_prob. ArcticInference multiplies in float32, p * (c / n) in a chain
    # and (p * c) / n in a tree, and the rounding decides.
    total, first, second = counts
    responses = [[5, 6]] * (total - first) + [[5, 6, 7]] * (first - second) + [[5, 6, 7, 8]] * second
    drafter = SuffixDecodingDrafter(use_tree=use_tree)
    responses_then(drafter, responses, [60, 5, 6])
    proposal = drafter.propose("new", 16)
    p7 = f32(first) / f32(total)
    assert proposal.tokens == ((7, 8) if kept else (7,))
    assert proposal.probs[0] == float(p7)
    if kept:
        p8 = p7 * f32(second) / f32(first) if use_tree else p7 * (f32(second) / f32(first))
        assert proposal.probs[1] == float(p8) == float(f32(0.1))


def test_scores_are_float32_sums():
    # The request's own text drafts [300, 301] at 1/2 each: score 1. The global tree drafts ten tokens
    # at 1/10 each: exactly 1 too, but 1.0000001 summed in float32, so it replaces the request's draft.
    s = list(range(100, 110))
    drafter = SuffixDecodingDrafter()
    responses_then(drafter, [s] * 9 + [s + list(range(200, 210))], [108, 109, 300, 301, 7, *s])
    assert drafter.propose("new", 16).tokens == tuple(range(200, 210))
    text = drafter._texts["new"]
    local = suffix.speculate([text], text.tail(64), 16, **drafter.settings)
    assert local.tokens == (300, 301) and local.score == 1.0


def test_budget_is_computed_in_float32():
    # A 30-token match: 30 * 1.05 + 0.5 is 32 exactly, 31.999998 in float32, so 31 tokens.
    block = list(range(100, 170))
    drafter = SuffixDecodingDrafter(max_spec_factor=1.05, max_spec_offset=0.5)
    drafter.begin(0, [*block, 1, *block[:30]])
    assert drafter.propose(0, 40).tokens == tuple(block[30:61])


def test_invalid_settings_and_tokens():
    with pytest.raises(ValueError):
        SuffixDecodingDrafter(max_depth=0)
    with pytest.raises(ValueError):
        SuffixDecodingDrafter(min_token_prob=1.5)
    with pytest.raises(ValueError):
        TokenCorpus().append([3, -2])


@pytest.fixture(scope="module")
def plain(tiny):
    prompts = random_prompts(6, seed=4)
    return prompts, Engine(tiny).generate(prompts, NO_EOS)


@pytest.mark.parametrize("use_tree", [True, False])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_engine_output_equals_plain_decoding(tiny, plain, batch_size, use_tree):
    prompts, reference = plain
    engine = Engine(tiny, SuffixDecodingDrafter(use_tree=use_tree), budget=8, adaptive_budget=False)
    outputs = engine.generate(prompts, NO_EOS, batch_size=batch_size)
    assert [o.tokens for o in outputs] == [o.tokens for o in reference]
    assert sum(o.stats.accepted for o in outputs) > 20  # drafts were verified and some accepted
