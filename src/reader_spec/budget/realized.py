"""What the engine's steps bear out of the budget's estimates: how many of the kept drafts were
accepted (:class:`RealizedAcceptance`), what passes cost against the measured curve
(:class:`RealizedCost`), and whether drafting at all is worth its own time (:class:`DraftingGate`).

The budget prices a step from calibrated probabilities and a cost curve timed once per machine; each
of these corrects one way that pricing is wrong in a running engine, from the steps themselves, and
each forgets old steps, so that a correction that stopped drafting wears off and drafting is tried
again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class RealizedAcceptance:
    """Draft tokens accepted per unit of probability the kept nodes were given, over recent steps.

    The drafters' probabilities are calibrated on every node they propose, but the allocation keeps
    the nodes estimated likeliest, and an estimate picked for being high is high on average
    (docs/architecture.md, "Allocation across the batch"). Verifying those nodes then costs more
    than they return exactly where a pass has little to spare. The engine records each verified
    proposal here and the allocation scales probabilities by :attr:`factor`, so what it expects is
    what verification has been giving. Only downwards: selection inflates estimates, it does not
    deflate them, and a drafter's own calibration answers for estimates that run low. Every step
    fades what came before by ``decay``, steps that verified nothing included, so a factor that
    stopped all drafting drifts back to 1 and drafting is tried again; ``prior`` units of
    probability at a factor of 1 keep the first steps from swinging it.
    """

    def __init__(self, decay: float = 0.99, prior: float = 4.0) -> None:
        if not 0.0 < decay <= 1.0 or prior <= 0:
            raise ValueError("need 0 < decay <= 1 and prior > 0")
        self.decay = decay
        self.prior = prior
        self.expected = 0.0
        self.accepted = 0.0

    @property
    def factor(self) -> float:
        return min(1.0, (self.accepted + self.prior) / (self.expected + self.prior))

    def record(self, expected: float, accepted: int) -> None:
        """One step of the batch: the summed probabilities of the verified nodes (0 where none were),
        and how many of them were accepted."""
        self.expected = self.expected * self.decay + expected
        self.accepted = self.accepted * self.decay + accepted


EXTRA_SCALE = 0.1
"""A pass's drafts as a share of a plain pass, for weighing ``RealizedCost``'s prior on their extra:
its prior steps are passes whose drafts add this much. A pass whose drafts the curve prices at a few
percent says little about the curve's shape: with a prior of 0.02, one dear pass of one draft token
early in a batch-8 run raised ``extra`` enough to price every larger tree too high for the rest of
the run (docs/runner.md, "a batch's drafts in one call of the retrieval core"); ``per_token``, the
linear term, is what such passes move now, as it is what prices a curve called flat."""
EXTRA_RANGE = 16.0
"""``RealizedCost``'s extra stays within [1 / this, this]: wide enough for a curve timed in a slow
minute, which can price a draft token at a small fraction of its cost (docs/runner.md, "Costs that a
slow minute cannot bend")."""


class RealizedCost:
    """Measured pass seconds against the cost curve's: a plain pass, the drafts' extra, and a cost per
    draft token the curve does not show.

    The curve is timed on synthetic passes once; a running engine's passes depart from it, and not
    by one factor. At batch 8 plain passes ran below the curve and passes with drafts above it, and
    a curve timed while the host streamed memory slowly (some hosts switch their memory bandwidth
    for seconds at a time) prices the plain pass high and each draft token low, so that trees come
    out too large in every later run (docs/architecture.md, "Allocation across the batch"). A curve
    can also be flat where passes are not: one timed at batch 8 on a shared host priced eight draft
    tokens at nothing where the run's passes paid much more for them (docs/runner.md, "passes with
    drafts priced as they cost"), and no factor on a flat curve's extra makes it steeper. So a pass
    of ``n`` drafts is taken to cost ``t(0) (base + per_token n) + extra (t(n) - t(0))`` of the
    curve's ``t``, and the three factors are fitted to the measured passes by least squares (each
    pass relative to its plain entry, so long and short contexts weigh alike), over recent steps:
    every step fades what came before by ``decay``, and ``prior`` steps hold each factor where the
    passes say little about it (``base`` and ``extra`` at 1, for ``extra`` steps whose drafts add
    ``EXTRA_SCALE`` to the pass; ``per_token`` at 0, on steps of one draft token), so that the fit
    returns to the curve while no pass has drafts. A pass more than ``band`` times off the curve
    either way is not counted: a burst of other work stalled it, or the curve is not this machine's
    (tests price passes in made-up seconds). ``base`` stays within that band, ``extra`` within
    ``EXTRA_RANGE`` and ``per_token`` at or above 0, so that a few noisy passes cannot make drafts
    look free. What a pass costs against the curve depends on the batch size, so the engine keeps
    one per size bucket.
    """

    def __init__(self, decay: float = 0.98, prior: float = 4.0, band: float = 2.0) -> None:
        if not 0.0 < decay <= 1.0 or prior <= 0 or band < 1.0:
            raise ValueError("need 0 < decay <= 1, prior > 0 and band >= 1")
        self.decay = decay
        self.prior = prior
        self.band = band
        self._moments = [[0.0] * 3 for _ in range(3)]
        self._targets = [0.0] * 3
        """Decayed sums of x x^T and x y over passes, x = (1, u, n): u the curve's extra for the
        drafts and y the measured seconds, both over the curve's plain entry, n the draft tokens."""

    def factors(self) -> tuple[float, float, float]:
        """``(base, extra, per_token)``: what the plain pass, the drafts' extra and each draft token
        cost against the curve (``per_token`` as a share of the plain pass)."""
        # Minimise sum (y - x . theta)^2 + sum_i weight_i (theta_i - held_i)^2.
        weights = (self.prior, self.prior * EXTRA_SCALE**2, self.prior)
        held = (1.0, 1.0, 0.0)
        lhs = [
            [m + (w if i == j else 0.0) for j, m in enumerate(row)]
            for i, (row, w) in enumerate(zip(self._moments, weights, strict=True))
        ]
        rhs = [t + w * h for t, w, h in zip(self._targets, weights, held, strict=True)]
        base, extra, per_token = _solve_positive_definite(lhs, rhs)
        if per_token < 0:  # the curve's shape already prices the tokens: refit with per_token held at 0
            (base, extra), per_token = _solve_positive_definite([row[:2] for row in lhs[:2]], rhs[:2]), 0.0
        base = min(max(base, 1.0 / self.band), self.band)
        extra = min(max(extra, 1.0 / EXTRA_RANGE), EXTRA_RANGE)
        return float(base), float(extra), float(per_token)

    def record(self, plain: float, predicted: float, drafted: int, measured: float) -> None:
        """One step's pass: the curve's seconds for a plain pass and for the pass as verified, its
        draft tokens, and the seconds it took."""
        decay, counted = self.decay, 1.0 / self.band <= measured / predicted <= self.band
        x = (1.0, (predicted - plain) / plain, float(drafted)) if counted else (0.0, 0.0, 0.0)
        y = measured / plain
        for row, x_i, i in zip(self._moments, x, range(3), strict=True):
            self._targets[i] = self._targets[i] * decay + x_i * y
            for j in range(3):
                row[j] = row[j] * decay + x_i * x[j]

    def adjust(self, seconds: Sequence[float]) -> list[float]:
        """A cost table (seconds by draft tokens) as passes have been costing."""
        base, extra, per_token = self.factors()
        plain = seconds[0]
        return [plain * (base + per_token * n) + (t - plain) * extra for n, t in enumerate(seconds)]


def _solve_positive_definite(lhs: list[list[float]], rhs: list[float]) -> list[float]:
    """``lhs x = rhs`` for a small symmetric positive-definite ``lhs``, by Gaussian elimination (such a
    matrix needs no pivoting). In plain floats: for a 3 x 3 system numpy's per-call overhead is most of
    the cost, and the engine solves one every step it drafts."""
    a, b, n = [list(row) for row in lhs], list(rhs), len(rhs)
    for k in range(n):
        for i in range(k + 1, n):
            f = a[i][k] / a[k][k]
            for j in range(k, n):
                a[i][j] -= f * a[k][j]
            b[i] -= f * b[k]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (b[i] - sum(a[i][j] * x[j] for j in range(i + 1, n))) / a[i][i]
    return x


@dataclass
class _GateState:
    """One batch-size bucket's record of drafting: decayed sums and the exploring schedule."""

    interval: int
    saved: float = 0.0
    spent: float = 0.0
    trials: int = 0
    skipped: int = 0
    weight: float = 1.0
    """The steps the next recorded trial stands for: itself and those skipped before it, faded."""


class DraftingGate:
    """Whether the next step should ask the drafter for proposals at all.

    Proposing costs time before any pass runs (docs/architecture.md, "Allocation across the batch"),
    and at a large batch on a CPU the drafts the allocation keeps may save less than that: a pass
    has little compute to spare. Per batch-size bucket (powers of two: what a pass has to spare
    depends on the batch), the gate keeps sums of what the allocation expected drafting to save per
    step
    (:func:`~reader_spec.budget.allocation.seconds_saved`) and of the seconds drafting took, over
    the bucket's steps, faded by ``decay`` at each. A bucket stays open for its first
    ``min_trials`` proposing steps (a request's first steps often find nothing to draft from); after
    that, while the first sum is the smaller, its steps run plain and one proposes after
    ``explore_every`` skipped steps, an interval that doubles up to ``max_explore_every`` while
    drafting keeps not paying. An exploring step stands for the steps skipped before it (it is
    their sample of the text), so the sums stay estimates over recent steps while the gate is
    closed: one exploring step that finds drafts worth their time outweighs what older trials said
    and opens the gate for about as long as it stands for. Weighed as one step among the last
    hundred trials instead, it could not: a batch-8 gate closed by a run's first steps stayed closed
    for most of the run (docs/runner.md, "a closed drafting gate that can reopen").
    """

    def __init__(
        self, decay: float = 0.99, explore_every: int = 8, max_explore_every: int = 64, min_trials: int = 16
    ) -> None:
        if not 0.0 < decay <= 1.0 or not 1 <= explore_every <= max_explore_every or min_trials < 1:
            raise ValueError("need 0 < decay <= 1, 1 <= explore_every <= max_explore_every, min_trials >= 1")
        self.decay = decay
        self.explore_every = explore_every
        self.max_explore_every = max_explore_every
        self.min_trials = min_trials
        self._states: dict[int, _GateState] = {}

    def _state(self, batch: int) -> _GateState:
        return self._states.setdefault(batch.bit_length(), _GateState(self.explore_every))

    def open(self, batch: int) -> bool:
        """Whether drafting has been worth its time at this batch size, or not tried enough to tell."""
        state = self._state(batch)
        return state.trials < self.min_trials or state.saved > state.spent

    def propose(self, batch: int) -> bool:
        """Whether this step, over ``batch`` sequences, proposes; call once per step."""
        state = self._state(batch)
        state.saved *= self.decay
        state.spent *= self.decay
        if self.open(batch):
            state.skipped, state.interval, state.weight = 0, self.explore_every, 1.0
            return True
        state.skipped += 1
        if state.skipped < state.interval:
            return False
        state.weight = sum(self.decay**age for age in range(state.skipped))  # itself and those skipped
        state.skipped, state.interval = 0, min(2 * state.interval, self.max_explore_every)
        return True

    def record(self, batch: int, saved: float, spent: float) -> None:
        """A step that proposed: the seconds its drafts were expected to save, and drafting took."""
        state = self._state(batch)
        state.trials += 1
        state.saved += state.weight * saved
        state.spent += state.weight * spent
