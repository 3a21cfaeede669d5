"""How often a drafted node is accepted, learned online from verification outcomes.

Every drafter gives each node a raw estimate of its chance of acceptance given its parent: a draft
model its next-token probability, a retrieval source the share of its occurrences that continued with
the node's token. Neither is the target's agreement, so both are mapped through the same kind of
calibration: buckets of the raw estimate (histogram binning), optionally split by a context the raw
estimate does not see (a retrieval source's match length and how many sources agree), each bucket a
running acceptance rate. Budgets and the best-first selection trust the calibrated values.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

from reader_spec.engine.tree import Proposal

RAW_BOUNDS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98)
"""Lower bounds of the raw-estimate buckets: fine near 0 and 1, where most nodes lie."""


def raw_bucket(q: float) -> int:
    return max(bisect_right(RAW_BOUNDS, q) - 1, 0)


class ProbabilityCalibrator:
    """Acceptance rate per (context, raw-estimate bucket), each a Beta-Binomial posterior mean.

    The prior of a bucket is its own raw estimate (the bucket's middle), so a calibrated drafter needs
    no data and ``prior_strength`` trials of evidence move a bucket halfway. Contexts are numbered
    ``0..contexts-1`` by the caller. ``table()`` gives every estimate at once, flat by ``cell``, for
    code that looks many of them up (the compiled retrieval core).
    """

    def __init__(self, contexts: int = 1, prior_strength: float = 8.0) -> None:
        if contexts < 1 or prior_strength <= 0:
            raise ValueError("need at least one context and a positive prior strength")
        uppers = (*RAW_BOUNDS[1:], 1.0)
        means = [(low + high) / 2 for low, high in zip(RAW_BOUNDS, uppers, strict=True)]
        self.contexts = contexts
        self._hits = [m * prior_strength for _ in range(contexts) for m in means]
        self._trials = [prior_strength] * len(self._hits)
        self._table: tuple[float, ...] | None = None

    @staticmethod
    def cell(q: float, context: int = 0) -> int:
        return context * len(RAW_BOUNDS) + raw_bucket(q)

    def __call__(self, q: float, context: int = 0) -> float:
        c = self.cell(q, context)
        return self._hits[c] / self._trials[c]

    def update(self, q: float, hit: bool, context: int = 0) -> None:
        c = self.cell(q, context)
        self._hits[c] += hit
        self._trials[c] += 1.0
        self._table = None

    def table(self) -> tuple[float, ...]:
        """Every cell's estimate, ``table()[cell(q, context)] == self(q, context)``."""
        if self._table is None:
            self._table = tuple(h / t for h, t in zip(self._hits, self._trials, strict=True))
        return self._table


def node_trials(proposal: Proposal, accepted: Sequence[int]) -> list[tuple[int, bool]]:
    """Each node verification tested (its parent was accepted, or it hangs from the root), and
    whether it was accepted: one trial per node for the calibration."""
    on_path = {-1, *accepted}
    return [(node, node in on_path) for node, parent in enumerate(proposal.parents) if parent in on_path]
