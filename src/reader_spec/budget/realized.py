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
    the nodes estimated likeliest, and an estimate picked for being high is high on average (measured
    on Spec-Bench prompts with the reader drafter: 0.74 tokens accepted per unit of estimate at batch
    1, 0.70 at 8, 0.90 at 32; docs/runner.md). Verifying those nodes then costs more than they return
    exactly where a pass has little to spare. The engine records each verified proposal here and the
    allocation scales probabilities by :attr:`factor`, so what it expects is what verification has
    been giving. Only downwards: selection inflates estimates, it does not deflate them, and a
    drafter's own calibration answers for estimates that run low. Every step fades what came before by
    ``decay``, steps that verified nothing included, so a factor that stopped all drafting drifts back
    to 1 and drafting is tried again; ``prior`` units of probability at a factor of 1 keep the first
    steps from swinging it.
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


EXTRA_SCALE = 0.02
"""A pass's drafts as a share of a plain pass, for weighing ``RealizedCost``'s prior on their extra:
its prior steps are passes whose drafts add this much (one to eight draft tokens add 10-100% to a
plain pass at batch 1 on this project's CPUs; a curve timed in a slow minute priced nine at 4%)."""
EXTRA_RANGE = 16.0
"""``RealizedCost``'s extra stays within [1 / this, this]: the curve of session 30's slow minute
priced a draft token at a fourteenth of what the next calibration measured (0.1 against 1.46 ms)."""


class RealizedCost:
    """Measured pass seconds against the cost curve's, as a plain pass and the drafts' extra apart.

    The curve is timed on synthetic passes once; a running engine's passes depart from it, and not by
    one factor. At batch 8 plain passes ran below the curve and passes with drafts above it
    (docs/runner.md), and a curve timed while the host streamed memory slowly (a Zen 4 host here
    switches between about 51 and 35 GB/s for seconds at a time) prices the plain pass high and each
    draft token low, so that trees come out too large in every later run. So a pass of ``n`` drafts
    is taken to cost ``base * t(0) + extra * (t(n) - t(0))`` of the curve's ``t``, and the two factors
    are fitted to the measured passes by least squares (each pass relative to its plain entry, so long
    and short contexts weigh alike), over recent steps: every step fades what came before by
    ``decay``, and ``prior`` steps at a factor of 1 (for ``extra``, steps whose drafts add
    ``EXTRA_SCALE`` to the pass) hold each where the passes say little about it, so that ``extra``
    returns to 1 while no pass has drafts. A pass more than ``band`` times off the curve either way
    is not counted: a burst of other work stalled it, or the curve is not this machine's (tests price
    passes in made-up seconds). ``base`` stays within that band and ``extra`` within
    ``EXTRA_RANGE``, so that a few noisy passes cannot make drafts look free.
    """

    def __init__(self, decay: float = 0.98, prior: float = 4.0, band: float = 2.0) -> None:
        if not 0.0 < decay <= 1.0 or prior <= 0 or band < 1.0:
            raise ValueError("need 0 < decay <= 1, prior > 0 and band >= 1")
        self.decay = decay
        self.prior = prior
        self.band = band
        self._sums = [0.0] * 5
        """Decayed sums over passes of 1, u, u^2, y and u*y, where y is measured seconds and u the
        curve's extra for the drafts, both over the curve's plain entry."""

    def factors(self) -> tuple[float, float]:
        """``(base, extra)``: what the plain pass and the drafts' extra cost against the curve."""
        count, u, uu, y, uy = self._sums
        # Minimise sum (y - base - extra u)^2 + prior (base - 1)^2 + prior EXTRA_SCALE^2 (extra - 1)^2.
        held = self.prior * EXTRA_SCALE**2
        a, b, d = count + self.prior, u, uu + held
        e, f = y + self.prior, uy + held
        determinant = a * d - b * b
        base = min(max((e * d - b * f) / determinant, 1.0 / self.band), self.band)
        extra = min(max((a * f - b * e) / determinant, 1.0 / EXTRA_RANGE), EXTRA_RANGE)
        return base, extra

    def record(self, plain: float, predicted: float, measured: float) -> None:
        """One step's pass: the curve's seconds for a plain pass and for the pass as verified, and the
        seconds it took."""
        self._sums = [total * self.decay for total in self._sums]
        if not 1.0 / self.band <= measured / predicted <= self.band:
            return
        u, y = (predicted - plain) / plain, measured / plain
        for i, term in enumerate((1.0, u, u * u, y, u * y)):
            self._sums[i] += term

    def adjust(self, seconds: Sequence[float]) -> list[float]:
        """A cost table (seconds by draft tokens) as passes have been costing."""
        base, extra = self.factors()
        plain = seconds[0]
        return [plain * base + (t - plain) * extra for t in seconds]


@dataclass
class _GateState:
    """One batch-size bucket's record of drafting: decayed means and the exploring schedule."""

    interval: int
    saved: float = 0.0
    spent: float = 0.0
    trials: int = 0
    skipped: int = 0


class DraftingGate:
    """Whether the next step should ask the drafter for proposals at all.

    Proposing costs time before any pass runs (about a millisecond for 32 sequences with the reader
    drafter on the development machine), and at a large batch on a CPU the drafts the allocation
    keeps may save less than that: a pass has little compute to spare. Per batch-size bucket (powers
    of two: what a pass has to spare depends on the batch), the gate keeps decayed means of what the
    allocation expected drafting to save per step
    (:func:`~reader_spec.budget.allocation.seconds_saved`) and of the seconds drafting took, over
    the steps that proposed. A bucket stays open for its first ``min_trials`` such steps (a
    request's first steps often find nothing to draft from); after that, while the first mean is the
    smaller, its steps run plain and one proposes after ``explore_every`` skipped steps, an interval
    that doubles up to ``max_explore_every`` while drafting keeps not paying, so that the means
    follow the text at little cost.
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
        if self.open(batch):
            state.skipped, state.interval = 0, self.explore_every
            return True
        state.skipped += 1
        if state.skipped < state.interval:
            return False
        state.skipped, state.interval = 0, min(2 * state.interval, self.max_explore_every)
        return True

    def record(self, batch: int, saved: float, spent: float) -> None:
        """A step that proposed: the seconds its drafts were expected to save, and drafting took."""
        state = self._state(batch)
        state.trials += 1
        weight = max(1.0 - self.decay, 1.0 / state.trials)  # a plain mean until the decay takes over
        state.saved += weight * (saved - state.saved)
        state.spent += weight * (spent - state.spent)
