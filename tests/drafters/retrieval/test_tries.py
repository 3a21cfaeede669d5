"""The compiled retrieval core gives the pure functions' drafts to the bit, ties included."""

from __future__ import annotations

import random

import pytest

from reader_spec.drafters.calibration import RAW_BOUNDS, ProbabilityCalibrator
from reader_spec.drafters.retrieval import native
from reader_spec.drafters.retrieval.calibration import AGREEMENT_LEVELS, match_contexts
from reader_spec.drafters.retrieval.tries import SourceMatch, draft_tree


def random_sources(rng: random.Random) -> list[SourceMatch]:
    """Up to 3 sources over a small alphabet with integer weights and coarse calibration tables, so
    shared prefixes, tokens proposed by several sources and exactly equal probabilities are common."""
    sources = []
    for name in rng.sample(["context", "history", "datastore"], rng.randint(1, 3)):
        depth = rng.randint(1, 8)
        continuations = [
            ([rng.randrange(5) for _ in range(rng.randint(0, depth))], float(rng.choice([0, 1, 1, 2, 3])))
            for _ in range(rng.randint(0, 12))
        ]
        contexts = match_contexts(rng.randint(1, 9), depth)
        calibrator = ProbabilityCalibrator(1 + max(contexts) + AGREEMENT_LEVELS)
        cells = len(calibrator.table())
        table = [rng.choice([0.0, 0.25, 0.5, 0.999, rng.random()]) for _ in range(cells)]
        sources.append(SourceMatch(name, rng.randint(1, 9), continuations, contexts, table))
    return sources


def test_compiled_and_pure_drafts_are_identical(monkeypatch):
    assert native.core() is not None, "the compiled retrieval core must build here (make builds it)"
    rng = random.Random(11)
    compared = nonempty = 0
    for _ in range(3000):
        sources = random_sources(rng)
        max_nodes, max_breadth = rng.randint(0, 40), rng.choice([None, 1, 2, 3])
        compiled = draft_tree(sources, max_nodes, max_breadth)
        with monkeypatch.context() as m:
            m.setattr(native, "core", lambda: None)
            pure = draft_tree(sources, max_nodes, max_breadth)
        assert compiled == pure, (sources, max_nodes, max_breadth)
        compared += 1
        nonempty += bool(pure[0])
    assert nonempty > compared // 2


def test_a_continuation_deeper_than_its_contexts_is_refused(retrieval_path):
    table = ProbabilityCalibrator(16).table()
    with pytest.raises(IndexError):
        draft_tree([SourceMatch("context", 1, [([1, 2, 3], 1.0)], [0], table)], 4)


def test_a_context_outside_the_table_is_refused(retrieval_path):
    with pytest.raises(IndexError):
        draft_tree([SourceMatch("context", 1, [([1], 1.0)], [4], [0.5] * len(RAW_BOUNDS))], 4)


def test_a_refused_call_leaves_the_next_drafts_exact(monkeypatch):
    """The core keeps its buffers from call to call: one that fails half-way must not leak into the next."""
    assert native.core() is not None, "the compiled retrieval core must build here (make builds it)"
    rng = random.Random(5)
    table = ProbabilityCalibrator(16).table()
    refused = [SourceMatch("context", 1, [([1], 1.0), ([1, 2, 3], 1.0)], [0], table)]
    for _ in range(200):
        with pytest.raises(IndexError):
            draft_tree(refused, 4)
        sources, max_nodes = random_sources(rng), rng.randint(1, 40)
        compiled = draft_tree(sources, max_nodes)
        with monkeypatch.context() as m:
            m.setattr(native, "core", lambda: None)
            assert compiled == draft_tree(sources, max_nodes)
