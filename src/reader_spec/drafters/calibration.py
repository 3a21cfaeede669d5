"""How often a drafted node is accepted, learned online from verification outcomes.

Every drafter gives each node a raw estimate of its chance of acceptance given its parent: a draft
model its next-token probability, a retrieval source the share of its occurrences that continued with
the node's token. Neither is the target's agreement, so both are mapped through the same kind of
calibration: buckets of the raw estimate (histogram binning), optionally split by a context the raw
estimate does not see (a retrieval source's match length and how many sources agree), each bucket a
running acceptance rate. Budgets and the best-first selection trust the calibrated values.
"""

from __future__ import annotations

import math
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
    no data and ``prior_strength`` trials of evidence move a bucket halfway. With ``shift_priors``,
    each context's priors are the raw estimates moved in log-odds by the one shift that fits all the
    context's evidence (itself weighing ``prior_strength`` trials at no shift): a drafter whose raw
    estimates are off by a similar amount everywhere (a draft model's likeliest child is accepted far
    more often than its probability says, whatever that probability) is then corrected in a bucket
    before that bucket has any trials. Contexts are numbered ``0..contexts-1`` by the caller.
    ``table()`` gives every estimate at once, flat by ``cell``, for code that looks many of them up
    (the compiled retrieval core).
    """

    def __init__(self, contexts: int = 1, prior_strength: float = 8.0, shift_priors: bool = False) -> None:
        if contexts < 1 or prior_strength <= 0:
            raise ValueError("need at least one context and a positive prior strength")
        uppers = (*RAW_BOUNDS[1:], 1.0)
        self.contexts = contexts
        self.prior_strength = prior_strength
        self._raw = [(low + high) / 2 for low, high in zip(RAW_BOUNDS, uppers, strict=True)]
        self._hits = [0.0] * (contexts * len(RAW_BOUNDS))
        self._trials = [0.0] * len(self._hits)
        self._table: tuple[float, ...] | None = None
        self._shifted: list[list[float] | None] | None = [None] * contexts if shift_priors else None
        """Each context's shifted priors, recomputed after its next update (None: priors not shifted)."""

    @staticmethod
    def cell(q: float, context: int = 0) -> int:
        return context * len(RAW_BOUNDS) + raw_bucket(q)

    def __call__(self, q: float, context: int = 0) -> float:
        return self.table()[self.cell(q, context)]

    def update(self, q: float, hit: bool, context: int = 0) -> None:
        c = self.cell(q, context)
        self._hits[c] += hit
        self._trials[c] += 1.0
        if self._shifted is not None:  # the context's priors move with its evidence: all its cells
            self._shifted[context] = None
            self._table = None
        elif self._table is not None:  # one cell moved (recomputing all is most of a step's drafting)
            self._table = (*self._table[:c], self._estimate(c), *self._table[c + 1 :])

    def table(self) -> tuple[float, ...]:
        """Every cell's estimate, ``table()[cell(q, context)] == self(q, context)``."""
        if self._table is None:
            self._table = tuple(map(self._estimate, range(len(self._hits))))
        return self._table

    def _estimate(self, cell: int) -> float:
        strength = self.prior_strength
        return (self._hits[cell] + strength * self._prior(cell)) / (self._trials[cell] + strength)

    def _prior(self, cell: int) -> float:
        context, bucket = divmod(cell, len(RAW_BOUNDS))
        if self._shifted is None:
            return self._raw[bucket]
        priors = self._shifted[context]
        if priors is None:
            cells = slice(context * len(RAW_BOUNDS), (context + 1) * len(RAW_BOUNDS))
            priors = self._shifted[context] = shifted_priors(
                self._raw, self._hits[cells], self._trials[cells], self.prior_strength
            )
        return priors[bucket]


SHIFT_LIMIT = 6.0
"""Largest log-odds shift of :func:`shifted_priors` (a factor of ~400 in the odds)."""


def shifted_priors(
    raw: Sequence[float], hits: Sequence[float], trials: Sequence[float], strength: float
) -> list[float]:
    """``raw`` moved by the log-odds shift d that makes the shifted estimates predict the hits seen:
    sum over buckets of trials x sigmoid(logit(raw) + d) = hits, with ``strength`` pseudo-trials
    spread over the buckets that expect exactly their raw estimate (no evidence: no shift). Solved by
    bisection; the left side grows with d."""
    if not any(trials):
        return list(raw)
    logits = [math.log(r / (1.0 - r)) for r in raw]
    pseudo = strength / len(raw)
    target = sum(hits) + pseudo * sum(raw)

    def predicted(shift: float) -> float:
        return sum((t + pseudo) / (1.0 + math.exp(-(x + shift))) for x, t in zip(logits, trials, strict=True))

    low, high = -SHIFT_LIMIT, SHIFT_LIMIT
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (middle, high) if predicted(middle) < target else (low, middle)
    shift = (low + high) / 2
    return [1.0 / (1.0 + math.exp(-(x + shift))) for x in logits]


def verified_trials(
    drafted: Proposal | None, verified: Proposal, accepted: Sequence[int]
) -> list[tuple[int, bool]]:
    """:func:`node_trials` of a step's verification where it tested the drafter's own nodes:
    ``verified`` is ``drafted`` cut to the step's budget (another tree, or none, teaches nothing)."""
    n = len(verified)
    if drafted is None or n == 0 or verified != drafted.truncated(n):
        return []
    return node_trials(verified, accepted)


def node_trials(proposal: Proposal, accepted: Sequence[int]) -> list[tuple[int, bool]]:
    """Each node verification tested (its parent was accepted, or it hangs from the root), and
    whether it was accepted: one trial per node for the calibration."""
    on_path = {-1, *accepted}
    return [(node, node in on_path) for node, parent in enumerate(proposal.parents) if parent in on_path]
