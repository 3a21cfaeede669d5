"""SuffixDecoding (Oliaro et al., 2024), the peer built into ArcticInference and vLLM (``suffix``).

What it does, as ArcticInference's ``SuffixDecodingCache`` does it:

* Two kinds of suffix trees with occurrence counts, each holding every substring of at most
  ``max_depth`` tokens of its sequences: a per-request tree over the prompt plus the generated tokens,
  and one global tree over responses (generated tokens only). A response enters the global tree as it
  is generated, so it serves the request itself and every later one; it stays after the request ends
  (no eviction, ArcticInference's default ``max_cached_requests=-1``).
* Each step the context is the text's last ``max_depth`` tokens, and every match length m from 1 up to
  one less than the context's length is tried in each tree (the longest suffix found bounds them; the
  context's first token is never matched). Below the match the tree is grown best-first to
  ``K = min(budget, int(float32(m * max_spec_factor + max_spec_offset) + 1e-6))`` nodes, children
  below ``min_token_prob`` are never taken, and nodes are popped by probability (``use_tree=False``
  descends to the most frequent child instead, a chain).
* A node's probability is a float32 product, as ArcticInference's compressed tree computes it: along a
  run of nodes with the same count (one compressed node there) it does not change, and where the count
  drops from ``n`` to ``c`` it becomes ``p * float32(c / n)`` in a chain and ``float32(p * c) / n`` in
  a tree, rounded to float32 at each operation. Exactly they telescope to ``count(s x) / count(s)``;
  the rounding decides nodes that sit on ``min_token_prob`` (a tree drops 9/10 * 1/9, a chain keeps it).
* A draft's score is the float32 sum of its probabilities in draft order (its expected accepted length);
  the best score over match lengths wins, a longer match on ties, and the global tree's draft replaces
  the request tree's only when it scores strictly higher.
* Counts include every occurrence, also the text's own suffix at its end and occurrences cut by a
  sequence's end or by the depth limit (a string and its continuation together never exceed
  ``max_depth`` tokens), exactly like the counts of ArcticInference's trees.

Ties ArcticInference leaves to the history of its sibling lists (a chain takes the head of the list
of most frequent children, whose order among equal counts depends on the order the counts grew in) and
to its binary heap's layout (equal float32 probabilities) are broken here by a total order: higher
probability, higher count, then shallower, then the more recent occurrence. On the agentic replay this
changes some proposals, mostly between equally scored drafts, and leaves tokens per step slightly above
ArcticInference's own tree (docs/peers.md, "Replay figures").

The structure. An explicit suffix tree with counts costs ``max_depth`` node updates per appended token,
which pure Python cannot afford on agentic prompts of tens of thousands of tokens, each request anew.
``TokenCorpus`` answers the same questions from the text itself. Costs, for a corpus of n tokens:

* append: a vectorized copy, amortized O(1) per token;
* a token's positions: a vectorized scan of the unindexed tail plus O(log n) in a sorted index, which is
  rebuilt (O(n log n)) only once the scans since the last build have cost about as much (rent or buy);
* a step: the occurrences of the pattern's last token, filtered leftwards one match length at a time
  while many, then the survivors' full match lengths at once (vectorized, O(occurrences x max_depth)
  at worst), then a trie over the continuations of the occurrences of the match lengths that can win,
  grown as the match shortens, O(occurrences x budget) Python operations, and a best-first pop of at
  most ``budget`` nodes. Match lengths with the same occurrences and budget share one draft (see
  ``speculate``), so a step usually builds one or two tries.

The drafts equal those of explicit suffix trees: the tests compare every proposal with ArcticInference's
algorithm run on a brute-force suffix trie.
"""

from __future__ import annotations

import functools
import heapq
import math
import struct
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from reader_spec.drafters.token_buffer import TokenBuffer
from reader_spec.engine.tree import EMPTY_PROPOSAL, Proposal

SOURCE = "suffix"

_FLOAT32 = struct.Struct("f")


def _f32(value: float) -> float:
    """``value`` rounded to the nearest float32, ArcticInference's arithmetic. Each float32 operation
    done in float64 and then rounded gives the float32 result exactly (products of two float32 values
    are exact in float64, and float64 has more than twice float32's precision for sums and quotients)."""
    return _FLOAT32.unpack(_FLOAT32.pack(value))[0]


SENTINEL = -1
"""Separates sequences in a corpus buffer; no token id equals it."""


REBUILD_RATIO = 256
"""Scanning n tokens for one value costs a few hundredths of a percent of sorting them on a CPU; the
index is rebuilt once the scans since the last rebuild have read this many times the buffer's length,
so rebuilds never cost more than the scans they save."""


class TokenCorpus:
    """Token sequences in one growing buffer, with an index from each token to its positions.

    Layout ``[-1, a0 a1 ..., -1, b0 b1 ..., -1]``: a sentinel precedes every sequence and follows the
    last one, so a match extended leftwards, or a continuation read rightwards, stops at a sequence
    border without bounds checks. The index holds the first ``indexed`` buffer positions sorted by
    (token, position), built by one stable argsort; positions after them are found by a vectorized
    scan. Rent or buy: the index is (re)built only once the scans since the last build have read
    ``REBUILD_RATIO`` times the buffer's length, so a request's prompt is scanned while that is cheaper
    (short generations) and indexed when it is not (long ones, the global tree), and appending is a copy.
    """

    def __init__(self) -> None:
        self._tokens = TokenBuffer([SENTINEL], fill=SENTINEL, spare=1)  # the leading and trailing sentinels
        self._indexed = 0
        self._scanned = 0
        self._order = np.empty(0, dtype=np.int64)
        self._sorted = np.empty(0, dtype=np.int32)

    @property
    def buffer(self) -> np.ndarray:
        """The whole buffer; entries from ``len(self)`` on are sentinels."""
        return self._tokens.buffer

    def __len__(self) -> int:
        """Buffer length in use, sentinels included."""
        return len(self._tokens)

    def start_sequence(self) -> None:
        """Later tokens form a new sequence: no match or continuation crosses into it."""
        if self._tokens.view()[-1] != SENTINEL:
            self._tokens.extend([SENTINEL])

    def append(self, tokens: Sequence[int]) -> None:
        """Append tokens to the last sequence."""
        new = np.asarray(tokens, dtype=np.int64)
        if not len(new):
            return
        if new.min() < 0 or new.max() > np.iinfo(np.int32).max:
            raise ValueError("token ids must be non-negative 32-bit integers")
        self._tokens.extend(new)

    def positions(self, token: int) -> np.ndarray:
        """Every position holding ``token``, ascending."""
        length = len(self._tokens)
        self._scanned += length - self._indexed
        if self._scanned > REBUILD_RATIO * length:
            used = self._tokens.view()
            self._order = np.argsort(used, kind="stable")
            self._sorted = used[self._order]
            self._indexed, self._scanned = length, 0
        tail = np.flatnonzero(self._tokens.view()[self._indexed :] == token)
        if not self._indexed:
            return tail
        # An int32 needle: mixing in Python ints would make numpy cast the whole index per lookup.
        lo, hi = np.searchsorted(self._sorted, np.array((token, token + 1), dtype=np.int32))
        if not len(tail):
            return self._order[lo:hi]
        return np.concatenate((self._order[lo:hi], tail + self._indexed))

    def tail(self, count: int) -> np.ndarray:
        """The last ``count`` tokens (fewer when the buffer is shorter), sentinels included."""
        used = self._tokens.view()
        return used[max(len(used) - count, 1) :]

    def sequence_tokens(self) -> np.ndarray:
        """The tokens after the leading sentinel."""
        return self._tokens.view()[1:]


ONE_SHOT_CELLS = 8192
"""Occurrences are filtered one match length at a time until occurrences x remaining lengths fit this;
then the remaining occurrences' match lengths are measured at once."""

SMALL_TRIE_ROWS = 48
"""A fresh trie over at most this many continuations is built in Python, over more with numpy."""


class _Matches:
    """The occurrences, in some corpora, of every suffix of a pattern (pattern[-m:] for each m).

    Occurrences of a longer suffix are a subset of a shorter one's, so one pass from the pattern's last
    token leftwards finds them all: while they are many, one length at a time (``early[m]``, ends per
    corpus), then, for the few left, each one's whole match length at once (``rows``: corpus, end,
    length, ordered by corpus then end, so a row's index is its recency rank). ``counts[m]`` is how
    many occurrences pattern[-m:] has.
    """

    def __init__(self, corpora: Sequence[TokenCorpus], pattern: np.ndarray) -> None:
        self.corpora = corpora
        length = len(pattern)
        self.counts = np.zeros(length + 1, dtype=np.int64)
        self.continuing = np.zeros(length + 1, dtype=np.int64)
        self.early: list[list[np.ndarray]] = [[]]
        ends = [c.positions(int(pattern[-1])) for c in corpora]
        m = 1
        total = sum(len(e) for e in ends)
        while total and m < length and total * (length - m) > ONE_SHOT_CELLS:
            self.counts[m] = total
            self.continuing[m] = -1  # counted when needed
            self.early.append(ends)
            want = pattern[length - 1 - m]
            ends = [e[c.buffer[e - m] == want] for c, e in zip(corpora, ends, strict=True)]
            total = sum(len(e) for e in ends)
            m += 1
        self.rows_from = m
        backwards = pattern[::-1][m:]
        offsets = np.arange(m, length)
        corpus_ids, lengths, nexts = [], [], []
        for index, (corpus, e) in enumerate(zip(corpora, ends, strict=True)):
            if not len(e):
                continue
            # Indices below 0 clip to the leading sentinel, where every match has ended anyway.
            before = corpus.buffer.take(e[:, None] - offsets, mode="clip")
            lengths.append(m + np.logical_and.accumulate(before == backwards, axis=1).sum(axis=1))
            corpus_ids.append(np.full(len(e), index))
            nexts.append(corpus.buffer[e + 1] >= 0)
        if not total:  # the longest match, if any, was among the early lengths
            self.row_corpus = self.row_end = self.row_length = np.empty(0, dtype=np.int64)
            self.longest = m - 1
            return
        self.row_corpus = np.concatenate(corpus_ids) if len(lengths) > 1 else corpus_ids[0]
        self.row_end = np.concatenate(ends) if len(lengths) > 1 else next(e for e in ends if len(e))
        self.row_length = np.concatenate(lengths) if len(lengths) > 1 else lengths[0]
        going = np.concatenate(nexts) if len(lengths) > 1 else nexts[0]
        self.counts[m:] = np.cumsum(np.bincount(self.row_length, minlength=length + 1)[::-1])[::-1][m:]
        going_on = np.bincount(self.row_length, weights=going, minlength=length + 1)
        self.continuing[m:] = np.cumsum(going_on[::-1])[::-1][m:]
        self.longest = int(self.row_length.max())

    def continuing_at(self, m: int) -> int:
        """How many occurrences of pattern[-m:] have a token after them."""
        if self.continuing[m] < 0:
            self.continuing[m] = sum(
                int((c.buffer[e + 1] >= 0).sum()) for c, e in zip(self.corpora, self.early[m], strict=True)
            )
        return int(self.continuing[m])

    def windows(self, ends: Sequence[np.ndarray], depth: int) -> np.ndarray:
        """What followed the given ends in each corpus: ``depth`` tokens per row, -1 from a sequence end."""
        steps = np.arange(1, depth + 1)
        rows = [
            # The buffer holds sentinels from its used length to its end, so clipping indices is exact.
            corpus.buffer.take(e[:, None] + steps, mode="clip")
            for corpus, e in zip(self.corpora, ends, strict=True)
            if len(e)
        ]
        windows = np.concatenate(rows) if rows else np.empty((0, depth), dtype=np.int32)
        return np.where(np.logical_or.accumulate(windows < 0, axis=1), SENTINEL, windows)

    def row_windows(self, depth: int) -> list[list[int]]:
        """``windows`` of every row, in row order."""
        ends = [self.row_end[self.row_corpus == i] for i in range(len(self.corpora))]
        return self.windows(ends, depth).tolist()


class _Trie:
    """Continuations of a matched string merged by prefix, with counts; node 0 is the match itself.

    Node lists are parallel and in creation order (parents first). ``recency[n]`` is the newest
    occurrence (highest row rank) through node n.
    """

    def __init__(self) -> None:
        self.token = [SENTINEL]
        self.parent = [-1]
        self.depth = [0]
        self.count = [0]
        self.recency = [-1]
        self.children: list[dict[int, int]] = [{}]

    def node(self, parent: int, token: int, count: int, recency: int) -> int:
        node = len(self.token)
        self.children[parent][token] = node
        self.token.append(token)
        self.parent.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.count.append(count)
        self.recency.append(recency)
        self.children.append({})
        return node

    def add(self, row: list[int], rank: int) -> None:
        """Count one continuation (cut at its first -1) into the trie."""
        node = 0
        for token in row:
            if token < 0:
                return
            child = self.children[node].get(token)
            if child is None:
                child = self.node(node, token, 0, rank)
            self.count[child] += 1
            self.recency[child] = max(self.recency[child], rank)
            node = child

    def key(self, node: int) -> tuple[int, int, int, int]:
        """A chain's choice among children: higher count, then shallower, then more recent."""
        return (-self.count[node], self.depth[node], -self.recency[node], node)

    def select(
        self, total: int, min_prob: float, max_nodes: int, max_depth: int, use_tree: bool
    ) -> tuple[list[int], list[float]]:
        """The nodes a best-first expansion (or a greedy descent) takes, in order, and their float32
        probabilities, taking only nodes of probability ``min_prob`` (a float32) or more and at most
        ``max_depth`` deep; ``total`` is the matched string's count (node 0's)."""
        chosen: list[int] = []
        probs: list[float] = []
        count, children = self.count, self.children
        if use_tree:
            frontier: list[tuple[float, int, int, int, int]] = []

            def expand(node: int, prob: float) -> None:
                above = count[node] if node else total
                for child in children[node].values():
                    c = count[child]
                    # Equal counts: the same compressed node in ArcticInference, the same probability.
                    p = prob if c == above else _f32(_f32(prob * c) / above)
                    if p >= min_prob:
                        heapq.heappush(frontier, (-p, -c, self.depth[child], -self.recency[child], child))

            expand(0, 1.0)
            while frontier and len(chosen) < max_nodes:
                neg_prob, _, depth, _, node = heapq.heappop(frontier)
                chosen.append(node)
                probs.append(-neg_prob)
                if depth < max_depth:
                    expand(node, -neg_prob)
        else:
            node, prob = 0, 1.0
            while len(chosen) < min(max_nodes, max_depth) and children[node]:
                above = count[node] if node else total
                node = min(children[node].values(), key=self.key)
                if count[node] < above:
                    prob = _f32(prob * _f32(count[node] / above))
                if prob < min_prob:
                    break
                chosen.append(node)
                probs.append(prob)
        return chosen, probs


FLOAT32_SLACK = 1e-4
"""Float32 probabilities and scores differ from exact count ratios and their sums by far less than this,
relatively (a probability takes at most 2 x 64 roundings of 2**-24 each, a score adds one per token),
so nodes whose ratio is below ``(1 - FLOAT32_SLACK) * min_token_prob`` can never pass the float32 test
and are not built, and drafts whose exact bound is below ``best / (1 + FLOAT32_SLACK)`` cannot win."""


def _min_count(total: int, min_prob: float) -> int:
    """The least count k with k / total >= min_prob, the threshold as a float comparison makes it."""
    k = max(1, math.ceil(min_prob * total))
    while k > 1 and (k - 1) / total >= min_prob:
        k -= 1
    while k / total < min_prob:
        k += 1
    return k


def build_trie(windows: np.ndarray, min_count: int) -> _Trie:
    """A trie of the nodes that ``min_count`` rows of ``windows`` (oldest first) or more pass through."""
    trie = _Trie()
    if len(windows) <= SMALL_TRIE_ROWS:
        for rank, row in enumerate(windows.tolist()):
            trie.add(row, rank)
        return trie
    # Level by level: group the live rows by (node, next token), keep the frequent groups' rows.
    # Rows stay in ascending order, so a group's last row is its newest occurrence.
    rows = np.arange(len(windows))
    nodes = np.zeros(len(rows), dtype=np.int64)
    shift = np.int64(1 << 32)
    for level in range(windows.shape[1]):
        tokens = windows[rows, level].astype(np.int64)
        live = tokens >= 0
        rows, nodes, tokens = rows[live], nodes[live], tokens[live]
        if len(rows) < min_count:
            break
        # Reversed, so the first index np.unique reports for a key is that key's last row.
        keys, last, group, counts = np.unique(
            (nodes * shift + tokens)[::-1], return_index=True, return_inverse=True, return_counts=True
        )
        frequent = np.flatnonzero(counts >= min_count)
        if not len(frequent):
            break
        new = np.full(len(keys), -1, dtype=np.int64)
        newest = rows[::-1][last[frequent]]
        for g, key, count, rank in zip(
            frequent.tolist(),
            keys[frequent].tolist(),
            counts[frequent].tolist(),
            newest.tolist(),
            strict=True,
        ):
            new[g] = trie.node(key >> 32, key & 0xFFFFFFFF, count, rank)
        moved = new[group[::-1]]
        keep = moved >= 0
        rows, nodes = rows[keep], moved[keep]
    return trie


@dataclass(frozen=True)
class Draft:
    """A speculation: proposal fields plus its score, the expected number of accepted tokens."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    probs: tuple[float, ...]
    score: float

    def proposal(self) -> Proposal:
        if not self.tokens:
            return EMPTY_PROPOSAL
        return Proposal(self.tokens, self.parents, self.probs, (SOURCE,) * len(self.tokens))


NO_DRAFT = Draft((), (), (), 0.0)


@functools.lru_cache(maxsize=256)
def _node_budgets(length: int, max_nodes: int, factor: float, offset: float) -> np.ndarray:
    """Per match length m in 0..length: ``min(max_spec_tokens, int(m * factor + offset + 1e-6))``, the
    product and sum in float32 and the 1e-6 added in float64, as ArcticInference computes it."""
    m = np.arange(length + 1, dtype=np.float32)
    limits = (m * np.float32(factor) + np.float32(offset)).astype(np.float64) + 1e-6
    budgets = np.clip(limits.astype(np.int64), 0, max_nodes)  # the cast truncates toward zero, as C++'s
    budgets.flags.writeable = False
    return budgets


def speculate(
    corpora: Sequence[TokenCorpus],
    pattern: np.ndarray,
    max_nodes: int,
    *,
    max_depth: int,
    max_spec_factor: float,
    max_spec_offset: float,
    min_token_prob: float,
    use_tree: bool,
    to_beat: float = 0.0,
) -> Draft:
    """The best draft one tree (the suffixes of ``corpora``) gives for the context ``pattern`` (its last
    ``max_depth`` tokens count), if it scores more than ``to_beat``; else ``NO_DRAFT``. Match lengths
    run up to one less than the context's length, as in ArcticInference.

    Going down from the longest match, consecutive match lengths with the same occurrences and the same
    node budget form a group whose drafts differ only in the depth limit: the group's shortest length
    allows the deepest tree and scores the most, and when it scores no more than a longer length, both
    take the same nodes (ties go to shallower nodes). So one draft per group is computed, longest group
    first, with strict improvement as in ArcticInference. Groups that cannot win are skipped: a draft
    reaching depth d scores at most d times the share of occurrences with a continuation, exactly, and
    float32 rounding adds less than ``FLOAT32_SLACK`` of that (ten tokens of probability 1/10 sum to
    1.0000001). The trie of the few-occurrence groups grows as matches shorten, each occurrence added
    once.
    """
    # The context's first token is never matched: every suffix of the rest is a candidate.
    pattern = pattern[-max_depth:][1:]
    if not len(pattern):
        return NO_DRAFT
    matches = _Matches(corpora, pattern)
    best, best_score = NO_DRAFT, to_beat
    min_prob = _f32(min_token_prob)

    grown, row_windows, by_length, added = _Trie(), None, None, 0
    budgets = _node_budgets(len(pattern), max_nodes, max_spec_factor, max_spec_offset)
    counts = matches.counts
    # Group starts, longest first: lengths whose next shorter one has other occurrences or budget.
    starts = np.flatnonzero((counts[:-1] != counts[1:]) | (budgets[:-1] != budgets[1:])) + 1
    for low in starts[starts <= matches.longest][::-1].tolist():
        total, budget = int(counts[low]), int(budgets[low])
        depth = min(budget, max_depth - low)
        ceiling = depth * (1 + FLOAT32_SLACK)  # float32 sums can exceed exact ones, by less than that
        if ceiling <= best_score:
            if depth == budget:  # every shorter match has a budget this small or smaller
                break
            continue
        if ceiling * matches.continuing_at(low) <= best_score * total:
            continue
        min_count = _min_count(total, min_token_prob * (1 - FLOAT32_SLACK))
        if low >= matches.rows_from:
            if row_windows is None:
                row_windows = matches.row_windows(min(max_nodes, max_depth - matches.rows_from))
                by_length = np.argsort(-matches.row_length, kind="stable").tolist()
                row_lengths = matches.row_length.tolist()
            # Shorter matches have budgets no larger than this one, so deeper tokens are never needed.
            while added < len(by_length) and row_lengths[by_length[added]] >= low:
                rank = by_length[added]
                grown.add(row_windows[rank][:budget], rank)
                added += 1
            trie = grown
        else:
            trie = build_trie(matches.windows(matches.early[low], depth), min_count)
        chosen, probs = trie.select(total, min_prob, budget, depth, use_tree)
        score = 0.0
        for prob in probs:
            score = _f32(score + prob)
        if score > best_score:
            index = {node: i for i, node in enumerate(chosen)}
            best = Draft(
                tokens=tuple(trie.token[n] for n in chosen),
                parents=tuple(index.get(trie.parent[n], -1) for n in chosen),
                probs=tuple(probs),
                score=score,
            )
            best_score = score
    return best


class SuffixDecodingDrafter:
    """SuffixDecoding as a ``Drafter``: per-request and global suffix structures, drafts by frequency.

    Defaults are ArcticInference's (``max_tree_depth=64``, ``max_spec_factor=1.0``,
    ``max_spec_offset=0.0``, ``min_token_prob=0.1``); the engine's budget plays ``max_spec_tokens``.
    ``use_tree=True`` drafts trees (SuffixDecoding's tree speculation), ``False`` chains (what vLLM's
    ``suffix`` method verifies). ``observe`` is ignored: SuffixDecoding's counts are its only estimate.
    """

    def __init__(
        self,
        max_depth: int = 64,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
        use_tree: bool = True,
    ) -> None:
        if max_depth < 1 or max_spec_factor < 0 or not 0.0 <= min_token_prob <= 1.0:
            raise ValueError("need max_depth >= 1, max_spec_factor >= 0 and 0 <= min_token_prob <= 1")
        self.settings = {
            "max_depth": max_depth,
            "max_spec_factor": max_spec_factor,
            "max_spec_offset": max_spec_offset,
            "min_token_prob": min_token_prob,
            "use_tree": use_tree,
        }
        self._texts: dict[Hashable, TokenCorpus] = {}
        self._responses: dict[Hashable, TokenCorpus] = {}
        self._finished = TokenCorpus()

    def begin(self, request: Hashable, prompt: Sequence[int]) -> None:
        if request in self._texts:
            raise ValueError(f"request {request!r} is already active")
        text = TokenCorpus()
        text.append(prompt)
        self._texts[request] = text
        self._responses[request] = TokenCorpus()

    def extend(self, request: Hashable, tokens: Sequence[int]) -> None:
        self._texts[request].append(tokens)
        self._responses[request].append(tokens)

    def propose(self, request: Hashable, max_nodes: int) -> Proposal:
        text = self._texts[request]
        if max_nodes <= 0 or len(text) <= 1:
            return EMPTY_PROPOSAL
        pattern = text.tail(self.settings["max_depth"])
        local = speculate([text], pattern, max_nodes, **self.settings)
        response_trees = [self._finished, *self._responses.values()]
        shared = speculate(response_trees, pattern, max_nodes, **self.settings, to_beat=local.score)
        return (shared if shared.score > local.score else local).proposal()

    def observe(self, request: Hashable, proposal: Proposal, accepted: Sequence[int]) -> None:
        """SuffixDecoding does not learn from verification."""

    def end(self, request: Hashable) -> None:
        """Drop the request's own tree; its response stays in the global one."""
        self._texts.pop(request, None)
        response = self._responses.pop(request, None)
        if response is not None and len(response) > 1:
            self._finished.start_sequence()
            self._finished.append(response.sequence_tokens())
