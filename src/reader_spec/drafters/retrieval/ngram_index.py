"""The request's own text as a draft source: every n-gram of a growing text, with its occurrences.

``NgramIndex`` finds the longest suffix of a text that occurred before and the occurrences that
followed it, and grows in O(max_ngram) per appended token, so it is kept up to date as tokens are
accepted instead of being rebuilt every step (the request's own text, and earlier responses).
``CompiledNgramIndex`` keeps the same tables in the compiled retrieval core (the same matches and
occurrences, in the same order); ``ngram_index`` gives the compiled one where the core is built.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from reader_spec.drafters.retrieval import native

# An n-gram's key is an exact integer: its tokens read backwards, (token + 1) per 32-bit digit. The +1
# keeps every digit nonzero, so n-grams of different lengths never share a key and one dict holds all.
_TOKEN_BITS = 32
_TOKEN_LIMIT = (1 << _TOKEN_BITS) - 1

MAX_NGRAM = 255
"""The longest n-gram either index keys: the compiled tables keep n-gram lengths in a byte, and both
indexes take the same settings, so ``READER_SPEC_PURE=1`` never changes what is accepted."""


def _check_max_ngram(max_ngram: int) -> None:
    if not 1 <= max_ngram <= MAX_NGRAM:
        raise ValueError(f"max_ngram must lie in [1, {MAX_NGRAM}], not {max_ngram}")


def _checked(tokens: Iterable[int]) -> list[int]:
    """Plain ints (numpy ints would overflow the shifted keys) inside the range keys can encode."""
    out = [int(t) for t in tokens]
    if out and (min(out) < 0 or max(out) >= _TOKEN_LIMIT):
        raise ValueError(f"token ids must lie in [0, {_TOKEN_LIMIT})")
    return out


class Match(NamedTuple):
    """The longest matched suffix: its length and where its most recent occurrence ends (-1 if none)."""

    length: int
    end: int


NOT_FOUND = Match(0, -1)


class _Text:
    """The indexed text as a Python list, which callers read and slice."""

    _tokens: list[int]

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> Sequence[int]:
        """The indexed text (a live view: read it, never change it)."""
        return self._tokens

    def starts(self, text: Sequence[int]) -> bool:
        """Whether ``text`` begins with the indexed text."""
        n = len(self._tokens)
        return (
            n <= len(text) and (n == 0 or text[n - 1] == self._tokens[-1]) and list(text[:n]) == self._tokens
        )


class NgramIndex(_Text):
    """Every n-gram (n <= ``max_ngram``) of a growing text, with its occurrences, newest first.

    ``_last[key]`` is the newest end position of an n-gram and ``_prev[p * max_ngram + n - 1]`` the
    end of the occurrence before the one ending at ``p``, so occurrences form a linked list per n-gram
    and an append only touches the new position's own n-grams. Keys are stored lazily, as in a suffix
    tree's leaves: a position's n-grams are indexed only up to the first one that is new (``_depth``);
    when a later occurrence shares that n-gram, the older position gets its next key. Novel text thus
    costs about one dict update per token, repeated text up to ``max_ngram``; memory is at most
    linear in text length times ``max_ngram``.
    """

    def __init__(self, max_ngram: int = 12) -> None:
        _check_max_ngram(max_ngram)
        self.max_ngram = max_ngram
        self._tokens: list[int] = []
        self._last: dict[int, int] = {}
        self._prev: list[int] = []
        self._depth: list[int] = []
        self._suffix_match = 0

    def copy(self) -> NgramIndex:
        """An independent index of the same text: copying its tables runs at C speed, far below the
        cost of indexing the text again (a conversation's next turn re-sends all of it)."""
        other = NgramIndex(self.max_ngram)
        other._tokens = list(self._tokens)
        other._last = dict(self._last)
        other._prev = list(self._prev)
        other._depth = list(self._depth)
        other._suffix_match = self._suffix_match
        return other

    def append(self, tokens: Iterable[int]) -> None:
        """Index new tokens one position at a time (the same work whether they come in bulk or not)."""
        toks, last, prev, depth = self._tokens, self._last, self._prev, self._depth
        big_n, bits = self.max_ngram, _TOKEN_BITS
        new = _checked(tokens)
        first = len(toks)
        toks.extend(new)
        prev.extend([-1] * (len(new) * big_n))
        matched = self._suffix_match
        for p in range(first, len(toks)):
            # The n-grams ending at p, shortest first, are built from the tokens read backwards.
            backwards = toks[p : p - big_n if p >= big_n else None : -1]
            key, base = 0, p * big_n - 1
            for n, token in enumerate(backwards, 1):
                key = (key << bits) | (token + 1)
                q = last.get(key)
                last[key] = p
                if q is None:  # first occurrence of this n-gram: p becomes a leaf here
                    depth.append(n)
                    matched = n - 1
                    break
                prev[base + n] = q
                if depth[q] == n and n <= q and n < big_n:  # q was a leaf: give it its next key
                    last[(key << bits) | (toks[q - n] + 1)] = q
                    depth[q] = n + 1
            else:  # every n-gram up to the cap occurred before (the loop ran at least once)
                depth.append(n)
                matched = n
        self._suffix_match = matched

    def longest_match(self, query: Sequence[int] | None = None) -> Match:
        """Longest suffix (at most ``max_ngram`` tokens) of ``query`` that occurs in the text.

        Without a query the text's own suffix is matched against the text before it: the occurrence
        that is the suffix itself does not count.
        """
        if query is None:
            length = self._suffix_match
            if length == 0:
                return NOT_FOUND
            return Match(length, self._prev[(len(self._tokens) - 1) * self.max_ngram + length - 1])
        tail = _checked(query[-self.max_ngram :])
        key, found = 0, NOT_FOUND
        for n in range(1, len(tail) + 1):
            key = (key << _TOKEN_BITS) | (tail[-n] + 1)
            q = self._last.get(key)
            if q is None:
                return self._extend_leaf(found, tail)
            found = Match(n, q)
        return found

    def suffix_match(self, length: int) -> Match:
        """The text's own last ``length`` tokens (at most ``longest_match().length``) matched against
        the text before them: a shorter match than the longest, with more occurrences."""
        if not 1 <= length <= self._suffix_match:
            raise ValueError(f"the text's suffix matches {self._suffix_match} tokens, not {length}")
        return Match(length, self._prev[(len(self._tokens) - 1) * self.max_ngram + length - 1])

    def _extend_leaf(self, found: Match, tail: list[int]) -> Match:
        """A leaf's longer n-grams are not keyed (it is their only occurrence): compare them directly."""
        length, q = found
        if length == 0 or self._depth[q] != length:
            return found
        toks = self._tokens
        while length < len(tail) and length <= q and toks[q - length] == tail[-length - 1]:
            length += 1
        return Match(length, q)

    def occurrences(self, match: Match, limit: int) -> list[int]:
        """End positions of up to ``limit`` occurrences of the matched n-gram, newest first."""
        length, q = match
        if length == 0 or limit <= 0:
            return []
        if self._depth[q] < length:  # matched past a leaf's keys: it is the only occurrence
            return [q]
        prev, stride, offset = self._prev, self.max_ngram, length - 1
        ends = []
        while q >= 0 and len(ends) < limit:
            ends.append(q)
            q = prev[q * stride + offset]
        return ends

    def continuations(
        self, match: Match, max_occurrences: int, max_depth: int, stop: int | None = None
    ) -> list[tuple[list[int], float]]:
        """What followed each of the newest occurrences, weighing 1 each (as ``draft_tree`` takes
        continuations): up to ``max_depth`` tokens, cut at the text end and before ``stop``."""
        toks, weighted = self._tokens, []
        for q in self.occurrences(match, max_occurrences):
            continuation = toks[q + 1 : q + 1 + max_depth]
            if stop in continuation:
                continuation = continuation[: continuation.index(stop)]
            weighted.append((continuation, 1.0))
        return weighted


class CompiledNgramIndex(_Text):
    """``NgramIndex`` with its tables in the compiled retrieval core (``native.NgramTable``): the
    same answers, at C++ speed; the text is also kept as a Python list for callers that slice it."""

    def __init__(
        self, max_ngram: int = 12, table: native.NgramTable | None = None, tokens: list[int] | None = None
    ) -> None:
        _check_max_ngram(max_ngram)
        self.max_ngram = max_ngram
        self._table = native.core().NgramTable(max_ngram) if table is None else table
        self._tokens: list[int] = [] if tokens is None else tokens

    @property
    def table(self) -> native.NgramTable:
        """The compiled table (``native.NgramTable``), for the core's calls that read it directly."""
        return self._table

    def copy(self) -> CompiledNgramIndex:
        return CompiledNgramIndex(self.max_ngram, self._table.copy(), list(self._tokens))

    def append(self, tokens: Iterable[int]) -> None:
        new = _checked(tokens)
        self._table.append(new)
        self._tokens.extend(new)

    def longest_match(self, query: Sequence[int] | None = None) -> Match:
        if query is None:
            return Match(*self._table.own_match(0))
        return Match(*self._table.longest_match(_checked(query[-self.max_ngram :])))

    def suffix_match(self, length: int) -> Match:
        if length < 1:
            raise ValueError(f"the text's suffix matches {self.longest_match().length} tokens, not {length}")
        return Match(*self._table.own_match(length))

    def occurrences(self, match: Match, limit: int) -> list[int]:
        return self._table.occurrences(match.length, match.end, limit)

    def continuations(
        self, match: Match, max_occurrences: int, max_depth: int, stop: int | None = None
    ) -> list[tuple[list[int], float]]:
        return self._table.continuations(
            match.length, match.end, max_occurrences, max_depth, -1 if stop is None else stop
        )


AnyNgramIndex = NgramIndex | CompiledNgramIndex


def ngram_index(max_ngram: int = 12) -> AnyNgramIndex:
    """An empty index: the compiled one where the retrieval core is built, else the pure one."""
    return NgramIndex(max_ngram) if native.core() is None else CompiledNgramIndex(max_ngram)
