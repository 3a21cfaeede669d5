"""Continuations of every source merged into one draft: weighted prefix tries and best-first selection.

``draft_tree`` is the entry point: it runs in the compiled retrieval core where that is built, else in
the pure functions below, which define the rules: any source's continuations become a weighted prefix
trie (``build_continuation_trie``), and the nodes of highest calibrated path probability in the union
of the sources' tries are picked under a node budget (``select_best_first``), each with the estimate
that decided it, so that calibration can learn from it. Both paths give identical drafts.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from reader_spec.drafters.calibration import RAW_BOUNDS, raw_bucket
from reader_spec.drafters.retrieval import native
from reader_spec.drafters.retrieval.calibration import AGREEMENT_LEVELS
from reader_spec.engine.tree import EMPTY_PROPOSAL, Proposal


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


class SourceMatch(NamedTuple):
    """One source's weighted continuations after its longest match, and how to calibrate them:
    ``contexts[d - 1]`` is the first calibration context of edges into depth ``d`` (``match_contexts``)
    and ``table`` the source's calibrated estimates (``ProbabilityCalibrator.table``)."""

    name: str
    match_length: int
    continuations: Sequence[tuple[Sequence[int], float]]
    contexts: Sequence[int]
    table: Sequence[float]


Estimate = tuple[int, float]
"""What decided a drafted node: its labelling source's calibration context and raw estimate."""


def draft_tree(
    sources: Sequence[SourceMatch], max_nodes: int, max_breadth: int | None = None
) -> tuple[Proposal, tuple[Estimate, ...]]:
    """The best nodes of the sources' merged tries (``select_best_first``), and each node's estimate."""
    if max_nodes <= 0 or not sources:
        return EMPTY_PROPOSAL, ()
    core = native.core()
    if core is None:
        tries = [
            SourceTrie(s.name, build_continuation_trie(s.continuations), s.contexts, s.table) for s in sources
        ]
        return select_best_first(tries, max_nodes, max_breadth)
    raw = [(s.name, s.continuations, s.contexts, s.table) for s in sources]
    tokens, parents, probs, labels, estimates = core.draft_tree(
        raw, max_nodes, max_breadth or 0, RAW_BOUNDS, AGREEMENT_LEVELS
    )
    if not tokens:
        return EMPTY_PROPOSAL, ()
    return Proposal(tokens, parents, probs, labels), estimates


@dataclass(frozen=True)
class SourceTrie:
    """One source's continuations as a trie, with its calibration (as in ``SourceMatch``)."""

    name: str
    trie: ContinuationTrie
    contexts: Sequence[int]
    table: Sequence[float]


def select_best_first(
    sources: Sequence[SourceTrie], max_nodes: int, max_breadth: int | None = None
) -> tuple[Proposal, tuple[Estimate, ...]]:
    """The ``max_nodes`` nodes of highest path probability in the union of the sources' tries.

    A node of the union is a token path; each source holding the path proposes its children. A
    child's raw estimate from a source is ``k / (n + 1)`` (``k`` of the ``n`` continuations going on
    from the node go through the child; weights count occurrences), calibrated in the source's table
    at the edge's context: its depth's match context plus the agreement level (how many sources
    propose the token there, less one, at most ``AGREEMENT_LEVELS - 1``). Where several sources
    propose the same child, the highest calibrated estimate counts and labels the node. A path's
    probability is the product along it; every factor is below 1, so popping a max-heap of frontier
    nodes yields exactly the top nodes with every parent before its children (the rule EAGLE-2 and
    Sequoia use: with calibrated probabilities it maximises the expected accepted length).
    ``max_breadth`` keeps only the likeliest children of each node (1 gives a chain). Zero-probability
    nodes never appear.
    """
    if max_nodes <= 0 or not sources:
        return EMPTY_PROPOSAL, ()
    heap: list[tuple[float, int, int, str, Estimate, tuple[int, ...]]] = []
    counter = 0  # ties keep the order of discovery: deterministic, and recency-first within a source

    def push_children(nodes: tuple[int, ...], prob: float, index: int) -> None:
        nonlocal counter
        found: dict[int, list[tuple[int, int, float]]] = {}  # token: (source, its child, raw estimate)
        for k, (source, node) in enumerate(zip(sources, nodes, strict=True)):
            if node < 0:
                continue
            trie = source.trie
            total = trie.child_weights[node] + 1.0
            for token, child in trie.children[node].items():
                found.setdefault(token, []).append((k, child, trie.weights[child] / total))
        ranked = []
        for token, proposers in found.items():
            agreement = min(len(proposers), AGREEMENT_LEVELS) - 1
            edge, label, estimate = 0.0, proposers[0][0], (0, 0.0)
            children = [-1] * len(sources)
            for k, child, raw in proposers:
                children[k] = child
                source = sources[k]
                depth = source.trie.depths[child]
                if depth > len(source.contexts):
                    raise IndexError("a continuation is deeper than its source's calibration contexts")
                context = source.contexts[depth - 1] + agreement
                calibrated = source.table[context * len(RAW_BOUNDS) + raw_bucket(raw)]
                if calibrated > edge:
                    edge, label, estimate = calibrated, k, (context, raw)
            ranked.append((edge, token, sources[label].name, estimate, children))
        ranked.sort(key=lambda entry: -entry[0])
        for edge, token, name, estimate, children in ranked[:max_breadth]:
            if prob * edge > 0.0:
                heapq.heappush(heap, (-prob * edge, counter, index, name, estimate, (token, *children)))
                counter += 1

    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    names: list[str] = []
    estimates: list[Estimate] = []
    push_children(tuple([0] * len(sources)), 1.0, -1)
    while heap and len(tokens) < max_nodes:
        neg_prob, _, parent, name, estimate, (token, *children) = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        probs.append(-neg_prob)
        names.append(name)
        estimates.append(estimate)
        push_children(tuple(children), -neg_prob, len(tokens) - 1)
    if not tokens:
        return EMPTY_PROPOSAL, ()
    return Proposal(tuple(tokens), tuple(parents), tuple(probs), tuple(names)), tuple(estimates)
