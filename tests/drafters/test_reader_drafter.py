"""ReaderDrafter and its parts: index exactness, best-first trees, calibration from feedback."""

from __future__ import annotations

import math
import random
from itertools import pairwise

import numpy as np
import pytest

from reader_spec.drafters import Drafter, ReaderDrafter
from reader_spec.drafters.calibration import RAW_BOUNDS, ProbabilityCalibrator
from reader_spec.drafters.retrieval.calibration import AGREEMENT_LEVELS, MATCH_BOUNDS, match_contexts
from reader_spec.drafters.retrieval.ngram_index import Match
from reader_spec.drafters.retrieval.tries import SourceTrie, build_continuation_trie, select_best_first
from reader_spec.engine.tree import EMPTY_PROPOSAL, Proposal


def check_tree(proposal: Proposal) -> None:
    """Parents precede children, probabilities are positive, best-first and non-increasing on paths."""
    assert all(-1 <= p < i for i, p in enumerate(proposal.parents))
    assert all(p > 0 for p in proposal.probs)
    assert all(a >= b for a, b in pairwise(proposal.probs))
    for i, parent in enumerate(proposal.parents):
        if parent >= 0:
            assert proposal.probs[i] <= proposal.probs[parent]
    assert set(proposal.sources) <= {"context", "history", "datastore", "context-half", "history-half"}


def path_of(proposal: Proposal, node: int) -> tuple[int, ...]:
    path = []
    while node >= 0:
        path.append(proposal.tokens[node])
        node = proposal.parents[node]
    return tuple(path[::-1])


def brute_self_match(text: list[int], max_ngram: int) -> tuple[int, list[int]]:
    """Longest suffix that ends somewhere before the text's end, and those ends, newest first."""
    for length in range(min(max_ngram, len(text) - 1), 0, -1):
        suffix = text[-length:]
        ends = [q for q in range(length - 1, len(text) - 1) if text[q - length + 1 : q + 1] == suffix]
        if ends:
            return length, ends[::-1]
    return 0, []


def brute_query_match(text: list[int], query: list[int], max_ngram: int) -> tuple[int, list[int]]:
    """Longest suffix of ``query`` found anywhere in ``text``, and its ends, newest first."""
    for length in range(min(max_ngram, len(query)), 0, -1):
        suffix = query[-length:]
        ends = [q for q in range(length - 1, len(text)) if text[q - length + 1 : q + 1] == suffix]
        if ends:
            return length, ends[::-1]
    return 0, []


def estimate(drafter: ReaderDrafter, source: str, length: int, raw: float, agreeing: int = 1) -> float:
    """The calibrated estimate of an edge whose source matches ``length`` tokens of the text there,
    with raw estimate ``raw``, proposed by ``agreeing`` sources."""
    return drafter.calibrators[source](raw, match_contexts(length, 1)[0] + agreeing - 1)


def brute_path_probs(continuations: list[list[int]], edge_of) -> dict[tuple[int, ...], float]:
    """Every trie path's probability, computed from prefix counts without a trie;
    ``edge_of(depth, k, n)`` is an edge's estimate where ``k`` of ``n`` onward continuations take it."""
    through: dict[tuple[int, ...], int] = {}
    onward: dict[tuple[int, ...], int] = {}
    for c in continuations:
        for d in range(len(c) + 1):
            through[tuple(c[:d])] = through.get(tuple(c[:d]), 0) + 1
            if d < len(c):
                onward[tuple(c[:d])] = onward.get(tuple(c[:d]), 0) + 1
    probs: dict[tuple[int, ...], float] = {}
    for path in sorted(through, key=len):
        if path:
            edge = edge_of(len(path), through[path], onward[path[:-1]])
            probs[path] = probs.get(path[:-1], 1.0) * edge
    return probs


def random_stream(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


def started(prompt: list[int], **kwargs) -> ReaderDrafter:
    """A drafter on the request's own text only, tracking request "r"."""
    drafter = ReaderDrafter(**{"history_tokens": 0, **kwargs})
    drafter.begin("r", prompt)
    return drafter


def test_implements_drafter_protocol() -> None:
    assert isinstance(ReaderDrafter(), Drafter)


def test_repeated_text_continues_as_a_chain() -> None:
    text = [10, 11, 12, 13, 14, 15, 16, 17, 10, 11, 12]
    proposal = started(text).propose("r", 5)
    assert proposal.tokens == (13, 14, 15, 16, 17)
    assert proposal.parents == (-1, 0, 1, 2, 3)
    assert proposal.sources == ("context",) * 5
    check_tree(proposal)


def test_continuation_is_cut_at_the_end_of_the_text() -> None:
    # "7 8 9 7" occurred once before (ending at position 3); only "8 9 7" follows it so far.
    proposal = started([7, 8, 9, 7, 8, 9, 7]).propose("r", 16)
    assert proposal.tokens == (8, 9, 7)
    assert proposal.parents == (-1, 0, 1)


def test_counts_rank_branches_and_set_their_ratio(retrieval_path) -> None:
    # After "1 2" came "3" three times and "4" once: raw estimates 3/5 and 1/5 (one count kept for
    # a continuation not seen yet).
    text = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 4, 7, 1, 2, 3, 6, 1, 2]
    drafter = started(text, half_matches=False)
    proposal = drafter.propose("r", 10)
    check_tree(proposal)
    roots = [i for i, p in enumerate(proposal.parents) if p == -1]
    assert [proposal.tokens[i] for i in roots] == [3, 4]
    assert proposal.probs[roots[0]] == pytest.approx(estimate(drafter, "context", 2, 3 / 5))
    assert proposal.probs[roots[1]] == pytest.approx(estimate(drafter, "context", 2, 1 / 5))
    assert proposal.probs[roots[0]] > 2 * proposal.probs[roots[1]]


def test_no_repetition_gives_an_empty_proposal() -> None:
    drafter = started(list(range(100)))
    assert drafter.propose("r", 8) is EMPTY_PROPOSAL
    drafter.begin("r", [5])
    assert drafter.propose("r", 8) is EMPTY_PROPOSAL


def test_min_match_filters_short_matches() -> None:
    text = [1, 2, 3, 4, 5, 3]  # only "3" repeats
    assert len(started(text).propose("r", 4)) > 0
    assert started(text, min_match=2).propose("r", 4) is EMPTY_PROPOSAL


@pytest.mark.parametrize("max_nodes", [0, -3, 1, 2, 5, 17, 64])
def test_budget_is_respected(max_nodes: int, retrieval_path) -> None:
    rng = random.Random(max_nodes)
    drafter = started(random_stream(rng, 400, 5))
    full = drafter.propose("r", 1000)
    proposal = drafter.propose("r", max_nodes)
    if max_nodes <= 0:
        assert proposal is EMPTY_PROPOSAL
    else:
        assert len(proposal) == min(max_nodes, len(full))
        # Best first: a smaller budget is a prefix of a larger one.
        assert proposal == full.truncated(max_nodes)
        check_tree(proposal)


def test_chain_option_keeps_the_heaviest_child(retrieval_path) -> None:
    text = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 4, 7, 1, 2, 3, 6, 1, 2]
    proposal = started(text, max_breadth=1).propose("r", 10)
    assert proposal.parents == tuple(range(-1, len(proposal) - 1))
    assert proposal.tokens[:2] == (3, 6)  # "3" is the majority; after "1 2 3", the newest continuation
    check_tree(proposal)


def test_propose_is_deterministic() -> None:
    rng = random.Random(7)
    text = random_stream(rng, 300, 4)
    a, b = started(text), started(text)
    assert a.propose("r", 32) == a.propose("r", 32) == b.propose("r", 32)


def test_incremental_extension_equals_rebuilding() -> None:
    rng = random.Random(1234)
    for case in range(300):
        vocab = rng.choice([2, 3, 5, 20, 49152])
        text = random_stream(rng, rng.randrange(1, 120), vocab)
        max_ngram = rng.choice([1, 2, 4, 12])
        split = rng.randrange(len(text) + 1)
        incremental = ReaderDrafter(max_ngram=max_ngram)
        incremental.begin(case, text[:split])
        position = split
        while position < len(text):
            step = rng.randrange(1, 6)
            incremental.extend(case, text[position : position + step])
            position += step
        rebuilt = ReaderDrafter(max_ngram=max_ngram)
        rebuilt.begin(case, text)
        max_nodes = rng.choice([1, 8, 40])
        assert incremental.propose(case, max_nodes) == rebuilt.propose(case, max_nodes), case


def test_index_matches_brute_force_on_its_own_suffix(index_class) -> None:
    rng = random.Random(99)
    for _ in range(300):
        max_ngram = rng.choice([1, 3, 6])
        text = random_stream(rng, rng.randrange(1, 60), rng.choice([3, 4, 5]))
        index = index_class(max_ngram)
        for token in text:  # one token at a time: every intermediate state is checked
            index.append([token])
        length, ends = brute_self_match(text, max_ngram)
        match = index.longest_match()
        assert match.length == length
        assert index.occurrences(match, 10**6) == ends
        limit = rng.randrange(1, 5)
        assert index.continuations(match, limit, 4) == [(text[q + 1 : q + 5], 1.0) for q in ends[:limit]]


def test_index_matches_brute_force_on_external_queries(index_class) -> None:
    rng = random.Random(5)
    for _ in range(300):
        max_ngram = rng.choice([1, 3, 8])
        vocab = rng.choice([2, 3, 5])
        text = random_stream(rng, rng.randrange(0, 60), vocab)
        index = index_class(max_ngram)
        index.append(text)
        query = text[rng.randrange(len(text) + 1) :] if rng.random() < 0.5 else []
        query = query + random_stream(rng, rng.randrange(0, 12), vocab)
        length, ends = brute_query_match(text, query, max_ngram)
        match = index.longest_match(query)
        assert match.length == length
        assert index.occurrences(match, 10**6) == ends


def test_proposal_is_the_top_of_brute_force_path_probabilities(retrieval_path) -> None:
    rng = random.Random(42)
    for _ in range(200):
        max_ngram, max_depth, max_occurrences = rng.choice([2, 5]), rng.choice([1, 3, 6]), rng.choice([2, 64])
        text = random_stream(rng, rng.randrange(2, 80), rng.choice([3, 4, 5]))
        drafter = started(
            text,
            max_ngram=max_ngram,
            max_depth=max_depth,
            max_occurrences=max_occurrences,
            half_matches=False,
        )
        max_nodes = rng.choice([1, 4, 30])
        proposal = drafter.propose("r", max_nodes)
        length, ends = brute_self_match(text, max_ngram)
        if length == 0:
            assert proposal is EMPTY_PROPOSAL
            continue
        continuations = [text[q + 1 : q + 1 + max_depth] for q in ends[:max_occurrences]]
        expected = brute_path_probs(
            continuations,
            lambda d, k, n, drafter=drafter, length=length: estimate(
                drafter, "context", length + d - 1, k / (n + 1)
            ),
        )
        check_tree(proposal)
        assert len(proposal) == min(max_nodes, len(expected))
        for i in range(len(proposal)):
            assert proposal.probs[i] == pytest.approx(expected[path_of(proposal, i)])
        best = sorted(expected.values(), reverse=True)[: len(proposal)]
        assert list(proposal.probs) == pytest.approx(best)


def test_best_first_selection_of_weighted_continuations() -> None:
    trie = build_continuation_trie([([1, 2], 3.0), ([1, 3], 1.0), ([4], 4.0), ([5, 6], 0.0)])
    calibrator = ProbabilityCalibrator()
    proposal, estimates = select_best_first([SourceTrie("corpus", trie, [0, 0], calibrator.table())], 10)
    # Root children: 1 and 4 each 4 of 8 ("5 6" carries no weight), raw 4/9; below 1: 2 (3 of 4,
    # raw 3/5) and 3 (raw 1/5).
    assert proposal.tokens == (1, 4, 2, 3)
    assert proposal.parents == (-1, -1, 0, 0)
    first = calibrator(4 / 9)
    below = first * calibrator(3 / 5), first * calibrator(1 / 5)
    assert proposal.probs == pytest.approx((first, first, *below))
    assert proposal.sources == ("corpus",) * 4
    assert estimates == ((0, 4 / 9), (0, 4 / 9), (0, 3 / 5), (0, 1 / 5))

    def only(trie, table):
        return [SourceTrie("corpus", trie, [0, 0], table)]

    table = calibrator.table()
    assert select_best_first(only(trie, table), max_nodes=0) == (EMPTY_PROPOSAL, ())
    assert select_best_first([], max_nodes=4) == (EMPTY_PROPOSAL, ())
    assert select_best_first(only(build_continuation_trie([]), table), 4) == (EMPTY_PROPOSAL, ())
    assert select_best_first(only(build_continuation_trie([([1], 0.0)]), table), 4) == (EMPTY_PROPOSAL, ())
    assert select_best_first(only(trie, [0.0] * len(table)), 4) == (EMPTY_PROPOSAL, ())  # zero probability


def test_calibration_learns_from_rejections_and_acceptances() -> None:
    text = [10, 11, 12, 13, 14, 15, 16, 17, 10, 11, 12]
    rejected, accepted = started(text, half_matches=False), started(text, half_matches=False)
    first = rejected.propose("r", 4).probs
    for _ in range(30):
        proposal = rejected.propose("r", 4)
        rejected.observe("r", proposal, [])
        proposal = accepted.propose("r", 4)
        accepted.observe("r", proposal, list(range(len(proposal))))
    low, high = rejected.propose("r", 4).probs, accepted.propose("r", 4).probs
    assert low[0] < 0.15 * first[0]
    assert high[0] > 0.85 and all(h > f for h, f in zip(high, first, strict=True))


def test_calibration_uses_truncated_feedback_and_ignores_foreign_proposals() -> None:
    text = [10, 11, 12, 13, 14, 15, 16, 17, 10, 11, 12]
    drafter = started(text, half_matches=False)
    before = estimate(drafter, "context", 3, 0.5)
    drafter.observe("r", Proposal((13,), (-1,), (0.9,)), [0])  # not this drafter's proposal
    proposal = drafter.propose("r", 4)
    drafter.observe("r", proposal.truncated(2), [0, 1])  # the engine verified only two nodes
    drafter.observe("r", proposal, [0, 1, 2, 3])  # feedback already consumed: ignored
    # Two trials, both hits, raw 1/2 (one occurrence): depth 1 at match length 3, depth 2 at 4.
    assert before == pytest.approx(0.55)
    assert estimate(drafter, "context", 3, 0.5) == pytest.approx((0.55 * 4 + 1) / 5)
    assert estimate(drafter, "context", 4, 0.5) == pytest.approx((0.55 * 4 + 1) / 5)
    assert estimate(drafter, "context", 8, 0.5) == pytest.approx(0.55)


def test_requests_are_independent_and_end_forgets() -> None:
    drafter = ReaderDrafter()
    drafter.begin("a", [1, 2, 3, 1, 2])
    drafter.begin("b", [5, 6, 7, 8])
    assert drafter.propose("a", 1).tokens == (3,)
    assert drafter.propose("b", 4) is EMPTY_PROPOSAL
    drafter.extend("b", [5, 6])
    assert drafter.propose("b", 2).tokens == (7, 8)
    assert drafter.propose("a", 1).tokens == (3,)
    drafter.end("a")
    drafter.end("a")  # ending twice is harmless
    with pytest.raises(KeyError):
        drafter.propose("a", 1)
    assert drafter.propose("b", 2).tokens == (7, 8)


def test_token_ids_are_validated_and_numpy_ints_accepted(index_class) -> None:
    with pytest.raises(ValueError):
        index_class().append([1, -1])
    index = index_class()
    index.append(np.array([3, 4, 3], dtype=np.int64))
    assert index.longest_match() == Match(1, 0)
    assert index.longest_match([9, 3, 4]) == Match(2, 1)


def test_probabilities_stay_valid_for_long_deep_matches(retrieval_path) -> None:
    text = [1, 2, 3, 4] * 40
    drafter = started(text)
    for _ in range(50):  # drive the estimates of long matches towards 1
        proposal = drafter.propose("r", 64)
        drafter.observe("r", proposal, list(range(len(proposal))))
    proposal = drafter.propose("r", 64)
    check_tree(proposal)
    assert all(0 < p <= 1 and not math.isnan(p) for p in proposal.probs)


# --- several sources in one tree ------------------------------------------------------------------------
class FixedSource:
    """A long-term source that always reports the same match."""

    def __init__(self, length: int, continuations: list[tuple[list[int], float]]):
        self.length, self.continuations = length, continuations
        self.queries: list[list[int]] = []

    def lookup(self, text, max_occurrences, max_depth):
        self.queries.append(list(text))
        return self.length, [(c[:max_depth], w) for c, w in self.continuations[:max_occurrences]]


def test_sources_merge_into_one_prefix_tree_with_the_most_confident_estimate(retrieval_path):
    datastore = FixedSource(6, [([4, 5, 6], 3.0), ([4, 9], 1.0)])
    drafter = started([1, 2, 3, 4, 5, 7, 1, 2, 3], datastore=datastore, half_matches=False)
    proposal = drafter.propose("r", 10)
    check_tree(proposal)
    by_path = {path_of(proposal, i): (proposal.probs[i], proposal.sources[i]) for i in range(len(proposal))}
    # Both sources propose 4 first (context 1 of 1 occurrence, datastore 4 of 4): one node, with the
    # larger of the two calibrated estimates, each in its context of two agreeing sources.
    both = estimate(drafter, "context", 3, 1 / 2, 2), estimate(drafter, "datastore", 6, 4 / 5, 2)
    assert both[1] > both[0]
    assert by_path[(4,)] == (pytest.approx(both[1]), "datastore")
    # Below 4: context says 5 (1 of 1), the datastore 5 (3 of 4) or 9 (1 of 4).
    p4 = by_path[(4,)][0]
    five = max(estimate(drafter, "context", 4, 1 / 2, 2), estimate(drafter, "datastore", 7, 3 / 5, 2))
    assert by_path[(4, 5)][0] == pytest.approx(p4 * five)
    assert by_path[(4, 9)] == (pytest.approx(p4 * estimate(drafter, "datastore", 7, 1 / 5)), "datastore")
    assert datastore.queries[-1] == [1, 2, 3, 4, 5, 7, 1, 2, 3]


def test_each_source_learns_from_its_own_nodes(retrieval_path):
    datastore = FixedSource(2, [([50], 1.0)])
    drafter = started([1, 2, 3, 4, 1, 2, 3], datastore=datastore, half_matches=False)
    context_before = estimate(drafter, "context", 3, 1 / 2)
    store_before = estimate(drafter, "datastore", 2, 1 / 2)
    for _ in range(20):
        proposal = drafter.propose("r", 2)  # root children: 4 (context) and 50 (datastore)
        accepted = [proposal.tokens.index(4)]
        drafter.observe("r", proposal, accepted)
    assert estimate(drafter, "context", 3, 1 / 2) > context_before
    assert estimate(drafter, "datastore", 2, 1 / 2) < store_before
    proposal = drafter.propose("r", 2)
    assert proposal.tokens[0] == 4 and proposal.sources[0] == "context"


def test_a_source_is_calibrated_only_on_the_nodes_it_labelled(retrieval_path):
    datastore = FixedSource(1, [([4], 1.0)])  # agrees with the context on 4, with an equal estimate
    drafter = started([1, 2, 3, 4, 1, 2, 3], datastore=datastore, half_matches=False)
    store_before = drafter.calibrators["datastore"].table()
    context_before = estimate(drafter, "context", 3, 1 / 2, 2)
    proposal = drafter.propose("r", 1)
    assert proposal.tokens == (4,) and proposal.sources == ("context",)  # ties: the first source
    drafter.observe("r", proposal, [0])
    assert estimate(drafter, "context", 3, 1 / 2, 2) > context_before
    assert drafter.calibrators["datastore"].table() == store_before


def test_history_drafts_what_an_earlier_request_answered(retrieval_path):
    drafter = ReaderDrafter()
    drafter.begin("first", [1, 2])
    drafter.extend("first", [30, 31, 32, 33, 34])
    drafter.end("first")
    drafter.begin("second", [7, 8, 30, 31])
    proposal = drafter.propose("second", 8)
    assert proposal.tokens == (32, 33, 34)
    assert set(proposal.sources) == {"history"}
    assert drafter.source_names == ("context", "history", "context-half", "history-half")


def test_sources_can_be_switched_off():
    assert ReaderDrafter(history_tokens=0).source_names == ("context", "context-half")
    assert ReaderDrafter(history_tokens=0, half_matches=False).source_names == ("context",)
    only_store = ReaderDrafter(context=False, history_tokens=0, datastore=FixedSource(3, [([5, 6], 1.0)]))
    only_store.begin("r", [1, 2, 3, 1, 2, 3])
    proposal = only_store.propose("r", 4)
    assert proposal.tokens == (5, 6) and set(proposal.sources) == {"datastore"}
    with pytest.raises(ValueError):
        ReaderDrafter(history_tokens=-1)


def observed(index) -> tuple:
    """What an index answers: its text, its own match and occurrences, and every query match."""
    match = index.longest_match()
    text = list(index.tokens)
    queries = [index.longest_match(text[-k:]) for k in range(1, 14)]
    return text, match, index.occurrences(match, 10**6), queries, index.continuations(match, 64, 8)


def test_a_next_turn_starts_from_a_copy_of_the_ended_turns_index(monkeypatch, retrieval_path) -> None:
    """A prompt that extends an ended request's whole text reuses its index: the same answers and
    proposals as indexing from scratch, the ended index untouched, and another prompt indexed anew."""
    rng = random.Random(3)
    phrases = [[rng.randrange(50) for _ in range(6)] for _ in range(5)]
    turn = [t for _ in range(30) for t in rng.choice(phrases)]
    reused, fresh = ReaderDrafter(history_tokens=0), ReaderDrafter(history_tokens=0)
    reused.begin("t1", turn[:100])
    reused.extend("t1", turn[100:120])
    reused.end("t1")
    (ended,) = reused._ended
    ended_before = observed(ended)
    copies, copy = [], type(ended).copy
    monkeypatch.setattr(type(ended), "copy", lambda self: copies.append(self) or copy(self))
    for drafter, name in ((reused, "t2"), (fresh, "t2")):
        drafter.begin(name, turn[:120] + turn[120:170])
    a, b = reused._requests["t2"].index, fresh._requests["t2"].index
    assert a is not ended and observed(a) == observed(b)
    assert reused.propose("t2", 12) == fresh.propose("t2", 12)
    assert observed(ended) == ended_before
    reused.begin("other", [7, 8, 9, *turn[:50]])  # not an extension: indexed from scratch
    assert list(reused._requests["other"].index.tokens) == [7, 8, 9, *turn[:50]] and len(copies) == 1


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"half_matches": False, "max_breadth": 2},
        {"context": False, "min_match": 2, "max_ngram": 5},
        {"history_tokens": 0, "max_depth": 3, "max_occurrences": 5},
    ],
)
def test_compiled_and_pure_drafting_agree_through_a_whole_run(tmp_path, monkeypatch, settings):
    """Context, history and a datastore, fed back as a replay does, with extensions after drafted
    paths: the compiled core and the pure functions propose the same trees and leave the
    calibrators in the same state."""
    from reader_spec.drafters.retrieval import native
    from reader_spec.drafters.retrieval.datastore import Datastore

    assert native.core() is not None, "the compiled retrieval core must build here (make builds it)"
    rng = random.Random(5)
    phrases = [[rng.randrange(40) for _ in range(rng.randint(3, 9))] for _ in range(12)]
    documents = [[t for _ in range(30) for t in rng.choice(phrases)] for _ in range(20)]
    store = Datastore.build(tmp_path / "store", documents, fingerprint="fp", model="m")
    texts = [[t for _ in range(40) for t in rng.choice(phrases)] for _ in range(3)]

    def run() -> tuple[list[Proposal], list]:
        drafter, proposals = ReaderDrafter(datastore=store, **settings), []
        for number, text in enumerate(texts):
            drafter.begin(number, text[:30])
            at = 30
            while at < len(text):
                path = text[at : at + rng_budget.randint(1, 4)]
                if rng_budget.random() < 0.3:  # a path the text does not take
                    path = [rng_budget.randrange(40) for _ in path]
                proposals.append(drafter.propose_extensions([number], [path], rng_budget.randint(0, 12))[0])
                proposal = drafter.propose(number, rng_budget.randint(1, 24))
                proposals.append(proposal)
                accepted, node = [], -1
                for token in text[at:]:
                    node = next(
                        (
                            i
                            for i in range(len(proposal))
                            if proposal.parents[i] == node and proposal.tokens[i] == token
                        ),
                        None,
                    )
                    if node is None:
                        break
                    accepted.append(node)
                drafter.observe(number, proposal, accepted)
                step = text[at : at + len(accepted) + 1]
                drafter.extend(number, step)
                at += len(step)
            drafter.end(number)
        state = [c.table() for c in drafter.calibrators.values()]
        return proposals, state

    rng_budget = random.Random(1)
    compiled = run()
    monkeypatch.setattr(native, "core", lambda: None)
    rng_budget = random.Random(1)
    pure = run()
    assert compiled == pure
    sources = set(ReaderDrafter(datastore=store, **settings).source_names)  # each of them drafted
    assert sum(len(p) for p in pure[0]) > 1000 and {s for p in pure[0] for s in p.sources} == sources


def test_a_batch_proposes_what_its_requests_propose_one_by_one(tmp_path, retrieval_path):
    """propose_batch (one datastore call for the batch, parallel in the compiled core) equals each
    request's propose, with every source on."""
    from reader_spec.drafters.retrieval.datastore import Datastore

    rng = random.Random(8)
    phrases = [[rng.randrange(30) for _ in range(rng.randint(3, 8))] for _ in range(10)]
    documents = [[t for _ in range(20) for t in rng.choice(phrases)] for _ in range(10)]
    store = Datastore.build(tmp_path / "store", documents, fingerprint="fp", model="m")
    texts = [[t for _ in range(30) for t in rng.choice(phrases)] for _ in range(6)]
    batched, single = ReaderDrafter(datastore=store), ReaderDrafter(datastore=store)
    for drafter in (batched, single):
        drafter.begin("old", texts[0][:50])
        drafter.end("old")  # something in the history
        for number, text in enumerate(texts[1:]):
            drafter.begin(number, text[:40])
    requests = list(range(len(texts) - 1))
    for at in range(40, 140, 10):
        one_call = batched.propose_batch(requests, 16)
        assert one_call == [single.propose(r, 16) for r in requests]
        assert any(set(p.sources) & {"datastore"} for p in one_call)
        for drafter in (batched, single):
            for r in requests:
                drafter.extend(r, texts[r + 1][at : at + 10])
    assert batched.propose_batch(requests, 0) == [EMPTY_PROPOSAL] * len(requests)


def test_suffix_match_of_every_length_equals_brute_force(index_class) -> None:
    rng = random.Random(9)
    for _ in range(200):
        text = random_stream(rng, rng.randrange(2, 60), rng.choice([2, 3, 5]))
        index = index_class(6)
        index.append(text)
        longest = index.longest_match()
        for length in range(1, longest.length + 1):
            match = index.suffix_match(length)
            ends = [
                q
                for q in range(len(text) - 1)
                if q + 1 >= length and text[q + 1 - length : q + 1] == text[-length:]
            ]
            assert match.length == length and index.occurrences(match, 10**6) == ends[::-1]
        with pytest.raises(ValueError):
            index.suffix_match(longest.length + 1)


def test_half_matches_add_what_the_shorter_match_continues_with(retrieval_path) -> None:
    """The longest match (5 6 1 2) occurred once and went on with 9; its half (1 2) occurred twice
    more, going on with 7: both are drafted, each labelled and calibrated as its own source."""
    text = [1, 2, 7, 1, 2, 7, 3, 5, 6, 1, 2, 9, 4, 5, 6, 1, 2]
    drafter = started(text)
    proposal = drafter.propose("r", 8)
    first = {
        proposal.tokens[i]: proposal.sources[i] for i in range(len(proposal)) if proposal.parents[i] == -1
    }
    assert first == {9: "context", 7: "context-half"}
    assert started(text, half_matches=False).propose("r", 8).tokens[0] == 9
    before = estimate(drafter, "context-half", 2, 2 / 4)  # "1 2" went on with 7 twice, 9 once
    accepted = [i for i, t in enumerate(proposal.tokens) if t == 7 and proposal.parents[i] == -1]
    drafter.observe("r", proposal, accepted)
    assert estimate(drafter, "context-half", 2, 2 / 4) > before
    assert "context-half" in drafter.source_names and drafter.settings["half_matches"] is True


def calibration_tables(drafter: ReaderDrafter) -> dict[str, tuple[float, ...]]:
    return {name: calibrator.table() for name, calibrator in drafter.calibrators.items()}


def test_an_extension_drafts_what_follows_a_drafted_path(retrieval_path) -> None:
    """After a path the text does not hold yet (3 4, drafted by a model after the text's last token),
    the sources are matched with the path as a query: 1 2 3 4 went on with 5 6 earlier."""
    text = [1, 2, 3, 4, 5, 6, 9, 1, 2]
    drafter = started(text)
    drafter.propose("r", 8)
    extension = drafter.propose_extensions(["r"], [(3, 4)], 8)[0]
    check_tree(extension)
    assert path_of(extension, 1) == (5, 6) and extension.sources[0] == "context"
    assert started(text).propose("r", 8).tokens[0] == 3  # the root's own match: 1 2 went on with 3


def test_an_extension_is_learned_from_apart_and_only_while_current(retrieval_path) -> None:
    drafter = started([1, 2, 3, 4, 5, 6, 9, 1, 2])
    root = drafter.propose("r", 8)
    extension = drafter.propose_extensions(["r"], [(3, 4)], 8)[0]
    before = calibration_tables(drafter)
    drafter.observe("r", root.truncated(1), [0])  # the root's feedback leaves the extension pending
    after_root = calibration_tables(drafter)
    assert after_root != before
    drafter.observe_extension("r", extension.truncated(2), [0, 1])
    assert calibration_tables(drafter) != after_root
    learned = calibration_tables(drafter)
    drafter.observe_extension("r", extension.truncated(2), [0, 1])  # consumed: nothing more to learn
    drafter.propose_extensions(["r"], [(3, 4)], 8)
    drafter.propose("r", 8)  # a new step: the last extension is stale
    drafter.observe_extension("r", extension.truncated(2), [0, 1])
    assert calibration_tables(drafter) == learned


def test_a_refused_batch_leaves_the_next_drafts_exact(monkeypatch):
    """A batch the compiled core refuses half-way (a request that is not an index's table, a
    calibration table too short for a source's contexts) raises, and the next batch drafts as the
    pure path does."""
    from reader_spec.drafters.retrieval import native

    core = native.core()
    assert core is not None, "the compiled retrieval core must build here (make builds it)"
    rng = random.Random(3)
    phrases = [[rng.randrange(20) for _ in range(rng.randint(2, 6))] for _ in range(6)]
    texts = [[t for _ in range(40) for t in rng.choice(phrases)] for _ in range(4)]

    def proposals() -> list[Proposal]:
        drafter = ReaderDrafter()
        for number, text in enumerate(texts[:-1]):
            drafter.begin(number, text)
            drafter.end(number)  # into the history
        drafter.begin("r", texts[-1])
        return [drafter.propose("r", budget) for budget in (1, 5, 16)]

    compiled = proposals()
    drafter = ReaderDrafter()
    drafter.begin("r", texts[-1])
    state = drafter._requests["r"]
    settings = (8, 8, 64, 1, 0, True, True, 0)
    bounds = (RAW_BOUNDS, AGREEMENT_LEVELS, MATCH_BOUNDS)
    tables = tuple(ProbabilityCalibrator(16).table() for _ in range(5))
    names = ("context", "context-half", "history", "history-half", "datastore")
    with pytest.raises(TypeError):
        core.draft_batch(
            [(state.index.table, (), None), ([1, 2], (), None)], None, names, tables, settings, *bounds
        )
    with pytest.raises(IndexError):
        core.draft_batch([(state.index.table, (), None)], None, names, ((0.5,),) * 5, settings, *bounds)
    assert proposals() == compiled
    monkeypatch.setattr(native, "core", lambda: None)
    assert proposals() == compiled and sum(map(len, compiled)) > 5
