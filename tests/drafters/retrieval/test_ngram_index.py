"""The compiled n-gram index answers as the pure one does, through growth, copies and queries."""

from __future__ import annotations

import random

import pytest

from reader_spec.drafters import ReaderDrafter
from reader_spec.drafters.retrieval import native
from reader_spec.drafters.retrieval.ngram_index import MAX_NGRAM, CompiledNgramIndex, NgramIndex


def test_compiled_and_pure_indexes_agree():
    assert native.core() is not None, "the compiled retrieval core must build here (make builds it)"
    rng = random.Random(1)
    checked = 0
    for _ in range(600):
        max_ngram, vocab = rng.choice([1, 2, 3, 5, 12]), rng.choice([2, 3, 5, 50, 2**32 - 2])
        pure, compiled = NgramIndex(max_ngram), CompiledNgramIndex(max_ngram)
        for _ in range(rng.randint(1, 6)):
            chunk = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
            pure.append(chunk)
            compiled.append(chunk)
            if rng.random() < 0.3:  # copies answer alike and stay independent of their source
                pure, compiled = pure.copy(), compiled.copy()
            own = pure.longest_match()
            assert compiled.longest_match() == own and list(compiled.tokens) == list(pure.tokens)
            for length in range(1, own.length + 1):
                match = pure.suffix_match(length)
                assert compiled.suffix_match(length) == match
                assert compiled.occurrences(match, 1000) == pure.occurrences(match, 1000)
            limit, depth, stop = (
                rng.randint(1, 70),
                rng.randint(1, 9),
                rng.choice([None, rng.randrange(vocab)]),
            )
            assert compiled.continuations(own, limit, depth, stop) == pure.continuations(
                own, limit, depth, stop
            )
            query = [rng.randrange(vocab) for _ in range(rng.randint(0, 15))]
            match = pure.longest_match(query)
            assert compiled.longest_match(query) == match
            assert compiled.occurrences(match, 1000) == pure.occurrences(match, 1000)
            checked += 1
    assert checked > 1500


def test_a_copy_is_independent():
    original = CompiledNgramIndex(4)
    original.append([1, 2, 3, 1, 2])
    copy = original.copy()
    copy.append([3, 9])
    assert list(original.tokens) == [1, 2, 3, 1, 2] and original.longest_match().length == 2
    assert list(copy.tokens) == [1, 2, 3, 1, 2, 3, 9] and copy.longest_match().length == 0


@pytest.mark.parametrize("max_ngram", [0, MAX_NGRAM + 1, 300])
def test_max_ngram_outside_the_range_is_refused_alike(index_class, max_ngram):
    with pytest.raises(ValueError, match=rf"max_ngram must lie in \[1, {MAX_NGRAM}\], not {max_ngram}"):
        index_class(max_ngram)


def test_reader_drafter_refuses_the_same_max_ngram_on_both_paths(retrieval_path):
    with pytest.raises(ValueError, match="max_ngram must lie in"):
        ReaderDrafter(max_ngram=300)
    with pytest.raises(ValueError, match="max_ngram must lie in"):
        ReaderDrafter(max_ngram=300, history_tokens=0).begin("request", [1, 2, 3])
    drafter = ReaderDrafter(max_ngram=MAX_NGRAM)
    drafter.begin("request", [1, 2, 3, 1, 2])
    assert drafter.history is not None and drafter.history.index.max_ngram == MAX_NGRAM
