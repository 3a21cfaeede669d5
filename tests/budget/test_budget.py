import pytest
import torch

import reader_spec.budget.probe as probe
from reader_spec.budget.allocation import allocate, seconds_saved
from reader_spec.budget.costs import (
    DENSE_TOKENS,
    LONG_CONTEXT,
    PROBE_CONTEXT,
    CostModel,
    load_costs,
    probe_points,
    probed_batches,
    save_costs,
)
from reader_spec.budget.probe import Floor, FloorProbe, probe_verify, time_interleaved
from reader_spec.budget.realized import EXTRA_RANGE, DraftingGate, RealizedAcceptance, RealizedCost
from reader_spec.engine.runner import ModelRunner
from reader_spec.engine.tree import EMPTY_PROPOSAL, chain_proposal

# Shaped like a CPU's measured batch-1 curve (seconds by draft tokens): 7 drafts, 8 tree tokens, cost
# ~1.8 plain steps.
CURVE = {
    0: 0.042,
    1: 0.043,
    3: 0.061,
    7: 0.076,
    11: 0.080,
    15: 0.084,
    23: 0.09,
    31: 0.10,
    47: 0.125,
    63: 0.15,
}


def costs(scale_by_batch=None):
    scale_by_batch = scale_by_batch or {1: 1.0, 2: 1.5, 4: 2.5, 8: 4.0}
    return at_probe_context({b: {d: t * s for d, t in CURVE.items()} for b, s in scale_by_batch.items()})


def at_probe_context(curves):
    """Cost samples measured at the probe context only, as ``{batch: {drafted: seconds}}``."""
    return CostModel({PROBE_CONTEXT: curves})


def allocate_at(proposals, model, budget, context=PROBE_CONTEXT, realized=1.0):
    """The allocation at the cost model's table for this batch, as the engine prices a step."""
    seconds = model.table(len(proposals), len(proposals) * budget, context)
    return allocate(proposals, seconds, budget, realized)


def test_interpolates_draft_counts_and_batches():
    model = costs()
    assert model.seconds(1, 7) == pytest.approx(0.076)
    assert model.seconds(1, 9) == pytest.approx((0.076 + 0.080) / 2)
    assert model.seconds(3, 0) == pytest.approx(0.042 * 2.0)  # halfway between batch 2 and 4
    halfway = [(model.seconds(2, d) + model.seconds(4, d)) / 2 for d in range(10)]
    assert model.table(3, 9) == pytest.approx(halfway)


def test_calibration_measures_missing_curves_once_and_persists(tmp_path):
    calls = []
    path = tmp_path / "c.json"

    def measure(batch, drafted, context):
        calls.append((batch, list(drafted), context))
        return {d: 0.01 * (d + 1) * context / PROBE_CONTEXT for d in drafted}

    model = CostModel(measure=measure, budget=4, path=path)
    with pytest.raises(KeyError, match="calibrate"):
        model.seconds(2, 3)  # lookups never measure
    assert calls == []
    progress = []
    model.calibrate(2, progress=lambda done, total: progress.append((done, total)))
    # Per batch size, every total the budget allows; at the long context no draft and two per sequence.
    assert calls == [
        (1, list(range(5)), PROBE_CONTEXT),
        (1, [0, 2], LONG_CONTEXT),
        (2, list(range(9)), PROBE_CONTEXT),
        (2, [0, 4], LONG_CONTEXT),
    ]
    assert progress == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert model.seconds(2, 3) == pytest.approx(0.04)
    assert load_costs(path) == model.samples
    model.calibrate(2)
    assert len(calls) == 4 and model.missing(2) == []
    assert [batch for batch, _, _ in model.missing(3)] == [4, 4]


def test_batches_probed_cover_every_batch_size_by_interpolation():
    assert probed_batches(1) == [1]
    assert probed_batches(3) == [1, 2, 4]
    assert probed_batches(8) == [1, 2, 4, 8]


def test_the_probe_times_passes_over_the_models_own_greedy_text(tiny):
    """After a random start the probe's context and drafts are what greedy decoding would write, so
    the greedy head sees text the model is sure of, as in real requests, not noise."""
    context, width = 12, 4
    runner = ModelRunner(tiny.model, 1, context + width)
    tokens = probe._probe_text(runner, context, width, tiny.model.config.vocab_size)
    assert len(tokens) == context + width
    assert int(runner.cache.lengths[0]) == context
    random_start = context - min(probe.NATURAL_TOKENS, context - 1)
    with torch.inference_mode():
        greedy = tiny.model(torch.tensor([tokens[:-1]])).logits[0].argmax(-1).tolist()
    assert greedy[random_start - 1 :] == tokens[random_start:]


def test_probing_leaves_the_global_random_state_alone(tiny):
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    probe_verify(tiny.model, 2, [0, 2], 8)
    assert torch.equal(torch.rand(3), expected)


def test_cost_grows_with_context_as_measured_at_the_long_context():
    long = LONG_CONTEXT - PROBE_CONTEXT
    model = CostModel(
        {
            PROBE_CONTEXT: {4: {0: 1.0, 4: 1.2, 8: 1.4, 16: 1.8}},
            LONG_CONTEXT: {4: {0: 2.0, 8: 2.8}},  # each context token adds 1/long s, 1.4/long with 8 drafts
        }
    )
    assert model.seconds(4, 0, LONG_CONTEXT) == pytest.approx(2.0)
    assert model.seconds(4, 8, LONG_CONTEXT) == pytest.approx(2.8)
    assert model.seconds(4, 4, PROBE_CONTEXT + long / 2) == pytest.approx(1.2 + 0.6)  # slope 1.2/long
    assert model.seconds(4, 16, LONG_CONTEXT) == pytest.approx(1.8 + 1.8)  # slope extrapolated to 1.8/long
    at = (700 - PROBE_CONTEXT) / long  # slopes 1/long, 1.2/long (interpolated), 1.4/long at 0, 4, 8 drafts
    table = model.table(4, 8, 700)
    assert [table[0], table[4], table[8]] == pytest.approx([1.0 + at, 1.2 + 1.2 * at, 1.4 + 1.4 * at])


def test_probes_every_total_up_to_the_dense_limit_then_sparse_ones_up_to_the_budget():
    dense = DENSE_TOKENS
    assert probe_points(1, 3) == [0, 1, 2, 3]
    assert probe_points(1, 16) == list(range(17))
    assert probe_points(1, 100) == [*range(dense), 47, 63, 95, 100]  # the budget's own maximum last
    assert probe_points(8, 128) == [*range(dense - 8 + 1), 40, 56, 88, 120, 128]
    assert probe_points(32, 512) == [0, 16, 32, 64, 96, 160, 224, 352, 480, 512]
    assert probe_points(64, 16) == [0, 16]
    assert probe_points(4, 0) == [0]


def test_a_staircase_curve_is_priced_where_it_was_measured():
    """Two drafts costing what one does must not be priced halfway to three."""
    model = at_probe_context({1: {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.5}})
    third = chain_proposal(range(3), [0.2, 0.04, 0.01])
    assert model.seconds(1, 2) == 1.0
    assert allocate_at([third], model, 3) == [2]


def test_corrupt_cost_file_is_ignored(tmp_path):
    path = tmp_path / "c.json"
    path.write_text("{not json")
    assert load_costs(path) == {}
    save_costs(path, {256: {1: {1: 0.5}}})
    assert load_costs(path) == {256: {1: {1: 0.5}}}


def test_weak_drafts_are_not_verified():
    weak = chain_proposal(range(16), [0.01] * 16)
    assert allocate_at([weak], costs(), 16) == [0]
    assert allocate_at([EMPTY_PROPOSAL], costs(), 16) == [0]


def test_sure_drafts_get_a_deep_tree():
    sure = chain_proposal(range(16), [0.97 ** (i + 1) for i in range(16)])
    assert allocate_at([sure], costs(), 16) == [16]
    assert allocate_at([sure], costs(), 4) == [4]


def test_count_chosen_maximises_expected_tokens_per_second():
    probs = [0.9, 0.7, 0.5, 0.3, 0.2, 0.1, 0.05]
    model = costs()
    [count] = allocate_at([chain_proposal(range(7), probs)], model, 7)
    rates = {n: (1 + sum(probs[:n])) / model.seconds(1, n) for n in range(8)}
    assert count == max(rates, key=rates.get)


def test_draft_tokens_go_to_the_sequences_whose_nodes_are_likeliest():
    """A sure match gets a deep tree and a weak one nothing, in the same batch."""
    sure = chain_proposal(range(8), [0.95 ** (i + 1) for i in range(8)])
    weak = chain_proposal(range(8), [0.02] * 8)
    middling = chain_proposal(range(8), [0.6, 0.3, 0.1, 0.05, 0.02, 0.01, 0.01, 0.01])
    # Each draft token adds 0.01 s to a 1 s pass of four sequences.
    linear = at_probe_context({4: {0: 1.0, 32: 1.32}})
    counts = allocate_at([weak, sure, EMPTY_PROPOSAL, middling], linear, 8)
    assert counts[0] == counts[2] == 0
    assert counts[1] == 8
    assert 1 <= counts[3] <= 3
    # Greedy by marginal gain: every kept node is at least as likely as every node left out.
    proposals = [weak, sure, EMPTY_PROPOSAL, middling]
    kept = [p.probs[i] for p, n in zip(proposals, counts, strict=True) for i in range(n)]
    left = [p.probs[i] for p, n in zip(proposals, counts, strict=True) for i in range(n, len(p))]
    assert min(kept) >= max(left)


def test_total_draft_follows_the_batchs_spare_compute():
    """Where extra tokens are nearly free the batch drafts more than where they cost dearly."""
    proposals = [chain_proposal(range(8), [0.5 ** (i + 1) for i in range(8)]) for _ in range(8)]
    cheap = at_probe_context({8: {0: 1.0, 64: 1.1}})
    dear = at_probe_context({8: {0: 1.0, 64: 4.0}})
    assert sum(allocate_at(proposals, cheap, 8)) > sum(allocate_at(proposals, dear, 8)) > 0
    # Long contexts make the pass dearer, the same drafts relatively cheaper: more of them pay.
    with_context = CostModel({PROBE_CONTEXT: {8: {0: 1.0, 64: 4.0}}, LONG_CONTEXT: {8: {0: 3.0, 16: 3.75}}})
    at_long = allocate_at(proposals, with_context, 8, LONG_CONTEXT)
    assert sum(at_long) > sum(allocate_at(proposals, with_context, 8))


def test_probabilities_are_taken_as_verification_has_borne_them_out():
    probs = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]
    model = at_probe_context({1: {0: 1.0, 16: 3.0}})  # each draft token an eighth of a pass
    halved = chain_proposal(range(8), [p / 2 for p in probs])
    [trusted] = allocate_at([chain_proposal(range(8), probs)], model, 8)
    [discounted] = allocate_at([chain_proposal(range(8), probs)], model, 8, realized=0.5)
    assert discounted == allocate_at([halved], model, 8)[0] < trusted


def test_realized_acceptance_follows_recent_steps_from_a_neutral_start():
    realized = RealizedAcceptance(decay=1.0, prior=4.0)
    assert realized.factor == 1.0
    realized.record(10.0, 5)
    assert realized.factor == pytest.approx(9 / 14)
    fading = RealizedAcceptance(decay=0.9, prior=0.01)
    for _ in range(200):
        fading.record(2.0, 2)
    for _ in range(200):  # the older steps fade: the factor is the recent steps'
        fading.record(2.0, 1)
    assert fading.factor == pytest.approx(0.5, abs=1e-3)
    for _ in range(200):  # steps that verify nothing: back to trusting the estimates
        fading.record(0.0, 0)
    assert fading.factor == pytest.approx(1.0, abs=1e-3)
    for _ in range(200):  # more accepted than expected: no more than the estimates themselves
        fading.record(1.0, 2)
    assert fading.factor == 1.0
    for decay, prior in [(0.0, 1.0), (1.5, 1.0), (0.9, 0.0)]:
        with pytest.raises(ValueError):
            RealizedAcceptance(decay, prior)


def measure_floor(model) -> Floor:
    """The floor alone, one round (what ``reader calibrate`` times beside the passes)."""
    floor_probe = FloorProbe(model)
    with torch.inference_mode():
        return floor_probe.floor(time_interleaved(floor_probe.calls, rounds=1))


@pytest.mark.parametrize("weights", ["float32", "int8", "int4"])
def test_the_floor_counts_every_weight_once_packed_or_not(weights):
    from reader_spec.engine.decoder import FastDecoder
    from tests.conftest import make_tiny_llama

    model = make_tiny_llama()
    parameters = sum(p.numel() for p in model.parameters())  # a tied matrix is one parameter
    before = measure_floor(model)
    FastDecoder(
        model, weight_format=weights
    )  # fused views of shared matrices, padded to whole blocks of 32 rows
    after = measure_floor(model)
    assert before.parameters == parameters and before.weight_bytes == 4 * parameters
    assert not before.integer_products
    # Multiply-adds a token costs, whatever the storage: not the padding rows, nor bytes taken for floats.
    assert after.parameters == parameters
    if weights == "float32":
        assert parameters <= after.weight_bytes / 4 <= 1.25 * parameters and not after.integer_products
    else:  # a quarter of float32's bytes or less (scales and padding included), integer products timed
        assert after.weight_bytes < 0.4 * before.weight_bytes and after.integer_products
        assert after.flops_per_second > 0


def test_the_floor_and_the_passes_are_timed_in_the_same_rounds(tiny, monkeypatch):
    """A floor timed minutes before the passes would be another minute's floor on a shared host."""
    timed = []

    def record(calls, *args, **kwargs):
        timed.append(set(calls))
        return time_interleaved(calls, *args, **kwargs)

    monkeypatch.setattr(probe, "time_interleaved", record)
    floor, passes = probe.floor_and_passes(tiny.model, [0, 3], 8, rounds=1)
    assert len(timed) == 1 and {("pass", 0), ("pass", 3)} < timed[0]
    assert {kind for kind, _ in timed[0]} == {"floor", "pass"}
    assert set(passes) == {0, 3} and all(seconds > 0 for seconds in passes.values())
    alone = measure_floor(tiny.model)
    assert (floor.weight_bytes, floor.parameters) == (alone.weight_bytes, alone.parameters)
    assert floor.bytes_per_second > 0 and floor.flops_per_second > 0


def test_the_floor_is_bandwidth_until_compute_takes_longer():
    floor = Floor(weight_bytes=1_000, parameters=250, bytes_per_second=1_000.0, flops_per_second=5_000.0)
    assert floor.seconds(1) == 1.0 and floor.seconds(10) == 1.0  # 2 x 250 x 10 / 5000 = 1
    assert floor.seconds(20) == 2.0


def test_seconds_saved_weighs_expected_tokens_against_the_pass():
    proposals = [chain_proposal(range(2), [0.8, 0.5]), chain_proposal(range(1), [0.4])]
    seconds = [1.0, 1.1, 1.2, 1.3]
    # Two sequences, 1.7 tokens expected from the kept nodes: 3.7 tokens, 1.85 plain passes.
    assert seconds_saved(proposals, [2, 1], seconds) == pytest.approx(3.7 / 2 - 1.3)
    assert seconds_saved(proposals, [1, 0], seconds, realized=0.5) == pytest.approx(2.4 / 2 - 1.1)
    assert seconds_saved(proposals, [0, 0], seconds) == 0.0


def test_realized_cost_learns_the_plain_pass_and_the_drafts_extra_apart():
    curve = [20.0 + 0.2 * n for n in range(9)]  # timed in a slow minute: plain dear, drafts cheap
    cost = RealizedCost(decay=1.0, prior=1.0, band=2.0)
    assert cost.adjust(curve) == curve and cost.factors() == (1.0, 1.0, 0.0)
    for _ in range(50):
        for n in range(9):  # what the passes cost since: 12 ms plain, 1.3 ms a draft token
            cost.record(curve[0], curve[n], n, measured=12.0 + 1.3 * n)
    assert cost.factors()[0] == pytest.approx(0.6, rel=0.02)
    assert cost.adjust(curve) == pytest.approx([12.0 + 1.3 * n for n in range(9)], rel=0.02)
    before = cost.factors()
    cost.record(curve[0], curve[4], 4, measured=100.0)  # stalled, or not this machine's curve
    cost.record(curve[0], curve[0], 0, measured=0.001)
    assert cost.factors() == before


def test_realized_cost_prices_draft_tokens_a_flat_curve_called_free():
    curve = [50.0, 49.0, 47.0, 48.0, 50.0, 49.5, 50.0, 51.0, 50.0]  # noise around a flat line
    cost = RealizedCost(decay=0.98, prior=4.0, band=2.0)
    for _ in range(40):
        for n in (0, 0, 0, 2, 4, 8):  # each draft token adds 2 ms to a 50 ms pass
            cost.record(curve[0], curve[n], n, measured=50.0 + 2.0 * n)
    base, _, per_token = cost.factors()
    assert base == pytest.approx(1.0, abs=0.02) and per_token == pytest.approx(0.04, rel=0.1)
    adjusted = cost.adjust(curve)
    assert adjusted[8] - adjusted[0] == pytest.approx(16.0, rel=0.15)


def test_one_token_passes_dearer_than_the_curve_do_not_scale_every_tree():
    """Passes of one draft token that cost more than the curve says raise the price of a token, not
    the curve's whole extra by their ratio (which would price every larger tree that much too high
    and keep the allocation at one token, the only size it then measures)."""
    curve = [17.03, 17.79, 19.83, 21.51, 22.57, 23.14, 24.67, 27.36, 28.92]  # batch 8, one minute's
    cost = RealizedCost()
    for step in range(64):  # a trial of one token every 8 steps, 2 ms over the plain pass
        drafted = 1 if step % 8 == 0 else 0
        cost.record(curve[0], curve[drafted], drafted, measured=curve[0] + 2.0 * drafted)
    adjusted = [t - cost.adjust(curve)[0] for t in cost.adjust(curve)]
    assert adjusted[1] > curve[1] - curve[0]  # one token is dearer than the curve says
    assert adjusted[4] < 1.6 * (curve[4] - curve[0]) and adjusted[8] < 1.6 * (curve[8] - curve[0])


def test_realized_cost_is_held_within_its_band_and_fades_back_to_the_curve():
    cost = RealizedCost(decay=0.9, prior=0.01, band=2.0)
    for _ in range(200):  # drafts whose pass costs no more than a plain one
        cost.record(10.0, 10.0, 0, measured=10.0)
        cost.record(10.0, 12.0, 2, measured=10.0)
    assert cost.factors() == pytest.approx((1.0, 1 / EXTRA_RANGE, 0.0), abs=0.02)
    for _ in range(200):  # only plain passes, below the curve: the drafts' factors return to the curve's
        cost.record(10.0, 10.0, 0, measured=8.0)
    assert cost.factors() == pytest.approx((0.8, 1.0, 0.0), abs=1e-2)
    for decay, prior, band in [(0.0, 1.0, 2.0), (0.9, 0.0, 2.0), (0.9, 1.0, 0.5)]:
        with pytest.raises(ValueError):
            RealizedCost(decay, prior, band)


def test_drafting_gate_stops_proposing_when_drafts_save_less_than_drafting_takes():
    gate = DraftingGate(decay=0.5, explore_every=2, max_explore_every=4, min_trials=3)
    for _ in range(3):  # open until it has tried enough steps, whatever they found
        assert gate.open(32) and gate.propose(32)
        gate.record(32, saved=0.0, spent=0.001)
    assert not gate.open(32)
    gate.record(32, saved=0.010, spent=0.001)
    assert gate.open(32) and gate.propose(32)
    for _ in range(6):  # drafts that save a tenth of what drafting takes
        gate.record(32, saved=0.0001, spent=0.001)
    assert not gate.open(32) and gate.open(31)  # each power of two of batch sizes learns apart
    # Plain steps, with a proposing one after 2 skipped, then 4 (the interval doubles, up to 4).
    assert [gate.propose(32) for _ in range(10)] == [False, True] + [False, False, False, True] * 2
    gate.record(32, saved=0.05, spent=0.001)  # an exploring step finds drafts worth their time again
    assert gate.open(32) and all(gate.propose(32) for _ in range(4))
    for decay, every, most, trials in [
        (0.0, 4, 8, 1),
        (1.5, 4, 8, 1),
        (0.5, 0, 8, 1),
        (0.5, 4, 2, 1),
        (0.5, 4, 8, 0),
    ]:
        with pytest.raises(ValueError):
            DraftingGate(decay, every, most, trials)


def test_a_closed_gate_weighs_an_exploring_step_against_recent_steps_not_old_trials():
    gate = DraftingGate()
    proposing = 0
    for _ in range(3000):  # drafts that save half what drafting takes: closed, exploring now and then
        if gate.propose(8):
            proposing += 1
            gate.record(8, saved=0.0002, spent=0.0004)
    assert not gate.open(8)
    assert proposing <= gate.min_trials + 3000 // gate.max_explore_every + 4
    steps = 0
    while not gate.open(8):  # then drafts worth five times their cost: the next exploring step opens it
        steps += 1
        if gate.propose(8):
            gate.record(8, saved=0.002, spent=0.0004)
    assert steps <= gate.max_explore_every
    # It stood for the steps skipped before it: steps that save a little less than drafting takes do
    # not close the gate again for about as many steps.
    for _ in range(gate.max_explore_every):
        assert gate.propose(8)
        gate.record(8, saved=0.0003, spent=0.0004)
