"""The engine loop on a tiny model: speculative output equals plain greedy decoding, always."""

from __future__ import annotations

import copy
import itertools
import random
from collections import Counter
from dataclasses import replace

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from reader_spec.budget.costs import CostModel
from reader_spec.budget.realized import RealizedAcceptance
from reader_spec.config import GenerationConfig
from reader_spec.drafters import FusedDrafter, ModelDrafter, ReaderDrafter
from reader_spec.drafters.retrieval.datastore import Datastore
from reader_spec.engine.attention import pack
from reader_spec.engine.decoder import FastDecoder
from reader_spec.engine.kernel_choice import ROW_BUCKETS
from reader_spec.engine.loop import Engine
from reader_spec.engine.tree import EMPTY_PROPOSAL, Proposal, chain_proposal
from tests.conftest import make_tiny_llama

FLAT_COSTS = CostModel(measure=lambda batch, drafted, context: dict.fromkeys(drafted, 1.0))
"""Verification costs the same whatever it verifies, so every proposed node is verified."""

NO_EOS = GenerationConfig(max_new_tokens=40, eos_token_ids=())


def random_prompts(count: int, seed: int = 0, vocab: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(2, vocab) for _ in range(rng.randint(2, 6))]
        noise = [rng.randrange(2, vocab) for _ in range(rng.randint(1, 25))]
        prompts.append(noise + phrase * rng.randint(1, 3) + noise[:3])
    return prompts


class ScriptedDrafter:
    """Drafts from known reference continuations, corrupted at a given rate, as a two-branch tree."""

    def __init__(self, references: list[list[int]], error_rate: float, prob: float = 0.9, seed: int = 0):
        self.references, self.error_rate, self.prob = references, error_rate, prob
        self.rng = random.Random(seed)
        self.texts: dict = {}

    def begin(self, request, prompt):
        self.texts[request] = list(prompt)

    def extend(self, request, tokens):
        self.texts[request].extend(tokens)

    def observe(self, request, proposal, accepted):
        assert all(0 <= node < len(proposal) for node in accepted)

    def end(self, request):
        del self.texts[request]

    def propose(self, request, max_nodes):
        text = self.texts[request]
        for reference in self.references:
            if reference[: len(text)] == text:
                upcoming = reference[len(text) : len(text) + max_nodes]
                drafted = [
                    t if self.rng.random() >= self.error_rate else self.rng.randrange(96) for t in upcoming
                ]
                if not drafted:
                    return EMPTY_PROPOSAL
                chain = chain_proposal(drafted, [self.prob ** (i + 1) for i in range(len(drafted))])
                decoy = Proposal(((drafted[0] + 1) % 96,), (-1,), (0.01,))
                merged = Proposal(
                    chain.tokens + decoy.tokens, chain.parents + decoy.parents, chain.probs + decoy.probs
                )
                return merged.truncated(max_nodes)
        return EMPTY_PROPOSAL


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(9)


@pytest.fixture(scope="module")
def plain_outputs(tiny, prompts):
    return Engine(tiny).generate(prompts, NO_EOS)


def test_plain_engine_equals_transformers_generate(tiny, prompts, plain_outputs):
    for prompt, output in zip(prompts, plain_outputs, strict=True):
        reference = tiny.model.generate(
            torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert output.tokens == reference
        assert output.stats.mean_accepted == 1.0 and output.stats.drafted == 0


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_context_drafter_is_exact_at_any_batch_size(tiny, prompts, plain_outputs, batch_size):
    engine = Engine(tiny, ReaderDrafter(), budget=8, costs=FLAT_COSTS)
    outputs = engine.generate(prompts, NO_EOS, batch_size=batch_size)
    assert [o.tokens for o in outputs] == [o.tokens for o in plain_outputs]
    # The test only means something if drafts were verified and some were accepted.
    assert sum(o.stats.accepted for o in outputs) > 20
    for o in outputs:  # every accepted token is credited to the source that proposed it
        assert sum(o.stats.accepted_by_source.values()) == o.stats.accepted
        assert set(o.stats.accepted_by_source) <= {"context", "history", "context-half", "history-half"}


@pytest.mark.parametrize("error_rate", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_scripted_trees_are_exact_whatever_their_quality(
    tiny, prompts, plain_outputs, error_rate, batch_size
):
    references = [p + o.tokens for p, o in zip(prompts, plain_outputs, strict=True)]
    engine = Engine(tiny, ScriptedDrafter(references, error_rate), budget=6, costs=FLAT_COSTS)
    outputs = engine.generate(prompts, NO_EOS, batch_size=batch_size)
    assert [o.tokens for o in outputs] == [o.tokens for o in plain_outputs]
    accepted = sum(o.stats.accepted for o in outputs)
    if error_rate == 0.0:
        # Perfect chains: every step accepts the whole chain unless the limit cuts it.
        assert min(o.stats.mean_accepted for o in outputs) > 4
    if error_rate == 1.0:
        assert accepted < sum(o.stats.drafted for o in outputs) * 0.2


def test_limits_cut_accepted_drafts(tiny, prompts, plain_outputs):
    references = [p + o.tokens for p, o in zip(prompts, plain_outputs, strict=True)]
    for max_new in (1, 2, 5, 13):
        engine = Engine(tiny, ScriptedDrafter(references, 0.0), budget=8, costs=FLAT_COSTS)
        config = GenerationConfig(max_new_tokens=max_new, eos_token_ids=())
        for output, plain in zip(engine.generate(prompts, config, batch_size=4), plain_outputs, strict=True):
            assert output.tokens == plain.tokens[:max_new]
            assert output.finish_reason == "length"


def test_eos_token_ends_each_sequence_where_plain_decoding_does(tiny, prompts, plain_outputs):
    # Use a token the model emits often as end-of-sequence so sequences finish at different steps.
    counts = {}
    for o in plain_outputs:
        for t in o.tokens:
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=counts.get)
    config = GenerationConfig(max_new_tokens=40, eos_token_ids=(eos,))
    plain = Engine(tiny).generate(prompts, config)
    references = [p + o.tokens for p, o in zip(prompts, plain_outputs, strict=True)]
    spec = Engine(tiny, ScriptedDrafter(references, 0.0), budget=8, costs=FLAT_COSTS).generate(
        prompts, config, batch_size=3
    )
    assert [o.tokens for o in spec] == [o.tokens for o in plain]
    finished_on_eos = [o for o in spec if o.finish_reason == "eos"]
    assert finished_on_eos and all(o.tokens[-1] == eos for o in finished_on_eos)
    assert len({len(o.tokens) for o in spec}) > 1  # finished at different steps


def test_stop_string_cuts_text_and_tokens(tiny, prompts, plain_outputs):
    plain = plain_outputs[0]
    stop_token = plain.tokens[6]
    stop = tiny.tokenizer.decode([stop_token])
    # The first token whose text completes the stop string (an earlier word may contain it: "w9" in "w92").
    first = next(k for k in range(7) if stop in tiny.tokenizer.decode(plain.tokens[: k + 1]))
    config = GenerationConfig(max_new_tokens=40, eos_token_ids=(), stop_strings=(stop,))
    out = Engine(tiny, ReaderDrafter(), costs=FLAT_COSTS).generate([prompts[0]], config)[0]
    assert out.finish_reason == "stop"
    assert out.tokens == plain.tokens[: first + 1]
    assert stop not in out.text


def test_more_prompts_than_slots_keep_input_order(tiny, prompts, plain_outputs):
    ids = [f"r{i}" for i in range(len(prompts))]
    outputs = Engine(tiny, ReaderDrafter(), costs=FLAT_COSTS).generate(prompts, NO_EOS, batch_size=2, ids=ids)
    assert [o.id for o in outputs] == ids
    assert [o.tokens for o in outputs] == [o.tokens for o in plain_outputs]


class HalfSureDrafter(ScriptedDrafter):
    """Sure of its drafts for even requests, unsure for odd ones (the drafts themselves are good)."""

    def propose(self, request, max_nodes):
        proposal = super().propose(request, max_nodes)
        if request % 2:
            proposal = replace(proposal, probs=tuple(0.02 for _ in proposal.probs))
        return proposal


@pytest.mark.parametrize("call_cost", [0, 10**9])  # attention by runs of equal width, or all padded
def test_batch_budget_gives_each_sequence_its_own_draft(tiny, prompts, plain_outputs, call_cost, monkeypatch):
    """Trees of unequal widths in one pass, through the packed PyTorch attention that a GPU runs (a
    CPU's compiled attention reads the rows itself and never packs)."""
    import reader_spec.engine.runner as runner_module

    monkeypatch.setattr(FastDecoder, "_runs_compiled", lambda self, tokens: False)
    monkeypatch.setattr(runner_module, "attention_call_cost", lambda *args: call_cost)
    layouts = []

    def packing(*args):
        layouts.append(pack(*args))
        return layouts[-1]

    monkeypatch.setattr(runner_module, "pack", packing)
    references = [p + o.tokens for p, o in zip(prompts, plain_outputs, strict=True)]
    linear = CostModel(measure=lambda batch, drafted, context: {d: 1.0 + 0.02 * d for d in drafted})
    engine = Engine(tiny, HalfSureDrafter(references, 0.0), budget=6, costs=linear)
    outputs = engine.generate(prompts, NO_EOS, batch_size=4)
    assert [o.tokens for o in outputs] == [o.tokens for o in plain_outputs]
    sure, unsure = outputs[0::2], outputs[1::2]
    assert all(o.stats.drafted == 0 for o in unsure)
    assert all(o.stats.mean_accepted > 3 for o in sure)
    adjacent_splits = [  # groups of one pass that a single call could have covered
        (a, b)
        for layout in layouts
        for a, b in itertools.pairwise(layout.groups)
        if b.first_row == a.first_row + a.count
    ]
    assert layouts and bool(adjacent_splits) == (call_cost == 0)


def test_weak_drafts_are_not_verified(tiny, prompts, plain_outputs):
    references = [p + o.tokens for p, o in zip(prompts, plain_outputs, strict=True)]
    steep = CostModel(measure=lambda batch, drafted, context: {d: 2.0 + d for d in drafted})
    engine = Engine(tiny, ScriptedDrafter(references, 0.0, prob=0.05), budget=8, costs=steep)
    outputs = engine.generate(prompts[:2], NO_EOS)
    assert sum(o.stats.drafted for o in outputs) == 0
    assert [o.tokens for o in outputs] == [o.tokens for o in plain_outputs[:2]]


def test_drafts_whose_estimates_run_high_stop_being_verified(tiny, prompts, plain_outputs, monkeypatch):
    """A drafter sure of drafts that are never accepted: the engine learns from verification that its
    probabilities do not hold and stops paying for them; output stays exact."""
    references = [p + o.tokens for p, o in zip(prompts, plain_outputs, strict=True)]
    linear = CostModel(measure=lambda batch, drafted, context: {d: 1.0 + 0.1 * d for d in drafted})

    def drafted(engine):
        outputs = engine.generate(prompts[:3], NO_EOS)
        assert [o.tokens for o in outputs] == [o.tokens for o in plain_outputs[:3]]
        return sum(o.stats.drafted for o in outputs), engine.planner.realized.factor

    learning, factor = drafted(Engine(tiny, ScriptedDrafter(references, 1.0), budget=6, costs=linear))
    assert factor < 0.9
    monkeypatch.setattr(RealizedAcceptance, "record", lambda self, expected, accepted: None)
    trusting, factor = drafted(Engine(tiny, ScriptedDrafter(references, 1.0), budget=6, costs=linear))
    assert trusting > 5 * learning > 0


def test_drafting_that_takes_longer_than_its_drafts_save_is_mostly_skipped(tiny, prompts, plain_outputs):
    """Passes priced so cheap that no draft can win back the drafter's own time: once the gate has seen
    enough steps the engine stops asking for proposals but every ``explore_every``-th step; output
    stays exact."""
    references = [p + o.tokens for p, o in zip(prompts, plain_outputs, strict=True)]

    class Counting(ScriptedDrafter):
        calls = 0

        def propose(self, request, max_nodes):
            Counting.calls += 1
            return super().propose(request, max_nodes)

    class SelfPricing(Counting):
        prices_own_drafting = True

    def proposals_made(seconds_per_pass, drafter_class=Counting):
        costs = CostModel(measure=lambda b, drafted, c: {d: seconds_per_pass * (1 + d / 10) for d in drafted})
        Counting.calls = 0
        engine = Engine(tiny, drafter_class(references, 0.5), budget=6, costs=costs)
        outputs = engine.generate(prompts[:2], NO_EOS)
        assert [o.tokens for o in outputs] == [o.tokens for o in plain_outputs[:2]]
        return Counting.calls, sum(o.stats.steps for o in outputs)

    calls, steps = proposals_made(1.0)
    assert calls == steps  # drafts worth a tenth of a second each: every step proposes
    calls, steps = proposals_made(1e-9)
    gate = Engine(tiny).planner.gate
    assert gate.min_trials < calls <= gate.min_trials + 1 + steps // gate.explore_every
    calls, steps = proposals_made(1e-9, SelfPricing)  # a drafter that weighs its own cost decides
    assert calls == steps


def test_single_token_prompt_and_text_and_chat_prompts(tiny):
    engine = Engine(tiny, ReaderDrafter(), costs=FLAT_COSTS)
    config = GenerationConfig(max_new_tokens=5, eos_token_ids=())
    single = engine.generate([[7]], config)[0]
    text = engine.generate(["w7"], config)[0]
    chat = engine.generate([[{"role": "user", "content": "w7 w8"}]], config)[0]
    assert single.tokens == text.tokens and len(single.tokens) == 5
    assert len(chat.tokens) == 5 and chat.stats.prompt_tokens == 4


def test_invalid_arguments(tiny):
    with pytest.raises(ValueError):
        Engine(tiny, budget=-1)
    with pytest.raises(ValueError):
        Engine(tiny).generate([[1, 2]], batch_size=0)
    with pytest.raises(ValueError):
        GenerationConfig(max_new_tokens=0)
    engine = Engine(tiny)
    for call in (
        lambda config: engine.generate([[1, 2]], config),
        lambda config: engine.add_request([1, 2], config),
    ):
        with pytest.raises(ValueError, match=r"logit_bias names token 96, outside the vocabulary \(0..95\)"):
            call(GenerationConfig(logit_bias={5: 1, 96: -100}))
    assert not len(engine.scheduler)


# --- sampling: seeded output depends only on the request and its seed ---------------------------------
SAMPLED = [
    GenerationConfig(max_new_tokens=40, eos_token_ids=(), temperature=0.7, top_p=0.9, seed=1),
    GenerationConfig(max_new_tokens=40, eos_token_ids=(), temperature=1.0, top_p=0.9, seed=2),
    GenerationConfig(
        max_new_tokens=40, eos_token_ids=(), temperature=0.8, top_k=12, repetition_penalty=1.2, seed=3
    ),
    GenerationConfig(
        max_new_tokens=40,
        eos_token_ids=(),
        temperature=0.9,
        presence_penalty=0.8,
        frequency_penalty=0.4,
        logit_bias={4: 3.0, 10: -100},
        seed=4,
    ),
]
PENALIZED_GREEDY = GenerationConfig(
    max_new_tokens=40, eos_token_ids=(), presence_penalty=0.5, frequency_penalty=0.7
)
MIXED = [NO_EOS, *SAMPLED, PENALIZED_GREEDY]
"""Per-request settings for a mixed batch: plain greedy, four sampled requests, greedy with penalties."""


def mixed_configs(count: int) -> list[GenerationConfig]:
    return [MIXED[i % len(MIXED)] for i in range(count)]


@pytest.fixture(scope="module")
def plain_sampled(tiny, prompts):
    return Engine(tiny).generate(prompts, mixed_configs(len(prompts)))


@pytest.mark.parametrize("error_rate", [0.0, 0.3])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_seeded_sampling_equals_plain_sampling_for_any_tree_and_batch(
    tiny, prompts, plain_sampled, error_rate, batch_size
):
    references = [p + o.tokens for p, o in zip(prompts, plain_sampled, strict=True)]
    engine = Engine(tiny, ScriptedDrafter(references, error_rate), budget=6, costs=FLAT_COSTS)
    outputs = engine.generate(prompts, mixed_configs(len(prompts)), batch_size=batch_size)
    assert [o.tokens for o in outputs] == [o.tokens for o in plain_sampled]
    if error_rate == 0.0:
        assert min(o.stats.mean_accepted for o in outputs) > 4


def reference_logprobs(tiny, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The model's log-probabilities at each output token's position, from one pass over the whole text."""
    logits = tiny.model(torch.tensor([prompt + tokens])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)], dim=-1)


@pytest.mark.parametrize("runner", ["auto", "transformers"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_logprobs_are_the_models_own_and_change_no_token(tiny, prompts, plain_sampled, batch_size, runner):
    """Every request of a mixed batch (greedy, sampled, penalized, one cut by a stop string) asks for
    log-probabilities but one: the tokens are those of plain decoding without them, and each token's
    log-probability and its position's likeliest tokens are the model's over the whole text."""
    references = [p + o.tokens for p, o in zip(prompts, plain_sampled, strict=True)]
    configs = [replace(c, logprobs=3 if i % 2 else 0) for i, c in enumerate(mixed_configs(len(prompts)))]
    configs[-1] = replace(configs[-1], logprobs=None)
    stop = " ".join(f"w{t}" for t in plain_sampled[2].tokens[5:7])
    configs[2] = replace(configs[2], stop_strings=(stop,))
    engine = Engine(tiny, ScriptedDrafter(references, 0.3), budget=6, costs=FLAT_COSTS, runner=runner)
    outputs = engine.generate(prompts, configs, batch_size=batch_size)
    assert [o.tokens for o in outputs[:2]] == [o.tokens for o in plain_sampled[:2]]
    assert [o.tokens for o in outputs[3:]] == [o.tokens for o in plain_sampled[3:]]
    assert outputs[2].finish_reason == "stop" and len(outputs[2].tokens) < len(plain_sampled[2].tokens)
    assert outputs[2].tokens == plain_sampled[2].tokens[: len(outputs[2].tokens)]
    assert outputs[-1].logprobs is None
    assert sum(o.stats.accepted for o in outputs) > 20  # drafts were accepted, so paths were read
    for prompt, config, output in zip(prompts[:-1], configs, outputs, strict=False):
        expected = reference_logprobs(tiny, prompt, output.tokens)
        assert [lp.token for lp in output.logprobs] == output.tokens
        chosen = torch.tensor([lp.logprob for lp in output.logprobs])
        torch.testing.assert_close(chosen, expected.gather(1, torch.tensor(output.tokens)[:, None])[:, 0])
        for lp, row in zip(output.logprobs, expected, strict=True):
            assert len(lp.top) == config.logprobs
            if lp.top:
                values, ids = row.topk(config.logprobs)
                assert [t for t, _ in lp.top] == ids.tolist()
                torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), values)


@pytest.mark.parametrize("runner", ["auto", "transformers"])
def test_prompt_logprobs_are_the_models_own_across_prefill_chunks(tiny, prompts, runner, monkeypatch):
    monkeypatch.setattr("reader_spec.engine.runner.PREFILL_CHUNK", 7)
    engine = Engine(tiny, ReaderDrafter(), costs=FLAT_COSTS, runner=runner, max_batch_size=2)
    config = replace(NO_EOS, max_new_tokens=5, prompt_logprobs=2)
    first, again = engine.generate([prompts[0], prompts[0]], [NO_EOS, config], batch_size=1)
    (single,) = engine.generate([[prompts[1][0]]], config)
    assert single.prompt_logprobs == [None] and first.prompt_logprobs is None
    assert again.stats.cached_tokens == 0  # the prompt was in the cache: prefilled again for its logits
    assert again.tokens == first.tokens[:5]
    logprobs = again.prompt_logprobs
    assert len(prompts[0]) > 14 and len(logprobs) == len(prompts[0]) and logprobs[0] is None
    expected = reference_logprobs(tiny, prompts[0][:1], prompts[0][1:])
    assert [lp.token for lp in logprobs[1:]] == prompts[0][1:]
    torch.testing.assert_close(
        torch.tensor([lp.logprob for lp in logprobs[1:]]),
        expected.gather(1, torch.tensor(prompts[0][1:])[:, None])[:, 0],
    )
    assert [[t for t, _ in lp.top] for lp in logprobs[1:]] == expected.topk(2).indices.tolist()


def test_logprobs_stream_with_their_tokens(tiny, prompts):
    engine = Engine(tiny, ReaderDrafter(), costs=FLAT_COSTS, max_batch_size=2)
    keys = [engine.add_request(p, replace(NO_EOS, logprobs=2)) for p in prompts[:3]]
    streamed: dict[int, list] = {key: [] for key in keys}
    outputs = {}
    while len(engine.scheduler):
        for update in engine.step():
            assert [lp.token for lp in update.new_logprobs] == update.new_tokens
            streamed[update.key] += update.new_logprobs
            if update.output is not None:
                outputs[update.key] = update.output
    assert all(streamed[key] == outputs[key].logprobs for key in keys)
    plain = engine.add_request(prompts[0], NO_EOS)
    while len(engine.scheduler):
        assert all(update.new_logprobs is None for update in engine.step() if update.key == plain)


def test_sampled_output_ignores_the_rest_of_the_batch(tiny, prompts, plain_sampled):
    """The same request, batched with different companions and settings, emits the same tokens."""
    target, config = prompts[1], SAMPLED[0]
    expected = plain_sampled[1].tokens
    engine = Engine(tiny, ReaderDrafter(), budget=6, costs=FLAT_COSTS)
    for companions in (prompts[2:5], prompts[5:9], [prompts[0]] * 3):
        batch = [*companions[:1], target, *companions[1:]]
        configs = [SAMPLED[2], config, *[NO_EOS] * (len(batch) - 2)]
        outputs = engine.generate(batch, configs, batch_size=len(batch))
        assert outputs[1].tokens == expected


def test_sampling_depends_on_the_seed_and_is_fresh_without_one(tiny, prompts):
    engine = Engine(tiny, ReaderDrafter(), costs=FLAT_COSTS)
    seeded = GenerationConfig(max_new_tokens=30, eos_token_ids=(), temperature=1.0, seed=5)
    runs = [engine.generate([prompts[0]], seeded)[0].tokens for _ in range(2)]
    other_seed = engine.generate([prompts[0]], replace(seeded, seed=6))[0].tokens
    unseeded = GenerationConfig(max_new_tokens=30, eos_token_ids=(), temperature=1.0)
    fresh = [engine.generate([prompts[0]], unseeded)[0].tokens for _ in range(2)]
    assert runs[0] == runs[1]
    assert other_seed != runs[0]
    assert fresh[0] != fresh[1]


def test_greedy_with_repetition_penalty_equals_transformers(tiny, prompts):
    config = GenerationConfig(max_new_tokens=30, eos_token_ids=(), repetition_penalty=1.3)
    outputs = Engine(tiny, ReaderDrafter(), costs=FLAT_COSTS).generate(prompts[:4], config, batch_size=2)
    for prompt, output in zip(prompts[:4], outputs, strict=True):
        reference = tiny.model.generate(
            torch.tensor([prompt]),
            max_new_tokens=30,
            do_sample=False,
            repetition_penalty=1.3,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert output.tokens == reference


def test_greedy_with_every_penalty_equals_a_reference_over_the_whole_text(tiny, prompts):
    """A logit bias, transformers' repetition penalty, then OpenAI's presence and frequency penalties
    written out from their definition over the output, on the model's logits for the whole text at
    each step."""
    bias = {4: 2.5, 10: -100}
    config = GenerationConfig(
        max_new_tokens=30,
        eos_token_ids=(),
        repetition_penalty=1.2,
        presence_penalty=0.6,
        frequency_penalty=0.9,
        logit_bias=bias,
    )
    outputs = Engine(tiny, ReaderDrafter(), costs=FLAT_COSTS).generate(prompts[:4], config, batch_size=2)
    repetition = RepetitionPenaltyLogitsProcessor(1.2)
    for prompt, output in zip(prompts[:4], outputs, strict=True):
        text = list(prompt)
        for _ in range(30):
            ids = torch.tensor([text])
            logits = tiny.model(ids).logits[:, -1].float()
            for token, value in bias.items():
                logits[0, token] += value
            scores = repetition(ids, logits)[0]
            generated = text[len(prompt) :]
            for token in set(generated):
                scores[token] -= 0.9 * generated.count(token) + 0.6
            text.append(int(scores.argmax()))
        assert output.tokens == text[len(prompt) :]
    for change in ({"presence_penalty": 0, "frequency_penalty": 0}, {"logit_bias": {4: 2.5}}):
        other = Engine(tiny).generate(prompts[:4], replace(config, **change))
        assert [o.tokens for o in outputs] != [o.tokens for o in other]


def test_per_request_configs_must_match_the_prompts(tiny, prompts):
    with pytest.raises(ValueError, match="2 generation configs for 3 prompts"):
        Engine(tiny).generate(prompts[:3], [NO_EOS, NO_EOS])


def test_all_sources_on_are_exact_and_each_is_credited(tiny, prompts, plain_outputs, tmp_path):
    """A datastore of the model's own answers drafts most tokens; greedy and sampled output stay exact."""
    answers = [p + o.tokens for p, o in zip(prompts, plain_outputs, strict=True)]
    store = Datastore.build(tmp_path / "store", answers, fingerprint=tiny.fingerprint, model=tiny.name)
    engine = Engine(tiny, ReaderDrafter(datastore=store), budget=8, costs=FLAT_COSTS)
    greedy = engine.generate(prompts, NO_EOS, batch_size=3)
    assert [o.tokens for o in greedy] == [o.tokens for o in plain_outputs]
    credited = Counter()
    for o in greedy:
        credited.update(o.stats.accepted_by_source)
    assert credited["datastore"] > sum(credited.values()) / 2  # most accepted draft tokens
    sampled = engine.generate(prompts, mixed_configs(len(prompts)), batch_size=4)
    plain = Engine(tiny).generate(prompts, mixed_configs(len(prompts)))
    assert [o.tokens for o in sampled] == [o.tokens for o in plain]


# --- requests leaving, the context limit, calibration ------------------------------------------------
def test_a_finished_request_frees_its_row_without_copying_any_cache(
    tiny, prompts, plain_outputs, monkeypatch
):
    """Retirement used to copy the last slot's whole context into the freed one."""
    from reader_spec.engine.kv_cache import RaggedKVCache

    def no_copies(*args):
        raise AssertionError("a cache row was copied")

    monkeypatch.setattr(RaggedKVCache, "copy_row", no_copies, raising=False)
    monkeypatch.setattr(RaggedKVCache, "move_slot", no_copies, raising=False)
    configs = [replace(NO_EOS, max_new_tokens=n) for n in (3, 40, 9, 25, 1, 40, 17, 5, 30)]
    outputs = Engine(tiny, ReaderDrafter(), costs=FLAT_COSTS).generate(prompts, configs, batch_size=4)
    for output, plain, config in zip(outputs, plain_outputs, configs, strict=True):
        assert output.tokens == plain.tokens[: config.max_new_tokens]


def test_the_cache_is_sized_once_for_every_prompt_of_a_generate_call(
    tiny, prompts, plain_outputs, monkeypatch
):
    """Growing the cache copies every row of every layer: a call that knows all its prompts sizes it
    before the first one starts, for the longest, and never grows it; outputs stay plain decoding's."""
    from reader_spec.engine import kv_cache

    def no_growth(*args):
        raise AssertionError("the cache grew")

    monkeypatch.setattr(kv_cache, "_padded", no_growth)
    engine = Engine(tiny, ReaderDrafter(), costs=FLAT_COSTS)
    configs = [replace(NO_EOS, max_new_tokens=n) for n in (3, 40, 9, 25, 1, 40, 17, 5, 30)]
    outputs = engine.generate(prompts, configs, batch_size=4)
    room = max(len(p) + c.max_new_tokens for p, c in zip(prompts, configs, strict=True)) + engine.budget + 2
    assert engine._runner.cache.capacity >= room
    for output, plain, config in zip(outputs, plain_outputs, configs, strict=True):
        assert output.tokens == plain.tokens[: config.max_new_tokens]


def test_a_prompt_without_room_in_the_context_is_refused_before_any_work(tiny):
    from reader_spec.prompts import PromptError

    engine = Engine(tiny, ReaderDrafter(), costs=FLAT_COSTS)
    context = tiny.model.config.max_position_embeddings
    message = f"{context + 5:,} tokens long and the model's context is {context:,}"
    with pytest.raises(PromptError, match=message):
        engine.generate([[2], [3] * (context + 5)], NO_EOS)
    assert engine._runner is None


def test_generation_stops_at_the_end_of_the_context(tiny):
    context = tiny.model.config.max_position_embeddings
    prompt = [random.Random(0).randrange(2, 90) for _ in range(context - 6)]
    (output,) = Engine(tiny).generate([prompt], NO_EOS)
    assert len(output.tokens) == 6 and output.finish_reason == "length"


def test_costs_are_measured_up_front_and_said(tiny, prompts, caplog):
    """Measuring used to happen inside the first step, charged to its draft time, without a word."""
    import time

    def slow_measure(batch, drafted, context):
        time.sleep(0.1)
        return dict.fromkeys(drafted, 1.0)

    engine = Engine(tiny, ReaderDrafter(), costs=CostModel(measure=slow_measure))
    with caplog.at_level("INFO", logger="reader_spec"):
        outputs = engine.generate(prompts[:2], NO_EOS, batch_size=2)
    assert "measuring verification costs for batch sizes up to 2" in caplog.text
    assert engine.costs.missing(2) == []
    assert all(o.stats.draft_seconds < 0.1 for o in outputs)


def test_nothing_is_measured_where_nothing_uses_costs(tiny, prompts):
    def refuse(*args):
        raise AssertionError("measured costs that no allocation reads")

    for engine in (
        Engine(tiny, ReaderDrafter(), adaptive_budget=False, costs=CostModel(measure=refuse)),
        Engine(tiny, costs=CostModel(measure=refuse)),
    ):
        engine.warm_up(4)
        engine.generate(prompts[:3], NO_EOS, batch_size=2)


# --- driving the engine request by request (what a server does) --------------------------------------
def test_requests_join_and_leave_a_running_batch_and_stay_exact(tiny, prompts, plain_outputs):
    engine = Engine(tiny, ReaderDrafter(), costs=FLAT_COSTS, max_batch_size=3)
    engine.calibrate(3)
    keys = [engine.add_request(p, NO_EOS) for p in prompts[:2]]
    streamed: dict[int, list[int]] = {}
    outputs = {}

    def run(steps):
        for _ in range(steps):
            for update in engine.step():
                streamed.setdefault(update.key, []).extend(update.new_tokens)
                if update.output is not None:
                    outputs[update.key] = update.output

    run(3)
    assert [s.key for s in engine.scheduler.running] == keys  # both decoding, a row each
    keys += [engine.add_request(p, NO_EOS, request_id=f"late {i}") for i, p in enumerate(prompts[2:6])]
    run(1)
    assert len(engine.scheduler.running) == 3 and len(engine.scheduler.waiting) == 3
    while len(engine.scheduler):
        run(1)
    for key, plain in zip(keys, plain_outputs[:6], strict=True):
        assert outputs[key].tokens == streamed[key] == plain.tokens
    assert outputs[keys[2]].id == "late 0"
    assert engine.scheduler.free_rows == [0, 1, 2]


def test_a_cancelled_request_frees_its_row_for_the_next_one(tiny, prompts, plain_outputs):
    engine = Engine(tiny, ReaderDrafter(), costs=FLAT_COSTS, max_batch_size=2)
    engine.calibrate(2)
    first, second, third = (engine.add_request(p, NO_EOS) for p in prompts[:3])
    engine.step()
    row = next(s.row for s in engine.scheduler.running if s.key == first)
    assert engine.cancel(first) and not engine.cancel(first)
    assert engine.cancel(third) is True  # still waiting: dropped from the queue
    fourth = engine.add_request(prompts[3], NO_EOS)
    engine.step()
    assert {s.key: s.row for s in engine.scheduler.running}[fourth] == row
    outputs = {}
    while len(engine.scheduler):
        outputs |= {u.key: u.output for u in engine.step() if u.output is not None}
    assert set(outputs) == {second, fourth}
    assert outputs[second].tokens == plain_outputs[1].tokens
    assert outputs[fourth].tokens == plain_outputs[3].tokens


def test_two_engines_taking_turns_piece_by_piece_stay_exact(tiny, prompts, plain_outputs):
    """What a benchmark does to time methods side by side; a piece is one request's prefill (nothing
    else moves) or one pass (every running request moves on)."""
    engines = [Engine(tiny, costs=FLAT_COSTS), Engine(tiny, ReaderDrafter(), costs=FLAT_COSTS)]
    running = [e.generate_stepwise(prompts[:5], NO_EOS, batch_size=3) for e in engines]
    results: list = [None, None]
    prefills = [0, 0]
    while None in results:
        for i, (engine, stepwise) in enumerate(zip(engines, running, strict=True)):
            if results[i] is not None:
                continue
            before = {s.key: len(s.tokens) for s in engine.scheduler.running}
            try:
                next(stepwise)
            except StopIteration as finished:
                results[i] = finished.value
                continue
            after = {s.key: len(s.tokens) for s in engine.scheduler.running}
            if after.keys() - before.keys():
                prefills[i] += 1
                assert len(after.keys() - before.keys()) == 1
                assert all(after[key] == length for key, length in before.items())
            else:
                assert all(after[key] > before[key] for key in after)
    assert prefills == [5, 5]
    for outputs in results:
        assert [o.tokens for o in outputs] == [p.tokens for p in plain_outputs[:5]]


def test_a_cache_sized_up_front_never_grows_during_the_run(tiny, prompts, plain_outputs, monkeypatch):
    engine = Engine(tiny, ReaderDrafter(), costs=FLAT_COSTS)
    engine.reserve(3, prompts[:5], NO_EOS)
    runner, capacity = engine._ensure_runner(), engine._ensure_runner().cache.capacity
    assert runner.cache.num_rows == 3 and capacity >= max(map(len, prompts[:5])) + NO_EOS.max_new_tokens
    assert runner.cache.allocated and int(runner.cache.lengths.sum()) == 0

    def refuse(self, *args):
        raise AssertionError("the cache grew during the run")

    layer = type(runner.cache.layers[0])
    monkeypatch.setattr(layer, "grow", refuse)
    monkeypatch.setattr(layer, "lazy_initialization", refuse)
    outputs = engine.generate(prompts[:5], NO_EOS, batch_size=3)
    assert engine._ensure_runner() is runner and runner.cache.capacity == capacity
    assert [o.tokens for o in outputs] == [p.tokens for p in plain_outputs[:5]]
    engine.add_request(prompts[0], NO_EOS)
    with pytest.raises(RuntimeError, match="no request is unfinished"):
        engine.reserve(3, prompts[:1], NO_EOS)


def test_generate_needs_an_idle_engine(tiny, prompts):
    engine = Engine(tiny)
    engine.add_request(prompts[0], NO_EOS)
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.generate(prompts[:1], NO_EOS)


@pytest.mark.parametrize("runner", ["fast", "transformers"])
def test_host_work_stays_on_the_cpu_whatever_torch_default_device_is(tiny, prompts, runner):
    """A user's ``torch.set_default_device("cuda")`` must not move the engine's bookkeeping (cache
    lengths, masks, positions) off the host. Under ``meta`` every tensor made without naming its
    device lands where it can neither compute nor reach numpy, as it lands on a GPU; plain decoding,
    retrieval drafts and a draft model's tree, greedy and seeded sampling, make the same output."""
    draft = replace(tiny, model=copy.deepcopy(tiny.model))
    sampled = GenerationConfig(max_new_tokens=24, eos_token_ids=(), temperature=1.0, seed=3)

    def outputs() -> list[list[int]]:
        runs = []
        for drafter in (
            None,
            ReaderDrafter(),
            FusedDrafter(ReaderDrafter(), ModelDrafter(draft, max_depth=3), "rasd"),
        ):
            engine = Engine(tiny, drafter, costs=FLAT_COSTS, max_batch_size=4, runner=runner)
            for config in (NO_EOS, sampled):
                runs += [out.tokens for out in engine.generate(prompts[:4], config, batch_size=4)]
        return runs

    expected = outputs()
    with torch.device("meta"):
        assert outputs() == expected


def test_int8_weights_serve_both_runners_and_speculation_stays_exact(tiny, prompts):
    """``pack_weights`` stores the matrices once; the fast runner and transformers' forward then both
    multiply by the int8 ones, and speculation equals plain decoding of that int8 model."""
    import copy

    from reader_spec.drafters.model import self_draft
    from reader_spec.engine.runner import pack_weights
    from reader_spec.engine.weights import PackedLinear
    from reader_spec.loading import ModelLoadError

    loaded = replace(tiny, model=copy.deepcopy(tiny.model))
    pack_weights(loaded.model, "int8")
    packed = [m for m in loaded.model.modules() if isinstance(m, PackedLinear)]
    assert packed and all(m.weight_format == "int8" for m in packed)
    float32 = Engine(tiny).generate(prompts[:6], NO_EOS, batch_size=3)
    fast = Engine(loaded, runner="fast").generate(prompts[:6], NO_EOS, batch_size=3)
    reference = Engine(loaded, runner="transformers").generate(prompts[:6], NO_EOS, batch_size=3)
    speculative = Engine(loaded, ReaderDrafter(), costs=FLAT_COSTS).generate(
        prompts[:6], NO_EOS, batch_size=3
    )
    assert [o.tokens for o in fast] == [o.tokens for o in reference] == [o.tokens for o in speculative]
    assert [o.tokens for o in fast] != [o.tokens for o in float32]  # int8 really runs
    with pytest.raises(ModelLoadError, match="int8 already"):
        self_draft(loaded)
    with pytest.raises(ValueError, match="weights must be one of"):
        pack_weights(loaded.model, "int3")


def _fresh_kernel_choices(monkeypatch, loaded):
    """A new model like ``loaded``'s that has made no kernel choice (the session's tiny model may have
    made them all in earlier tests), and every timing of one recorded."""
    from reader_spec.engine import decoder, greedy_head, kernel_choice

    monkeypatch.setattr(kernel_choice, "_CHOICES", {})
    monkeypatch.setattr(decoder, "_ATTENTION_CHOICES", {})
    timed = []
    for module, name in ((kernel_choice, "best_times"), (decoder, "best_times"), (greedy_head, "best_times")):
        original = getattr(module, name)

        def record(*args, original=original, **kwargs):
            timed.append(len(timed))
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, record)
    return replace(loaded, model=make_tiny_llama()), timed


def test_a_warm_up_leaves_no_kernel_choice_to_a_running_step(tiny, prompts, monkeypatch, on_cpu):
    """Kernel choices are timed when a pass first needs them (0.2-1 s each on the default model): a
    warm-up makes them all for the steps it was told of, so no timed step pays for one. The choices
    are the CPU's (blocked products, the greedy head, the compiled attention): the model is built there."""
    loaded, timed = _fresh_kernel_choices(monkeypatch, tiny)
    cold = Engine(loaded, ReaderDrafter(), budget=8, costs=FLAT_COSTS)
    cold.generate(prompts[:2], NO_EOS, batch_size=2)
    assert timed  # without a warm-up, steps time the choices
    loaded, timed = _fresh_kernel_choices(monkeypatch, tiny)
    engine = Engine(loaded, ReaderDrafter(), budget=8, costs=FLAT_COSTS)
    engine.warm_up(2, prompt_tokens=max(map(len, prompts)))
    timed.clear()
    engine.generate(prompts, NO_EOS, batch_size=2)
    assert not timed


def test_a_warm_up_without_the_compiled_ops_times_none_of_them(tiny, prompts, monkeypatch):
    """A decoder whose passes never run the compiled ops (a GPU's; here bfloat16 on a CPU takes the
    same path) warms up without calling one: the compiled attention is CPU code."""
    from reader_spec.engine import decoder

    def compiled_attention(*args):
        raise AssertionError("the compiled attention was timed for a decoder that never runs it")

    monkeypatch.setattr(decoder, "compiled_attention_wins", compiled_attention)
    loaded = replace(tiny, model=make_tiny_llama().to(torch.bfloat16))
    engine = Engine(loaded, ReaderDrafter(), budget=8, costs=FLAT_COSTS)
    engine.warm_up(2, prompt_tokens=ROW_BUCKETS[-1])  # as the bench warms up: past the compiled layers' rows
    engine.generate(prompts[:2], NO_EOS, batch_size=2)


def next_turns(prompts, outputs, seed: int = 5) -> list[list[int]]:
    """Each conversation continued: its prompt, its answer and a new message."""
    rng = random.Random(seed)
    return [
        [*prompt, *output.tokens, *(rng.randrange(2, 90) for _ in range(rng.randint(1, 8)))]
        for prompt, output in zip(prompts, outputs, strict=True)
    ]


@pytest.mark.parametrize("batch_size", [1, 4])
def test_a_next_turn_reuses_its_conversations_row_and_stays_exact(tiny, prompts, plain_outputs, batch_size):
    """The second turns prefill only their new message, in the rows their first turns left; outputs equal
    plain decoding's on an engine that reuses nothing, speculative or plain, alone or mixed in a batch
    with new conversations."""
    second = next_turns(prompts, plain_outputs)
    fresh = Engine(tiny, reuse_prefixes=False).generate(second, NO_EOS)
    assert all(o.stats.cached_tokens == 0 for o in fresh)
    for engine in (Engine(tiny, max_batch_size=batch_size), Engine(tiny, ReaderDrafter(), costs=FLAT_COSTS)):
        first = engine.generate(prompts[:batch_size], NO_EOS, batch_size=batch_size)
        assert [o.tokens for o in first] == [o.tokens for o in plain_outputs[:batch_size]]
        mixed = second[:batch_size] + prompts[batch_size:]  # next turns first, then new conversations
        outputs = engine.generate(mixed, NO_EOS, batch_size=batch_size)
        expected = fresh[:batch_size] + plain_outputs[batch_size:]
        assert [o.tokens for o in outputs] == [o.tokens for o in expected]
        for prompt, output in zip(prompts[:batch_size], outputs[:batch_size], strict=True):
            # Held: the prompt and the answer, but for its last token where no pass computed it (the
            # last step's root; a speculative last step may have verified past the length limit).
            held = len(prompt) + NO_EOS.max_new_tokens
            assert output.stats.cached_tokens in (held - 1, held)


@pytest.mark.parametrize("batch_size", [2, 4])
def test_requests_sharing_a_prompt_prefill_it_once_and_stay_exact(tiny, prompts, batch_size):
    """Choices of one prompt (greedy and seeded samples) and a request sharing its beginning, started
    together: the later ones copy the first one's prompt; outputs equal an engine that reuses nothing."""
    prompt = prompts[2]
    batch = [prompt] * 3 + [[*prompt[:-1], 5, 6]]
    configs = [NO_EOS, SAMPLED[0], replace(SAMPLED[0], seed=9), NO_EOS]
    expected = Engine(tiny, reuse_prefixes=False).generate(batch, configs, batch_size=batch_size)
    outputs = Engine(tiny, ReaderDrafter(), costs=FLAT_COSTS).generate(batch, configs, batch_size=batch_size)
    assert [o.tokens for o in outputs] == [o.tokens for o in expected]
    assert [o.stats.cached_tokens for o in outputs] == [0, *[len(prompt) - 1] * 3]


def test_a_new_cache_or_a_cold_start_reuses_nothing(tiny, prompts, plain_outputs):
    engine = Engine(tiny)
    engine.generate(prompts[:1], NO_EOS)
    second = next_turns(prompts[:1], plain_outputs[:1])
    engine.forget_prefixes()
    assert engine.generate(second, NO_EOS)[0].stats.cached_tokens == 0
    engine.generate(prompts[:1], NO_EOS)
    assert engine.generate(second, NO_EOS, batch_size=2)[0].stats.cached_tokens == 0  # a new cache


def test_another_question_on_the_same_prompt_copies_it_and_leaves_the_conversation_its_row(
    tiny, prompts, plain_outputs
):
    prompt = prompts[0]
    assert len(prompt) < NO_EOS.max_new_tokens  # the answer is what taking the row would discard
    fork = [*prompt, 3, 4]
    follow_up = next_turns(prompts[:1], plain_outputs[:1])[0]
    expected = Engine(tiny, reuse_prefixes=False).generate([fork, follow_up], NO_EOS)
    engine = Engine(tiny, ReaderDrafter(), costs=FLAT_COSTS, max_batch_size=2)
    engine.generate([prompt], NO_EOS, batch_size=2)
    outputs = [engine.generate([p], NO_EOS, batch_size=2)[0] for p in (fork, follow_up)]
    assert [o.tokens for o in outputs] == [o.tokens for o in expected]
    assert outputs[0].stats.cached_tokens == len(prompt)
    assert outputs[1].stats.cached_tokens >= len(prompt) + NO_EOS.max_new_tokens - 1
