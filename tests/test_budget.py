import pytest

import reader_spec.budget as budget
from reader_spec.budget import (
    CostModel,
    choose_width,
    fixed_width,
    load_costs,
    probe_widths,
    save_costs,
    time_interleaved,
)
from reader_spec.tree import EMPTY_PROPOSAL, chain_proposal

# Shaped like this machine's measured curve: 8 tokens cost ~1.8 plain steps.
CURVE = {
    1: 0.042,
    2: 0.043,
    4: 0.061,
    8: 0.076,
    12: 0.080,
    16: 0.084,
    24: 0.09,
    32: 0.10,
    48: 0.125,
    64: 0.15,
}


def costs(scale_by_batch=None):
    scale_by_batch = scale_by_batch or {1: 1.0, 2: 1.5, 4: 2.5, 8: 4.0}
    return CostModel({b: {w: t * s for w, t in CURVE.items()} for b, s in scale_by_batch.items()})


def test_interpolates_widths_and_batches():
    model = costs()
    assert model.seconds(1, 8) == pytest.approx(0.076)
    assert model.seconds(1, 10) == pytest.approx((0.076 + 0.080) / 2)
    assert model.seconds(3, 1) == pytest.approx(0.042 * 2.0)  # halfway between batch 2 and 4


def test_measures_lazily_and_persists(tmp_path):
    calls = []
    path = tmp_path / "c.json"

    def measure(batch, widths):
        calls.append((batch, list(widths)))
        return {w: 0.01 * w for w in widths}

    model = CostModel(measure=measure, max_width=9, path=path)
    assert model.seconds(2, 4) == pytest.approx(0.04)
    assert calls == [(2, list(range(1, 10)))]  # one curve, every width of the budget
    assert load_costs(path) == model.samples
    model.seconds(2, 5)
    assert len(calls) == 1


def test_probes_every_width_up_to_the_dense_limit_then_sparse_ones_past_the_budget():
    assert probe_widths(3) == [1, 2, 3]
    assert probe_widths(budget.DENSE_WIDTHS) == list(range(1, budget.DENSE_WIDTHS + 1))
    assert probe_widths(50) == [*range(1, budget.DENSE_WIDTHS + 1), 48, 64]
    assert probe_widths(1000)[-1] == budget.SPARSE_WIDTHS[-1]  # wider still: extrapolated


def test_a_staircase_curve_is_priced_where_it_was_measured():
    """Width 3 costing what width 2 does must not be priced halfway to width 4."""
    model = CostModel({1: {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.5}})
    third = chain_proposal(range(3), [0.2, 0.04, 0.01])
    assert model.seconds(1, 3) == 1.0
    assert choose_width([third], model, 4) == 3


def test_interleaved_timing_alternates_order_and_skips_the_warm_up(monkeypatch):
    order = []
    clock = iter(range(1000))
    monkeypatch.setattr(budget.time, "perf_counter", lambda: next(clock))
    times = time_interleaved({1: lambda: order.append(1), 2: lambda: order.append(2)}, rounds=3)
    assert order == [2, 1, 1, 2, 2, 1, 1, 2]  # warm-up round first, then alternating
    assert times == {1: 1, 2: 1}


def test_interleaved_timing_keeps_each_calls_fastest_round(monkeypatch):
    """A burst of load slows some rounds; the pass's own cost is its fastest one, not the median."""
    # warm-up (2, 1), then rounds (1, 2), (2, 1), (1, 2), (2, 1):
    # call 1 takes 5, 7, 7, 8 and call 2 takes 1, 6, 6, 6
    durations = iter([9, 9, 5, 1, 6, 7, 7, 6, 6, 8])
    now = [0.0]

    def clock():
        return now[0]

    def call():
        now[0] += next(durations)

    monkeypatch.setattr(budget.time, "perf_counter", clock)
    times = time_interleaved({1: call, 2: call}, rounds=4)
    assert times == {1: 5, 2: 1}  # the medians would be 7 and 6


def test_corrupt_cost_file_is_ignored(tmp_path):
    path = tmp_path / "c.json"
    path.write_text("{not json")
    assert load_costs(path) == {}
    save_costs(path, {1: {1: 0.5}})
    assert load_costs(path) == {1: {1: 0.5}}


def test_weak_drafts_are_not_verified():
    weak = chain_proposal(range(16), [0.01] * 16)
    assert choose_width([weak], costs(), 17) == 1
    assert choose_width([EMPTY_PROPOSAL], costs(), 17) == 1


def test_sure_drafts_get_a_deep_tree():
    sure = chain_proposal(range(16), [0.97 ** (i + 1) for i in range(16)])
    assert choose_width([sure], costs(), 17) == 17
    assert choose_width([sure], costs(), 5) == 5


def test_width_chosen_maximises_expected_tokens_per_second():
    probs = [0.9, 0.7, 0.5, 0.3, 0.2, 0.1, 0.05]
    proposal = chain_proposal(range(7), probs)
    model = costs()
    width = choose_width([proposal], model, 8)
    rates = {w: (1 + sum(probs[: w - 1])) / model.seconds(1, w) for w in range(1, 9)}
    assert width == max(rates, key=rates.get)


def test_fixed_width_uses_the_budget():
    weak = chain_proposal(range(16), [0.05] * 16)
    assert fixed_width([weak], costs(), 9) == 9
    assert fixed_width([EMPTY_PROPOSAL], costs(), 9) == 1
