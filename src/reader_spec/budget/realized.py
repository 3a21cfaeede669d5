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


class RealizedCost:
    """Measured pass seconds over the cost curve's, kept apart for plain passes and passes with drafts.

    The curve is timed on synthetic passes in a quiet moment; in a running engine a plain pass and a
    pass with drafts depart from it differently (on the development machine at batch 8, plain passes
    ran below the curve and passes with drafts above it; docs/runner.md has the figures),
    and what the allocation weighs is the difference. Each ratio is a decayed mean over steps of its
    kind, starting from ``prior`` steps at 1. A pass more than ``band`` times off the curve either
    way is not counted: a burst of other work stalled it, or the curve is not this machine's (tests
    price passes in made-up seconds). Both fade every step, so the drafted ratio of a batch that
    stopped drafting returns to the curve's.
    """

    def __init__(self, decay: float = 0.98, prior: float = 4.0, band: float = 2.0) -> None:
        if not 0.0 < decay <= 1.0 or prior <= 0 or band < 1.0:
            raise ValueError("need 0 < decay <= 1, prior > 0 and band >= 1")
        self.decay = decay
        self.prior = prior
        self.band = band
        self._sums = {False: [0.0, 0.0], True: [0.0, 0.0]}
        """with drafts -> [decayed sum of ratios, decayed count]"""

    def ratio(self, drafted: bool) -> float:
        total, count = self._sums[drafted]
        return (total + self.prior) / (count + self.prior)

    def record(self, drafted: bool, predicted: float, measured: float) -> None:
        for sums in self._sums.values():
            sums[0] *= self.decay
            sums[1] *= self.decay
        ratio = measured / predicted
        if not 1.0 / self.band <= ratio <= self.band:
            return
        sums = self._sums[drafted]
        sums[0] += ratio
        sums[1] += 1.0

    def adjust(self, seconds: Sequence[float]) -> list[float]:
        """A cost table (seconds by draft tokens) as passes have been costing."""
        plain, drafted = self.ratio(False), self.ratio(True)
        return [seconds[0] * plain, *(t * drafted for t in seconds[1:])]


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
