"""The draft model's tree, its fusions with retrieval, and exactness with any draft model."""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace

import pytest
import torch

from reader_spec.budget.costs import CostModel
from reader_spec.config import GenerationConfig
from reader_spec.drafters import ReaderDrafter
from reader_spec.drafters.fusion import (
    FusedDrafter,
    graft,
    likeliest_path,
    merge_proposals,
    prune_branches,
    sub_feedback,
)
from reader_spec.drafters.model import ModelDrafter, load_draft_model
from reader_spec.drafters.model.pricing import PassTimer
from reader_spec.engine import kernels
from reader_spec.engine.layouts import dequantize_int4, quantize_int4, quantize_int8_grouped
from reader_spec.engine.loop import Engine
from reader_spec.engine.tree import EMPTY_PROPOSAL, DraftTree, Proposal, chain_proposal
from reader_spec.engine.weights import INT8_GROUPED
from reader_spec.loading import LoadedModel, ModelLoadError
from tests.conftest import make_tiny_llama, make_tiny_tokenizer
from tests.engine.test_engine import FLAT_COSTS, NO_EOS, mixed_configs, next_turns, random_prompts


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(9, seed=3)


@pytest.fixture(scope="module")
def plain(tiny, prompts):
    return Engine(tiny).generate(prompts, NO_EOS)


@pytest.fixture(scope="module")
def plain_sampled(tiny, prompts):
    return Engine(tiny).generate(prompts, mixed_configs(len(prompts)))


@pytest.fixture(scope="module")
def same_draft(tiny) -> LoadedModel:
    """A copy of the target as its draft model: it drafts what the target emits (greedy)."""
    return replace(tiny, model=copy.deepcopy(tiny.model), name="tiny-copy")


@pytest.fixture(scope="module")
def other_draft(tiny) -> LoadedModel:
    """Another random model with the target's tokenizer: it drafts mostly wrong tokens."""
    return replace(tiny, model=make_tiny_llama(seed=7), name="tiny-other")


@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize("which", ["same", "other"])
@pytest.mark.parametrize("cache", ["shared", "own"])
def test_model_drafts_are_exact_with_any_draft_model(
    tiny, prompts, plain, same_draft, other_draft, which, batch_size, cache
):
    """Both draft models have the target's configuration: by default they read and write the
    target's KV cache (:meth:`ModelDrafter.share_cache`), or keep a cache of their own."""
    draft = same_draft if which == "same" else other_draft
    drafter = ModelDrafter(draft, max_depth=5, share_target_cache=cache == "shared")
    engine = Engine(tiny, drafter, budget=8, costs=FLAT_COSTS)
    outputs = engine.generate(prompts, NO_EOS, batch_size=batch_size)
    assert (drafter._runner.cache is engine._runner.cache) == (cache == "shared")
    assert [o.tokens for o in outputs] == [o.tokens for o in plain]
    accepted = sum(o.stats.accepted for o in outputs)
    if which == "same":  # the copy's likeliest children are the target's choices (a flat random model:
        # its top child has a low probability, so the budget also buys siblings)
        assert sum(o.stats.new_tokens for o in outputs) / sum(o.stats.steps for o in outputs) > 2.5
    assert accepted == sum(o.stats.accepted_by_source.get("model", 0) for o in outputs)


def test_a_drafter_set_after_the_engine_ran_shares_its_cache(tiny, prompts, plain, same_draft):
    """A benchmark gives each run a fresh drafter on an engine whose runner (and cache) already
    exists: the new drafter must be offered the target's cache as the first one was."""
    engine = Engine(tiny, ModelDrafter(same_draft, max_depth=3), budget=8, costs=FLAT_COSTS)
    engine.generate(prompts[:1], NO_EOS)
    drafter = engine.drafter = ModelDrafter(same_draft, max_depth=3)
    assert drafter._runner.cache is engine._runner.cache
    assert [o.tokens for o in engine.generate(prompts[:3], NO_EOS)] == [o.tokens for o in plain[:3]]
    engine.add_request(prompts[0], NO_EOS)
    engine.step()
    with pytest.raises(RuntimeError, match="while requests are running"):
        engine.drafter = None


@pytest.mark.parametrize("cache", ["shared", "own"])
def test_next_turns_on_reused_rows_stay_exact(tiny, prompts, plain, same_draft, cache):
    """The target's rows hold the first turns; a draft model on the target's cache drafts from them, one
    with its own reads its text afresh: either way the next turns are plain decoding's."""
    second = next_turns(prompts[:4], plain[:4])
    expected = Engine(tiny, reuse_prefixes=False).generate(second, NO_EOS)
    drafter = ModelDrafter(same_draft, max_depth=4, share_target_cache=cache == "shared")
    engine = Engine(tiny, drafter, budget=8, costs=FLAT_COSTS, max_batch_size=4)
    engine.generate(prompts[:4], NO_EOS, batch_size=4)
    outputs = engine.generate(second, NO_EOS, batch_size=4)
    assert [o.tokens for o in outputs] == [o.tokens for o in expected]
    for prompt, output in zip(prompts[:4], outputs, strict=True):
        assert output.stats.cached_tokens >= len(prompt) + NO_EOS.max_new_tokens - 1
    assert sum(o.stats.accepted_by_source.get("model", 0) for o in outputs) > 0


@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize("mode", ["reader", "rasd"])
def test_fused_drafts_are_exact_and_sampling_stays_the_models(
    tiny, prompts, plain_sampled, other_draft, mode, batch_size
):
    drafter = FusedDrafter(ReaderDrafter(), ModelDrafter(other_draft, max_depth=4), mode)
    engine = Engine(tiny, drafter, budget=8, costs=FLAT_COSTS)
    outputs = engine.generate(prompts, mixed_configs(len(prompts)), batch_size=batch_size)
    assert [o.tokens for o in outputs] == [o.tokens for o in plain_sampled]


@pytest.mark.parametrize("mode", ["reader", "rasd"])
def test_fusion_credits_both_sources_greedy(tiny, prompts, plain, same_draft, mode):
    drafter = FusedDrafter(ReaderDrafter(), ModelDrafter(same_draft, max_depth=4), mode)
    outputs = Engine(tiny, drafter, budget=8, costs=FLAT_COSTS).generate(prompts, NO_EOS, batch_size=3)
    assert [o.tokens for o in outputs] == [o.tokens for o in plain]
    sources = {s for o in outputs for s in o.stats.accepted_by_source}
    assert "model" in sources


def test_adaptive_budget_with_measured_costs_stays_exact(tiny, prompts, plain, same_draft):
    """Measured costs make levels and the draft model itself optional each step."""
    drafter = FusedDrafter(ReaderDrafter(), ModelDrafter(same_draft), "reader")
    outputs = Engine(tiny, drafter, budget=8).generate(prompts, NO_EOS, batch_size=4)
    assert [o.tokens for o in outputs] == [o.tokens for o in plain]


def test_rasd_runs_the_draft_model_every_step_but_only_the_levels_that_pay(
    tiny, prompts, plain, same_draft, monkeypatch
):
    """Where every verified draft token costs a whole pass, no level beyond the first pays; where
    verification costs the same whatever it verifies, further levels are grown wherever the tree has
    a frontier (before levels were priced, both runs grew the same levels)."""
    levels, firsts = [], []
    grow, first = ModelDrafter._grow, ModelDrafter._first_level
    monkeypatch.setattr(ModelDrafter, "_grow", lambda self, *a: (levels.append(1), grow(self, *a))[1])
    monkeypatch.setattr(ModelDrafter, "_first_level", lambda self, *a: (firsts.append(1), first(self, *a))[1])
    # Passes of 100 s, so that the draft model's own milliseconds never decide.
    flat = CostModel(measure=lambda batch, drafted, context: dict.fromkeys(drafted, 100.0))
    dear = CostModel(measure=lambda batch, drafted, context: {d: 100.0 * (1 + d) for d in drafted})
    grown = {}
    for name, costs in (("flat", flat), ("dear", dear)):
        levels.clear()
        firsts.clear()
        drafter = FusedDrafter(ReaderDrafter(), ModelDrafter(same_draft, max_depth=4), "rasd")
        outputs = Engine(tiny, drafter, budget=8, costs=costs).generate(prompts, NO_EOS, batch_size=3)
        assert [o.tokens for o in outputs] == [o.tokens for o in plain]
        assert len(firsts) >= sum(o.stats.steps for o in outputs) / 3  # every step (3 requests a step)
        grown[name] = len(levels)
    assert grown["dear"] == 0 and grown["flat"] > 20


@pytest.fixture(scope="module", params=["gguf", "float"])
def packed_target(tiny, request) -> tuple[LoadedModel, dict[str, str]]:
    """The tiny model built anew (other tests pack ``tiny``'s own model in place), and how the int4
    format must store its layers and output layer: ``gguf``, every layer matrix on Q4_1's grid and the
    output layer on Q8_0's, as the default model has them (each comes back exactly); ``float``, its
    own float weights (8 bits per group everywhere)."""
    model = make_tiny_llama()
    if request.param == "float":
        return replace(tiny, model=model, name="tiny-float"), {"layers": INT8_GROUPED, "head": INT8_GROUPED}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            if name == "lm_head":
                q, scale = quantize_int8_grouped(module.weight)
                grid = q.view(*scale.shape, -1).float() * scale.float()[..., None]
                module.weight.copy_(grid.view_as(module.weight))
            else:
                module.weight.copy_(dequantize_int4(*quantize_int4(module.weight)))
    return replace(tiny, model=model, name="tiny-gguf"), {"layers": "int4", "head": INT8_GROUPED}


@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_the_self_draft_stores_what_int4_keeps_closest_and_stays_exact(
    packed_target, prompts, batch_size, sampled
):
    target, formats = packed_target
    draft = load_draft_model("self", target)
    decoder = draft.model._reader_fast_decoder
    if kernels.available() and target.model.device.type == "cpu":  # the compiled layers run both formats
        assert decoder.stack is not None
    assert decoder.lm_head.weight_format == formats["head"]
    assert all(
        linear.weight_format == formats["layers"] for layer in decoder.layers for linear in layer.linears
    )
    if target.name == "tiny-gguf":  # a GGUF file's weights come back exactly
        for name, module in target.model.named_modules():
            if isinstance(module, torch.nn.Linear):
                assert torch.equal(draft.model.get_submodule(name).plain_weight(), module.weight), name
    configs = mixed_configs(len(prompts)) if sampled else NO_EOS
    plain = Engine(target).generate(prompts, configs)
    engine = Engine(target, ModelDrafter(draft, max_depth=5), budget=8, costs=FLAT_COSTS)
    outputs = engine.generate(prompts, configs, batch_size=batch_size)
    assert [o.tokens for o in outputs] == [o.tokens for o in plain]
    if not sampled and target.name == "tiny-gguf":  # the target's own weights: it drafts what it emits
        assert sum(o.stats.new_tokens for o in outputs) / sum(o.stats.steps for o in outputs) > 2.5


def test_a_draft_model_with_another_tokenizer_is_refused(tiny, tiny_llama_dir):
    stranger = LoadedModel(make_tiny_llama(), make_tiny_tokenizer(80), "other", "another-fingerprint")
    with pytest.raises(ModelLoadError, match="another tokenizer"):
        Engine(tiny, ModelDrafter(stranger))
    target = replace(tiny, fingerprint="not-the-drafts")
    with pytest.raises(ModelLoadError, match="another tokenizer"):
        load_draft_model(str(tiny_llama_dir), target)


def test_tree_grows_best_first_and_levels_see_their_ancestors(tiny, same_draft, prompts):
    """Every level's node is what the draft model predicts after its own path, as a chain would."""
    drafter = ModelDrafter(same_draft, branching=2, expand=2, max_depth=4)
    drafter.begin("r", prompts[0])
    proposal = drafter.propose("r", 30)
    assert 0 < len(proposal) <= 2 + 2 * 2 * 3
    assert all(a >= b for a, b in zip(proposal.probs, proposal.probs[1:], strict=False))
    tree = DraftTree.from_proposal(prompts[0][-1], proposal)
    # The likeliest path, re-read greedily from the target (the same weights): it must be the chain
    # the draft model's top children form.
    greedy = Engine(tiny).generate([prompts[0]], replace(NO_EOS, max_new_tokens=4))[0].tokens
    node, path = 0, []
    for _ in range(4):
        children = [c for c in range(1, len(tree)) if tree.parents[c] == node]
        if not children:
            break
        node = children[0]
        path.append(tree.tokens[node])
    assert path == greedy[: len(path)] and len(path) >= 3


def test_calibration_learns_the_likeliest_child_apart_from_its_siblings(tiny, same_draft, prompts):
    """Greedy verification accepts a node's likeliest child whenever the two models' argmaxes agree,
    whatever its probability, and its siblings almost never: each is calibrated on its own."""
    from reader_spec.drafters.model.drafter import LIKELIEST, OTHER

    drafter = ModelDrafter(same_draft, branching=2, expand=1, max_depth=1)
    prior = ModelDrafter(same_draft).calibrate
    drafter.begin("r", prompts[0])
    tested = []
    for _ in range(40):
        proposal = drafter.propose("r", 2)
        assert len(proposal) == 2 and proposal.parents == (-1, -1)
        tested += drafter._requests["r"].pending[1]  # (raw probability, context) of each node
        drafter.observe("r", proposal, [0])  # the likeliest child accepted, as the same weights do
        drafter.extend("r", [proposal.tokens[0]])
    assert {context for _, context in tested} == {LIKELIEST, OTHER}
    for q, context in tested:
        if context == LIKELIEST:
            assert drafter.calibrate(q, context) > prior(q, context)
            assert drafter.calibrate(q, OTHER) <= prior(q, OTHER)  # a sibling's estimate did not rise
        else:
            assert drafter.calibrate(q, context) < prior(q, context)


def test_the_typical_tree_is_priced_with_the_calibration_as_it_is_now(same_draft, prompts):
    """Whether the draft model may pay is judged by its recent trees; priced by what the calibration
    said when they were drafted, one early low estimate would veto the draft model for good (a fused
    drafter then never runs it, and so never learns otherwise)."""
    drafter = ModelDrafter(same_draft, branching=2, max_depth=1)
    drafter.begin("r", prompts[0])
    proposal = drafter.propose("r", 2)
    before = drafter._typical_probs()
    assert before == sorted(proposal.probs, reverse=True)
    for q, context in drafter._requests["r"].pending[1]:
        for _ in range(20):
            drafter.calibrate.update(q, True, context)
    assert drafter._typical_probs()[0] > before[0]


def test_a_veto_on_the_draft_model_is_lifted_now_and_then(same_draft, prompts):
    """Only running the draft model corrects what prices it: vetoed steps in a row are let through
    after ``EXPLORE_EVERY``, then twice as many, and so on (a veto for good kept an early estimate)."""
    from reader_spec.drafters.model.drafter import EXPLORE_EVERY

    drafter = ModelDrafter(same_draft)
    drafter._worth_running = lambda requests, alongside, pricing: False
    allowed = [i for i in range(1, 3 * EXPLORE_EVERY + 1) if drafter.may_pay(["r"], [1.0, 1.1], None)]
    assert allowed == [EXPLORE_EVERY, 3 * EXPLORE_EVERY]
    drafter._worth_running = lambda requests, alongside, pricing: True
    assert drafter.may_pay(["r"], [1.0, 1.1], None) and drafter._veto_limit == EXPLORE_EVERY


def test_a_level_expands_only_the_nodes_whose_pass_pays():
    """A level's pass costs more with more nodes: it expands the count that raises the step's rate
    most, none where even the best node does not pay, all where nothing is priced."""
    from reader_spec.drafters.model.pricing import LevelPricing

    pricing = LevelPricing([1.0, 1.05, 1.1, 1.15], batch=1, alongside=None)

    def pass_seconds(count: int) -> float:
        return 0.1 + 0.3 * (count - 1)

    assert pricing.best_count([0.9, 0.001, 0.001], pass_seconds) == 1  # the tail is not worth 0.3 s
    assert pricing.best_count([0.9, 0.8, 0.7], lambda count: 0.1 + 0.01 * count) == 3
    assert pricing.best_count([0.9, 0.8], lambda count: 5.0) == 0  # a pass dearer than its gain
    assert pricing.best_count([0.9, 0.8], lambda count: None) == 2  # not timed yet: grow and learn
    assert LevelPricing(None, batch=1, alongside=None).best_count([0.5, 0.1], pass_seconds) == 2


def test_a_shared_cache_is_left_as_the_target_committed_it(tiny, same_draft, prompts):
    """Drafting on the target's cache writes the root and the levels past the committed length and
    leaves the length as it was: the target's verification writes the same root there next."""
    from reader_spec.engine.runner import ModelRunner

    target = ModelRunner(tiny.model, num_rows=2, capacity=64)
    target.prefill(1, prompts[0][:-1])
    committed = target.cache.layers[0].keys[1, :, : len(prompts[0]) - 1].clone()
    drafter = ModelDrafter(same_draft, branching=2, expand=2, max_depth=3)
    assert drafter.share_cache(target, lambda request: 1)
    drafter.begin("r", prompts[0])
    proposal = drafter.propose("r", 12)
    assert len(proposal) > 3 and drafter._requests["r"].row == 1
    assert target.cache.lengths.tolist() == [0, len(prompts[0]) - 1]
    assert torch.equal(target.cache.layers[0].keys[1, :, : len(prompts[0]) - 1], committed)
    # another configuration keeps a cache of its own
    deeper = make_tiny_llama(seed=3)
    deeper.model.layers.append(copy.deepcopy(deeper.model.layers[-1]))
    deeper.config.num_hidden_layers = 3
    other = replace(tiny, model=deeper, name="three-layers")
    assert not ModelDrafter(other).share_cache(target, lambda request: 1)


def test_merge_keeps_the_best_estimate_of_each_path_and_parents_first():
    model = Proposal((5, 6, 7), (-1, 0, -1), (0.9, 0.5, 0.2), ("model",) * 3)
    retrieval = chain_proposal([5, 6, 8], [0.8, 0.7, 0.6], "context")
    merged = merge_proposals([model, retrieval])
    paths = {}
    for i, (t, p) in enumerate(zip(merged.tokens, merged.parents, strict=True)):
        paths[i] = (*paths[p], t) if p >= 0 else (t,)
    by_path = {paths[i]: (merged.probs[i], merged.sources[i]) for i in range(len(merged))}
    assert by_path == {
        (5,): (0.9, "model"),
        (5, 6): (0.7, "context"),
        (5, 6, 8): (0.6, "context"),
        (7,): (0.2, "model"),
    }
    assert all(p < i for i, p in enumerate(merged.parents))


def test_prune_drops_whole_branches_by_first_token():
    proposal = Proposal((1, 2, 3, 4), (-1, 0, -1, 2), (0.9, 0.8, 0.5, 0.4), ("context",) * 4)
    pruned = prune_branches(proposal, {3})
    assert pruned.tokens == (3, 4) and pruned.parents == (-1, 0)


def test_sub_feedback_maps_the_fused_path_back_to_each_part():
    part = chain_proposal([5, 6, 8], [0.8, 0.7, 0.6], "context")
    fused = Proposal((5, 6, 9), (-1, 0, 1), (0.9, 0.7, 0.5), ("model", "context", "model"))
    verified, hits = sub_feedback(part, fused, [0, 1])
    assert verified == part.truncated(2) and hits == [0, 1]


def test_the_likeliest_path_follows_each_nodes_best_child():
    proposal = Proposal((5, 6, 7, 8, 9), (-1, -1, 0, 0, 2), (0.9, 0.5, 0.6, 0.4, 0.3), ("model",) * 5)
    assert likeliest_path(proposal) == [0, 2, 4]
    assert likeliest_path(EMPTY_PROPOSAL) == []


def test_graft_hangs_branches_below_a_node_with_path_probabilities():
    model = Proposal((5, 7), (-1, 0), (0.9, 0.8), ("model",) * 2)
    branches = Proposal((1, 2, 3), (-1, 0, -1), (0.5, 0.4, 0.1), ("context",) * 3)
    grown = graft(model, 1, branches)
    assert grown.tokens == (5, 7, 1, 2, 3) and grown.parents == (-1, 0, 1, 2, 1)
    assert grown.probs == pytest.approx((0.9, 0.8, 0.4, 0.32, 0.08))
    assert grown.sources == ("model", "model", "context", "context", "context")


class FixedModelDrafter:
    """A draft model that proposes one fixed tree and records its feedback."""

    def __init__(self, proposal: Proposal) -> None:
        self.proposal = proposal
        self.observed: list[tuple[Proposal, list[int]]] = []
        self.root_distributions: dict = {}

    def begin(self, request, prompt) -> None:
        pass

    def extend(self, request, tokens) -> None:
        pass

    def end(self, request) -> None:
        pass

    def propose_batch(self, requests, max_nodes, verify_seconds=None, **kwargs) -> list[Proposal]:
        return [self.proposal] * len(requests)

    def observe(self, request, proposal, accepted) -> None:
        self.observed.append((proposal, list(accepted)))


def node_paths(proposal: Proposal) -> list[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(proposal.tokens, proposal.parents, strict=True):
        paths.append((*paths[parent], token) if parent >= 0 else (token,))
    return paths


@pytest.mark.parametrize("whole_path", [True, False])
def test_reader_fusion_drafts_retrieval_after_the_models_likeliest_path(whole_path):
    """The text's last token (10) occurred nowhere before, so retrieval finds nothing at the root; after
    the draft model's likeliest path (3 4) it finds what followed 3 4 (5 6 9), grafted at the path's end.
    Retrieval learns from those nodes only where verification accepted the whole path; RASD, as
    published, merges at the root only."""
    retrieval = ReaderDrafter(history_tokens=0)
    model = FixedModelDrafter(Proposal((3, 4, 8), (-1, 0, -1), (0.9, 0.8, 0.05), ("model",) * 3))
    drafter = FusedDrafter(retrieval, model, "reader")
    drafter.begin("r", [1, 2, 3, 4, 5, 6, 9, 7, 10])
    fused = drafter.propose("r", 16)
    paths = node_paths(fused)
    labels = dict(zip(paths, fused.sources, strict=True))
    assert labels[(3,)] == labels[(3, 4)] == labels[(8,)] == "model"
    assert labels[(3, 4, 5)] == labels[(3, 4, 5, 6)] == "context"
    assert fused.probs[paths.index((3, 4, 5))] <= fused.probs[paths.index((3, 4))]
    before = calibration_tables(retrieval)
    accepted = [paths.index(path) for path in ((3,), (3, 4), (3, 4, 5))[: 3 if whole_path else 1]]
    drafter.observe("r", fused, accepted)
    assert (calibration_tables(retrieval) != before) == whole_path
    assert model.observed[-1][1] == ([0, 1] if whole_path else [0])

    rasd = FusedDrafter(ReaderDrafter(history_tokens=0), model, "rasd")
    rasd.begin("r", [1, 2, 3, 4, 5, 6, 9, 7, 10])
    assert set(node_paths(rasd.propose("r", 16))) == {(3,), (3, 4), (8,)}


def calibration_tables(drafter: ReaderDrafter) -> dict[str, tuple[float, ...]]:
    return {name: calibrator.table() for name, calibrator in drafter.calibrators.items()}


def test_pass_timing_learns_from_passes():
    timer = PassTimer()
    assert timer(4) is None
    timer.record(1, 0.01)
    timer.record(9, 0.03)
    assert timer(5) == pytest.approx(0.02)
    # A count's estimate is the median of its recent levels: a cold first level and a stall drop out.
    for seconds in (0.05, 0.012, 0.011, 0.3, 0.013):
        timer.record(2, seconds)
    assert timer(2) == pytest.approx(0.013)
    for _ in range(timer.window):
        timer.record(2, 0.02)
    assert timer(2) == pytest.approx(0.02)


def test_propose_batch_rows_grow_beyond_the_first_allocation(tiny, same_draft, prompts):
    drafter = ModelDrafter(same_draft, max_depth=2)
    for i, prompt in enumerate(prompts):
        drafter.begin(i, prompt)
    proposals = drafter.propose_batch(list(range(len(prompts))), 4)
    assert all(len(p) == 4 for p in proposals)
    for i in range(len(prompts)):
        drafter.end(i)


def test_greedy_config_helper():
    assert NO_EOS.max_new_tokens == 40 and GenerationConfig().temperature == 0.0


def test_step_chooser_learns_which_arm_pays_per_bucket():
    from reader_spec.drafters.fusion import StepChooser, StepTrial

    chooser = StepChooser(explore_every=5)
    clock, batch = 0.0, frozenset({"r"})
    picks = []
    for _ in range(60):
        bucket, with_model = chooser.choose(expected=0.1)  # retrieval expects almost nothing
        picks.append(with_model)
        chooser.start(StepTrial(bucket, with_model, clock, batch))
        chooser.record(3 if with_model else 1)  # the model's steps emit 3 tokens, retrieval's 1
        clock += 0.05 if with_model else 0.03  # at a higher cost: 60 tokens/s against 33
    assert set(picks[:6]) == {True, False}  # both arms tried first
    late = picks[30:]
    assert sum(late) >= len(late) - len(late) // 5 - 1  # then the model, but for exploration
    # a step after which the batch changed (a prefill may have run) is not counted
    trials = sum(stats[2] for stats in chooser._rates.values())
    chooser.start(StepTrial(0, True, clock + 5.0, frozenset({"r", "other"})))
    assert sum(stats[2] for stats in chooser._rates.values()) == trials


def test_step_chooser_tries_a_losing_arm_ever_more_rarely_until_it_wins():
    from reader_spec.drafters.fusion import StepChooser, StepTrial

    chooser = StepChooser(explore_every=5, max_explore_every=40)
    clock, batch, picks = 0.0, frozenset({"r"}), []

    def step(model_rate: float) -> None:
        nonlocal clock
        bucket, with_model = chooser.choose(expected=3.0)
        picks.append(with_model)
        chooser.start(StepTrial(bucket, with_model, clock, batch))
        chooser.record(2)
        clock += 2 / (model_rate if with_model else 50.0)

    for _ in range(300):
        step(model_rate=25.0)  # the draft model halves the rate
    tries = [i for i, p in enumerate(picks) if p][3:]  # from the last of the first trials
    gaps = [b - a for a, b in itertools.pairwise(tries)]
    assert gaps[:4] == [5, 10, 20, 40] and set(gaps[4:]) == {40}
    for _ in range(100):
        step(model_rate=200.0)  # now it pays: found at the next try, then preferred
    assert sum(picks[-40:]) >= 36


@pytest.mark.parametrize("batch_size", [1, 8])
def test_a_prompt_window_shorter_than_the_prompts_stays_exact_and_drafts(
    tiny, prompts, plain, same_draft, batch_size
):
    """With a cache of its own, the draft model reads the last 5 prompt tokens only: its drafts
    change, the output does not."""
    drafter = ModelDrafter(same_draft, max_depth=4, prompt_window=5, share_target_cache=False)
    engine = Engine(tiny, drafter, budget=8, costs=FLAT_COSTS)
    outputs = engine.generate(prompts, NO_EOS, batch_size=batch_size)
    assert [o.tokens for o in outputs] == [o.tokens for o in plain]
    assert sum(o.stats.accepted for o in outputs) > 40
    with pytest.raises(ValueError, match="prompt_window"):
        ModelDrafter(same_draft, prompt_window=0)
