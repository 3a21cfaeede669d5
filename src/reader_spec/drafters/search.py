"""READER's statistical search: find the current suffix elsewhere and weigh what followed it.

* ``SuffixIndex`` finds the longest suffix of a text that occurred before and the occurrences that
  followed it, and grows in O(max_ngram) per appended token, so it is kept up to date as tokens are
  accepted instead of being rebuilt every step (the request's own text, and earlier responses).
* Pure functions turn any source's continuations into a weighted prefix trie
  (``build_continuation_trie``) and pick the nodes of highest path probability in the union of the
  sources' tries under a node budget (``select_best_first``).
* ``AcceptanceCalibrator`` learns from verification outcomes (``calibration_trials``) how far each
  source's raw counts can be trusted at each match length.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from reader_spec.tree import EMPTY_PROPOSAL, Proposal

# An n-gram's key is an exact integer: its tokens read backwards, (token + 1) per 32-bit digit. The +1
# keeps every digit nonzero, so n-grams of different lengths never share a key and one dict holds all.
_TOKEN_BITS = 32
_TOKEN_LIMIT = (1 << _TOKEN_BITS) - 1


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


NO_MATCH = Match(0, -1)


class SuffixIndex:
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
        if max_ngram < 1:
            raise ValueError("max_ngram must be at least 1")
        self.max_ngram = max_ngram
        self._tokens: list[int] = []
        self._last: dict[int, int] = {}
        self._prev: list[int] = []
        self._depth: list[int] = []
        self._suffix_match = 0

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> Sequence[int]:
        """The indexed text (a live view: read it, never change it)."""
        return self._tokens

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
                return NO_MATCH
            return Match(length, self._prev[(len(self._tokens) - 1) * self.max_ngram + length - 1])
        tail = _checked(query[-self.max_ngram :])
        key, found = 0, NO_MATCH
        for n in range(1, len(tail) + 1):
            key = (key << _TOKEN_BITS) | (tail[-n] + 1)
            q = self._last.get(key)
            if q is None:
                return self._extend_leaf(found, tail)
            found = Match(n, q)
        return found

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

    def continuations(self, match: Match, max_occurrences: int, max_depth: int) -> list[list[int]]:
        """What followed each of the newest occurrences: up to ``max_depth`` tokens, cut at the text end."""
        toks = self._tokens
        return [toks[q + 1 : q + 1 + max_depth] for q in self.occurrences(match, max_occurrences)]


@dataclass
class ContinuationTrie:
    """Continuations merged by common prefix; node 0 is the root (the current last token).

    ``weights[i]`` is the total weight of continuations through node ``i``; ``child_weights[i]`` the
    part that goes on to a child. Continuations that stop at a node (cut by the text end) say nothing
    about what follows it, so child probabilities are shares of ``child_weights``, not of ``weights``.
    """

    tokens: list[int] = field(default_factory=lambda: [-1])
    depths: list[int] = field(default_factory=lambda: [0])
    weights: list[float] = field(default_factory=lambda: [0.0])
    child_weights: list[float] = field(default_factory=lambda: [0.0])
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])


def build_continuation_trie(continuations: Iterable[tuple[Sequence[int], float]]) -> ContinuationTrie:
    """Merge weighted continuations (token sequence, weight) into a prefix trie.

    Weights that are not positive carry no evidence and are skipped. Children keep insertion order, so
    with continuations given newest first, equal weights rank the most recent continuation first
    (determinism, and recency as the tie-breaker).
    """
    trie = ContinuationTrie()
    tokens, depths, weights, child_weights, children = (
        trie.tokens,
        trie.depths,
        trie.weights,
        trie.child_weights,
        trie.children,
    )
    for sequence, weight in continuations:
        if weight <= 0:
            continue
        node = 0
        weights[0] += weight
        for token in sequence:
            child_weights[node] += weight
            child = children[node].get(token)
            if child is None:
                child = len(tokens)
                children[node][token] = child
                tokens.append(token)
                depths.append(depths[node] + 1)
                weights.append(0.0)
                child_weights.append(0.0)
                children.append({})
            weights[child] += weight
            node = child
    return trie


@dataclass(frozen=True)
class SourceTrie:
    """One source's continuations after its longest match, and how far to trust them by depth.

    ``confidence[d - 1]`` is the calibrated acceptance rate of the source's edges into depth ``d``
    (their match with the text is then ``match_length + d - 1`` tokens long).
    """

    name: str
    match_length: int
    trie: ContinuationTrie
    confidence: Sequence[float]


def select_best_first(
    sources: Sequence[SourceTrie], max_nodes: int, max_breadth: int | None = None
) -> Proposal:
    """The ``max_nodes`` nodes of highest path probability in the union of the sources' tries.

    A node of the union is a token path; each source holding the path proposes its children, an edge
    into depth ``d`` with probability ``min(1, confidence[d - 1] * share)``, where share is the
    child's fraction of the source's onward weight there. Where several sources propose the same
    child, the most confident estimate counts (each is calibrated on its own; agreement is not taken
    as independent evidence). A path's probability is the product along it; every factor is at most
    1, so popping a max-heap of frontier nodes yields exactly the top nodes with every parent before
    its children (the rule EAGLE-2 and Sequoia use: with calibrated probabilities it maximises the
    expected accepted length). ``max_breadth`` keeps only the likeliest children of each node (1 gives
    a chain). A node is labelled with the source of its estimate; zero-probability nodes never appear.
    """
    if max_nodes <= 0 or not sources:
        return EMPTY_PROPOSAL
    heap: list[tuple[float, int, int, str, tuple[int, ...]]] = []
    counter = 0  # ties keep the order of discovery: deterministic, and recency-first within a source

    def push_children(nodes: tuple[int, ...], prob: float, index: int) -> None:
        nonlocal counter
        best: dict[int, tuple[float, str, list[int]]] = {}
        for k, (source, node) in enumerate(zip(sources, nodes, strict=True)):
            if node < 0:
                continue
            trie = source.trie
            total = trie.child_weights[node]
            for token, child in trie.children[node].items():
                edge = min(1.0, source.confidence[trie.depths[child] - 1] * trie.weights[child] / total)
                entry = best.get(token)
                if entry is None:
                    entry = best[token] = (0.0, source.name, [-1] * len(sources))
                entry[2][k] = child
                if edge > entry[0]:
                    best[token] = (edge, source.name, entry[2])
        ranked = sorted(best.items(), key=lambda item: -item[1][0])
        for token, (edge, name, children) in ranked[:max_breadth]:
            if prob * edge > 0.0:
                heapq.heappush(heap, (-prob * edge, counter, index, name, (token, *children)))
                counter += 1

    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    names: list[str] = []
    push_children(tuple([0] * len(sources)), 1.0, -1)
    while heap and len(tokens) < max_nodes:
        neg_prob, _, parent, name, (token, *children) = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        probs.append(-neg_prob)
        names.append(name)
        push_children(tuple(children), -neg_prob, len(tokens) - 1)
    if not tokens:
        return EMPTY_PROPOSAL
    return Proposal(tuple(tokens), tuple(parents), tuple(probs), tuple(names))


def edge_shares(trie: ContinuationTrie, proposal: Proposal) -> tuple[float, ...]:
    """Per proposed node: its fraction of its parent's onward weight in ``trie`` (0 where absent)."""
    nodes: list[int] = []
    shares: list[float] = []
    for token, parent in zip(proposal.tokens, proposal.parents, strict=True):
        above = nodes[parent] if parent >= 0 else 0
        node = trie.children[above].get(token, -1) if above >= 0 else -1
        nodes.append(node)
        shares.append(trie.weights[node] / trie.child_weights[above] if node >= 0 else 0.0)
    return tuple(shares)


def calibration_trials(
    proposal: Proposal, shares: Sequence[float], accepted: Sequence[int]
) -> list[tuple[int, bool, float]]:
    """What one verification says about a source: (depth, hit, exposure) per level it was tested at.

    At each depth the accepted path reached, the drafted children of the path's node there were
    tested. Their summed shares are the source's exposure; a hit means the accepted child is one the
    source proposed. Levels where the source proposed nothing tested carry no evidence and are skipped.
    """
    path = [-1, *accepted]
    trials = []
    for depth in range(1, len(path) + 1):
        above = path[depth - 1]
        tested = [i for i, parent in enumerate(proposal.parents) if parent == above]
        exposure = sum(shares[i] for i in tested)
        if exposure > 0:
            hit = depth < len(path) and shares[path[depth]] > 0
            trials.append((depth, hit, exposure))
    return trials


class AcceptanceCalibrator:
    """Online estimate of how often a drafted token is accepted, per match-length bucket.

    The model: once a draft's path has been accepted down to a node, the text's suffix matches the
    continuation source over some length m (the initial match L plus the accepted depth), and a child of
    that node is accepted with probability ``min(1, c[b(m)] * share)``, where share is the child's
    fraction of the continuations through the node and ``c[b]`` a per-bucket confidence. Path
    probabilities are products of these factors (``select_best_first``).

    Each attributable level of a verification (``verification_trials``) is one trial at its bucket: a
    hit if the accepted path went on below it, with exposure equal to the summed shares of the nodes
    drafted there (1 for a chain whose occurrences all agree). The estimate is the Beta-Binomial
    posterior mean generalised to fractional exposures,

        c[b] = (prior_mean[b] * strength + hits[b]) / (strength + exposure[b]),

    which is the Beta(prior_mean * strength, (1 - prior_mean) * strength) posterior mean when every
    exposure is 1, and otherwise the rate that makes expected hits equal observed hits. Longer matches
    get higher prior means because they are stronger evidence; data overrides the prior quickly.
    """

    def __init__(
        self,
        bounds: Sequence[int] = (1, 2, 3, 4, 6, 9),
        prior_means: Sequence[float] = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7),
        prior_strength: float = 4.0,
    ) -> None:
        if len(bounds) != len(prior_means) or list(bounds) != sorted(bounds) or bounds[0] != 1:
            raise ValueError("bounds must be ascending from 1, one prior mean per bucket")
        if prior_strength <= 0 or not all(0.0 < m <= 1.0 for m in prior_means):
            raise ValueError("prior means must lie in (0, 1] and the strength be positive")
        self.bounds = tuple(bounds)
        self._alpha = [m * prior_strength for m in prior_means]
        self._trials = [float(prior_strength)] * len(bounds)

    def bucket(self, match_length: int) -> int:
        """Bucket ``i`` holds lengths from ``bounds[i]`` up to the next bound; the last is open-ended."""
        return max(bisect_right(self.bounds, match_length) - 1, 0)

    def confidence(self, match_length: int) -> float:
        b = self.bucket(match_length)
        return self._alpha[b] / self._trials[b]

    def update(self, match_length: int, hits: float, exposure: float) -> None:
        b = self.bucket(match_length)
        self._alpha[b] += hits
        self._trials[b] += exposure
