import pytest

from reader_spec.budget.costs import PROBE_CONTEXT, CostModel
from reader_spec.budget.planner import BudgetPlanner
from reader_spec.engine.tree import EMPTY_PROPOSAL, chain_proposal

SURE = chain_proposal([5, 6, 7, 8], [0.9, 0.8, 0.1, 0.05])


def linear_costs(plain: float, per_draft: float) -> CostModel:
    """A pass of ``d`` drafts at batch 1 costs ``plain + per_draft * d`` seconds."""
    return CostModel({PROBE_CONTEXT: {1: {d: plain + per_draft * d for d in (0, 4, 8, 16)}}})


class Proposer:
    """Hands out the same proposals every step and keeps what each call was priced with."""

    def __init__(self, *proposals):
        self.proposals = list(proposals)
        self.calls = []

    def __call__(self, seconds):
        self.calls.append(None if seconds is None else list(seconds))
        return self.proposals


def test_a_zero_budget_never_asks_for_proposals():
    propose = Proposer(SURE)
    plan = BudgetPlanner(0, lambda: linear_costs(1.0, 0.1)).plan(1, PROBE_CONTEXT, propose)
    assert plan.proposals == [EMPTY_PROPOSAL] and plan.predicted is None and propose.calls == []


def test_without_costs_each_proposal_is_verified_whole_up_to_the_budget():
    propose = Proposer(SURE, chain_proposal([1, 2], [0.5, 0.5]))
    planner = BudgetPlanner(3)
    plan = planner.plan(2, PROBE_CONTEXT, propose)
    assert propose.calls == [None]  # not priced
    assert [len(p) for p in plan.proposals] == [3, 2] and plan.predicted is None
    assert planner.gate is None  # nothing to weigh drafting against


def test_priced_steps_keep_the_nodes_worth_their_cost():
    """At 0.1 of a plain pass a draft token, the 0.9 and 0.8 nodes pay and the 0.1 and 0.05 ones do
    not; the plan says what the curve predicts for the pass it keeps."""
    propose = Proposer(SURE)
    plan = BudgetPlanner(4, lambda: linear_costs(1.0, 0.1)).plan(1, PROBE_CONTEXT, propose)
    assert propose.calls[0] == pytest.approx([1.0 + 0.1 * d for d in range(5)])
    assert plan.proposals[0].tokens == (5, 6)
    assert plan.predicted == pytest.approx((1.0, 1.2, 2))


def test_acceptance_below_the_estimates_shrinks_later_plans():
    planner = BudgetPlanner(4, lambda: linear_costs(1.0, 0.1), gated=False)
    kept = []
    for _ in range(60):
        plan = planner.plan(1, PROBE_CONTEXT, Proposer(SURE))
        kept.append(len(plan.proposals[0]))
        planner.record(plan, accepted=0, pass_seconds=plan.predicted[1])
    assert kept[0] == 2 and kept[-1] == 0
    assert planner.realized.factor < 0.15


def test_passes_dearer_than_the_curve_are_priced_as_they_cost():
    """Passes whose drafts take four times what the curve says move the planner's prices: the same
    proposal is cut shorter."""
    proposal = chain_proposal([5, 6, 7, 8], [0.9, 0.8, 0.3, 0.05])  # 3 nodes pay at 0.05, 2 at 0.2
    planner = BudgetPlanner(4, lambda: linear_costs(1.0, 0.05), gated=False)
    first = planner.plan(1, PROBE_CONTEXT, Proposer(proposal))
    for _ in range(40):
        plan = planner.plan(1, PROBE_CONTEXT, Proposer(proposal))
        plain, predicted, drafted = plan.predicted
        planner.record(plan, accepted=drafted, pass_seconds=plain + 4 * (predicted - plain))
    later = planner.plan(1, PROBE_CONTEXT, Proposer(proposal))
    assert len(first.proposals[0]) == 3 and len(later.proposals[0]) == 2
    untimed = BudgetPlanner(4, lambda: linear_costs(1.0, 0.05), gated=False)
    for _ in range(40):  # a replay's steps are not timed: the curve stands
        plan = untimed.plan(1, PROBE_CONTEXT, Proposer(proposal))
        untimed.record(plan, accepted=len(plan.proposals[0]))
    assert len(untimed.plan(1, PROBE_CONTEXT, Proposer(proposal)).proposals[0]) == 3


def test_a_closed_gate_skips_proposing_and_prices_the_step_plain():
    """Passes so cheap that no draft wins back the time spent proposing: after the gate's first
    trials most steps do not ask for proposals; without a gate every step does."""
    gated = BudgetPlanner(4, lambda: linear_costs(1e-9, 1e-10))
    propose = Proposer(SURE)
    plans = [gated.plan(1, PROBE_CONTEXT, propose) for _ in range(100)]
    assert gated.gate.min_trials <= len(propose.calls) < 30
    skipped = [p for p in plans if p.proposals == [EMPTY_PROPOSAL]]
    assert skipped and all(p.predicted == pytest.approx((1e-9, 1e-9, 0)) for p in skipped)
    ungated = BudgetPlanner(4, lambda: linear_costs(1e-9, 1e-10), gated=False)
    propose = Proposer(SURE)
    for _ in range(100):
        ungated.plan(1, PROBE_CONTEXT, propose)
    assert len(propose.calls) == 100
    gated.reset_gate(gated=True)  # a new drafter starts with the gate open
    propose = Proposer(SURE)
    gated.plan(1, PROBE_CONTEXT, propose)
    assert len(propose.calls) == 1


def test_budget_must_not_be_negative():
    with pytest.raises(ValueError, match="budget"):
        BudgetPlanner(-1)
