"""Continuations of every source merged into one draft: weighted prefix tries and best-first selection.

``draft_tree`` is the entry point: it runs in the compiled retrieval core where that is built, else in
the pure functions below, which define the rules: any source's continuations become a weighted prefix
trie (``build_continuation_trie``), the nodes of highest path probability in the union of the sources'
tries are picked under a node budget (``select_best_first``), and each source is credited with the
nodes it labelled (``own_shares``). Both paths give identical drafts.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from reader_spec.drafters.retrieval import native
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


@dataclass(frozen=True)
class SourceMatch:
    """One source's weighted continuations after its longest match, and how far to trust them by
    depth (``confidence[d - 1]`` for edges into depth ``d``)."""

    name: str
    match_length: int
    continuations: Sequence[tuple[Sequence[int], float]]
    confidence: Sequence[float]


def draft_tree(
    sources: Sequence[SourceMatch], max_nodes: int, max_breadth: int | None = None
) -> tuple[Proposal, tuple[tuple[float, ...], ...]]:
    """The best nodes of the sources' merged tries (``select_best_first``), and per source its shares
    of the nodes it labelled (``own_shares``), which is what calibration credits it with."""
    nothing = tuple(() for _ in sources)
    if max_nodes <= 0 or not sources:
        return EMPTY_PROPOSAL, nothing
    core = native.core()
    if core is None:
        tries = [
            SourceTrie(s.name, s.match_length, build_continuation_trie(s.continuations), s.confidence)
            for s in sources
        ]
        proposal = select_best_first(tries, max_nodes, max_breadth)
        return proposal, tuple(own_shares(t, proposal) for t in tries) if proposal else nothing
    raw = [(s.name, s.continuations, s.confidence) for s in sources]
    tokens, parents, probs, labels, shares = core.draft_tree(raw, max_nodes, max_breadth or 0)
    if not tokens:
        return EMPTY_PROPOSAL, nothing
    return Proposal(tokens, parents, probs, labels), shares


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


def own_shares(source: SourceTrie, proposal: Proposal) -> tuple[float, ...]:
    """The source's shares of the nodes it labelled (its estimate was the one used), 0 elsewhere.

    A source is calibrated only where its estimate decided: a corpus or history source that agrees
    with the request's own text on likely tokens would otherwise be credited with those acceptances
    and over-trusted where it alone proposes (measured before this rule: datastore-labelled nodes
    accepted at about half their estimated rate).
    """
    shares = zip(edge_shares(source.trie, proposal), proposal.sources, strict=True)
    return tuple(share if label == source.name else 0.0 for share, label in shares)
