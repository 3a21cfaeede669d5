"""ResponseHistory: earlier responses found by suffix, never across responses, bounded oldest-first."""

from __future__ import annotations

import pytest

from reader_spec.drafters.retrieval.history import ResponseHistory


def test_lookup_finds_the_longest_suffix_and_newest_continuations_first():
    history = ResponseHistory()
    history.add([1, 2, 3, 4, 5])
    history.add([9, 2, 3, 7])
    length, continuations = history.lookup([8, 8, 2, 3], max_occurrences=8, max_depth=4)
    assert length == 2
    assert continuations == [([7], 1.0), ([4, 5], 1.0)]  # cut at the end of each response
    length, continuations = history.lookup([1, 2, 3], max_occurrences=8, max_depth=2)
    assert (length, continuations) == (3, [([4, 5], 1.0)])


def test_matches_never_span_two_responses():
    history = ResponseHistory()
    history.add([1, 2])
    history.add([3, 4])
    length, _ = history.lookup([2, 3], max_occurrences=8, max_depth=4)
    assert length == 1  # "2 3" only exists across the boundary
    assert history.lookup([5], 8, 4) == (0, [])


def test_oldest_responses_are_evicted_past_the_limit():
    history = ResponseHistory(max_tokens=10)
    history.add([1, 2, 3, 4, 5, 6])
    history.add([7, 8, 9, 10, 11, 12])  # 12 tokens, within the eviction slack: both kept
    assert history.lookup([1, 2], 8, 2)[0] == 2
    history.add([13, 14, 15])  # past the slack: the oldest goes
    assert len(history) == 9
    assert history.lookup([1, 2], 8, 2)[0] == 0
    assert history.lookup([7, 8], 8, 2) == (2, [([9, 10], 1.0)])
    history.add(list(range(100, 130)))  # longer than the limit: only its newest tokens are kept
    assert len(history) == 10 and history.lookup([128], 8, 2) == (1, [([129], 1.0)])


def test_invalid_limit():
    with pytest.raises(ValueError):
        ResponseHistory(max_tokens=0)
