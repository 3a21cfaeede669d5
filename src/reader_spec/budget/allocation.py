"""How many draft tokens each sequence of a step verifies: the batch's nodes ranked together by their
probability of being accepted, the count kept that maximises expected tokens per second."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from reader_spec.engine.tree import Proposal


def allocate(
    proposals: Sequence[Proposal], seconds: Sequence[float], budget: int, realized: float = 1.0
) -> list[int]:
    """Draft nodes each sequence verifies (a prefix of its proposal), maximising expected emitted
    tokens per second for the batch.

    With calibrated path probabilities, a sequence given ``n`` nodes emits one token (the bonus)
    plus the sum of their probabilities. One greedy pass takes the batch's nodes in order of
    probability (each proposal's own order kept, so that every kept set is a tree) and keeps the
    count whose rate is best; zero nodes, plain decoding, when nothing in the batch pays.
    ``seconds[n]`` is what the step's pass costs with ``n`` draft tokens in all (``CostModel.table``
    at the batch's size and context, up to ``budget`` per sequence); every probability is taken
    times ``realized`` (see :class:`~reader_spec.budget.realized.RealizedAcceptance`).
    """
    batch = len(proposals)
    limits = [min(len(p), budget) for p in proposals]
    if not any(limits):
        return limits
    frontier = [(-p.probs[0] * realized, b, 0) for b, p in enumerate(proposals) if limits[b]]
    heapq.heapify(frontier)
    taken: list[int] = []
    expected, best_rate, best_taken = float(batch), batch / seconds[0], 0
    while frontier:
        negative_prob, b, node = heapq.heappop(frontier)
        taken.append(b)
        expected -= negative_prob
        rate = expected / seconds[len(taken)]
        if rate > best_rate:
            best_rate, best_taken = rate, len(taken)
        if node + 1 < limits[b]:
            heapq.heappush(frontier, (-proposals[b].probs[node + 1] * realized, b, node + 1))
    counts = [0] * batch
    for b in taken[:best_taken]:
        counts[b] += 1
    return counts


def seconds_saved(
    proposals: Sequence[Proposal], counts: Sequence[int], seconds: Sequence[float], realized: float = 1.0
) -> float:
    """What a step's drafts are expected to save: plain decoding's time for the tokens the step is
    expected to emit, less the pass that verifies ``counts`` nodes of each proposal."""
    batch = len(proposals)
    expected = realized * sum(sum(p.probs[:n]) for p, n in zip(proposals, counts, strict=True))
    return (batch + expected) * seconds[0] / batch - seconds[sum(counts)]
