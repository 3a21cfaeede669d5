"""Earlier responses as a draft source shared by every later request (SuffixDecoding's global tree)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from reader_spec.drafters.retrieval.ngram_index import AnyNgramIndex, ngram_index

SEPARATOR = 2**32 - 2
"""Ends every response in the index: never a token id, so no match or continuation crosses it."""

DEFAULT_MAX_TOKENS = 262_144

EVICTION_SLACK = 1.25
"""The index may grow this far past its limit before the oldest responses are dropped in one rebuild,
so rebuilding costs O(1) amortised per added token."""


class ResponseHistory:
    """The newest finished responses, at most ``max_tokens`` of them in all, indexed for suffix lookups.

    Memory is bounded by ``max_tokens``: the index keeps up to ``max_ngram`` links per token, so it
    grows linearly in ``max_tokens`` times ``max_ngram`` and never with the number of requests served.
    """

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS, max_ngram: int = 12) -> None:
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        self.max_tokens = max_tokens
        self.max_ngram = max_ngram
        self._responses: deque[list[int]] = deque()
        self._size = 0
        self._index = ngram_index(max_ngram)

    def __len__(self) -> int:
        """Tokens held."""
        return self._size

    @property
    def index(self) -> AnyNgramIndex:
        """The responses' index, each response followed by ``SEPARATOR``."""
        return self._index

    def add(self, response: Sequence[int]) -> None:
        """Remember a finished response; the oldest ones go once the limit is passed."""
        tokens = list(response)[-self.max_tokens :]
        if not tokens:
            return
        self._responses.append(tokens)
        self._size += len(tokens)
        if self._size <= self.max_tokens * EVICTION_SLACK:
            self._index.append([*tokens, SEPARATOR])
            return
        while self._size > self.max_tokens:
            self._size -= len(self._responses.popleft())
        self._index = ngram_index(self.max_ngram)
        for kept in self._responses:
            self._index.append([*kept, SEPARATOR])

    def lookup(
        self, text: Sequence[int], max_occurrences: int, max_depth: int
    ) -> tuple[int, list[tuple[list[int], float]]]:
        """The longest suffix of ``text`` found in earlier responses, and what followed its newest
        occurrences (each weighing 1), cut at the end of their response."""
        match = self._index.longest_match(text)
        if match.length == 0:
            return 0, []
        return match.length, self._index.continuations(match, max_occurrences, max_depth, stop=SEPARATOR)
