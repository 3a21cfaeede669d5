"""Each step's drafts: how many of its proposal's nodes every sequence of a batch verifies.

The engine's step and ``reader bench --replay`` plan alike: proposals priced by the cost curve as
passes have been costing (:class:`~reader_spec.budget.realized.RealizedCost`, one fit per batch-size
bucket), cut by the allocation with the drafters' probabilities scaled as verification bears them out
(:class:`~reader_spec.budget.realized.RealizedAcceptance`), and no proposing at all while drafting
has not been worth its own time (:class:`~reader_spec.budget.realized.DraftingGate`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from reader_spec.budget.allocation import allocate, seconds_saved
from reader_spec.budget.costs import CostModel
from reader_spec.budget.realized import DraftingGate, RealizedAcceptance, RealizedCost
from reader_spec.engine.tree import EMPTY_PROPOSAL, Proposal

Propose = Callable[[Sequence[float] | None], list[Proposal]]
"""The batch's proposals, given what a pass costs by its draft tokens (None: not priced)."""


@dataclass
class Plan:
    """The proposals a step verifies, each cut to its share of the budget."""

    proposals: list[Proposal]
    predicted: tuple[float, float, int] | None = None
    """What the cost curve says a plain pass and the step's pass cost, and the pass's draft tokens
    (None: the step is not priced)."""


class BudgetPlanner:
    """Sizes every step's drafts under a budget of ``budget`` draft tokens a sequence.

    With ``costs`` (the cost model, asked for when first needed) each step keeps the nodes that
    maximise the batch's expected tokens per second (:func:`~reader_spec.budget.allocation.allocate`);
    without, every proposal is verified whole up to the budget.
    """

    def __init__(self, budget: int, costs: Callable[[], CostModel] | None = None, gated: bool = True) -> None:
        if budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        self.budget = budget
        self._costs = costs
        self.realized = RealizedAcceptance()
        self.realized_costs: dict[int, RealizedCost] = {}
        """By batch-size bucket (powers of two, as the cost curves are probed)."""
        self.gate: DraftingGate | None = None
        self.reset_gate(gated)

    def reset_gate(self, gated: bool) -> None:
        """Start the drafting gate afresh (a new drafter), or drop it: a drafter that weighs its own
        drafting's cost is not second-guessed."""
        self.gate = DraftingGate() if gated and self._costs is not None else None

    def plan(self, batch: int, context: float, propose: Propose) -> Plan:
        """The step's drafts for ``batch`` sequences with ``context`` tokens cached on average."""
        if self.budget == 0:
            return Plan([EMPTY_PROPOSAL] * batch)
        if self._costs is None:
            return Plan([p.truncated(self.budget) for p in propose(None)])
        started = time.perf_counter()
        costs = self._costs()
        if self.gate is not None and not self.gate.propose(batch):
            plain = costs.seconds(batch, 0, context)
            return Plan([EMPTY_PROPOSAL] * batch, (plain, plain, 0))
        curve = costs.table(batch, batch * self.budget, context)
        seconds = self._realized_cost(batch).adjust(curve)
        proposals = propose(seconds)
        factor = self.realized.factor
        counts = allocate(proposals, seconds, self.budget, factor)
        proposals = [p.truncated(n) for p, n in zip(proposals, counts, strict=True)]
        if self.gate is not None:
            saved = seconds_saved(proposals, counts, seconds, factor)
            self.gate.record(batch, saved, time.perf_counter() - started)
        drafted = sum(counts)
        return Plan(proposals, (curve[0], curve[drafted], drafted))

    def record(self, plan: Plan, accepted: int, pass_seconds: float | None = None) -> None:
        """What verifying a plan gave: the draft tokens accepted, and the seconds its pass took (None:
        not timed, as in a replay)."""
        self.realized.record(sum(sum(p.probs) for p in plan.proposals), accepted)
        if plan.predicted is not None and pass_seconds is not None:
            self._realized_cost(len(plan.proposals)).record(*plan.predicted, pass_seconds)

    def _realized_cost(self, batch: int) -> RealizedCost:
        """How passes of this batch size have been costing against the curve."""
        return self.realized_costs.setdefault(batch.bit_length(), RealizedCost())
