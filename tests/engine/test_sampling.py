"""Processed distributions match transformers' processors; the noise is a fixed function of its key."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from reader_spec.config import GenerationConfig
from reader_spec.engine.sampling import Occurrences, gumbel_noise, pick, support

SETTINGS = [
    GenerationConfig(temperature=1.0),
    GenerationConfig(temperature=0.7, top_p=0.9),
    GenerationConfig(temperature=1.3, top_k=5),
    GenerationConfig(temperature=0.8, min_p=0.1),
    GenerationConfig(temperature=1.0, top_k=40, top_p=0.5, min_p=0.02, repetition_penalty=1.3),
    GenerationConfig(temperature=0.5, top_p=0.999),
    GenerationConfig(
        temperature=0.9, top_k=40, repetition_penalty=1.1, presence_penalty=1.0, frequency_penalty=0.6
    ),
    GenerationConfig(temperature=1.0, presence_penalty=-0.5, frequency_penalty=2.0),
    GenerationConfig(temperature=0.8, top_k=10, repetition_penalty=1.2, logit_bias={3: 4.0, 7: -100, 9: 0.5}),
]
PROMPT_LENGTH = 4
"""The prompt part of a test context: the presence and frequency penalties count the rest."""


def reference_log_probs(
    logits: torch.Tensor, config: GenerationConfig, context: list[int], prompt_length: int = 0
) -> torch.Tensor:
    """transformers' own processors, in generate's order, as an independent reference; OpenAI's
    presence and frequency penalties (which transformers lacks) right after the repetition penalty,
    written out from their definition over the output, ``context[prompt_length:]``."""
    processors = []
    if config.logit_bias:
        processors.append(SequenceBiasLogitsProcessor({(t,): b for t, b in config.logit_bias}))
    if config.repetition_penalty != 1:
        processors.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    processors.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k:
        processors.append(TopKLogitsWarper(config.top_k))
    if config.top_p < 1:
        processors.append(TopPLogitsWarper(config.top_p))
    if config.min_p:
        processors.append(MinPLogitsWarper(config.min_p))
    ids = torch.tensor([context], device=logits.device)
    scores = logits[None].clone()
    if config.logit_bias:
        scores = processors.pop(0)(ids, scores)
    if config.repetition_penalty != 1:
        scores = processors.pop(0)(ids, scores)
    for token in set(context[prompt_length:]):
        count = context[prompt_length:].count(token)
        scores[0, token] -= config.frequency_penalty * count + config.presence_penalty
    for processor in processors:
        scores = processor(ids, scores)
    return torch.log_softmax(scores[0], dim=-1)


def support_log_probs(logits, config, context, vocab) -> torch.Tensor:
    in_text = torch.zeros(vocab, dtype=torch.bool, device=logits.device)  # as the sampling rule builds them
    in_text[context] = True
    in_output = torch.zeros(vocab, device=logits.device)
    output = torch.tensor(context[PROMPT_LENGTH:], device=logits.device)
    in_output.index_add_(0, output, torch.ones(len(output), device=logits.device))
    tokens, scores = support(logits, config, Occurrences(in_text, in_output))
    out = torch.full((vocab,), -math.inf, device=logits.device)
    out[tokens] = torch.log_softmax(scores, dim=0)
    return out


@pytest.mark.parametrize("config", SETTINGS, ids=repr)
@pytest.mark.parametrize("vocab", [50, 3000])
def test_support_equals_transformers_processors(config, vocab):
    generator = torch.Generator().manual_seed(vocab)
    for trial in range(20):
        logits = torch.randn(vocab, generator=generator, device="cpu") * (1 + trial % 4)
        context = torch.randint(0, vocab, (12,), generator=generator, device="cpu").tolist()
        ours = support_log_probs(logits, config, context, vocab)
        theirs = reference_log_probs(logits, config, context, PROMPT_LENGTH)
        assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
        finite = torch.isfinite(theirs)
        torch.testing.assert_close(ours[finite], theirs[finite], atol=1e-5, rtol=1e-5)


def test_nucleus_widens_past_the_first_candidates():
    """A flat distribution needs far more than the first 64 candidates to reach top_p."""
    logits = torch.zeros(1000)
    logits[:3] = 0.5
    tokens, _ = support(logits, GenerationConfig(temperature=1.0, top_p=0.9))
    assert 850 < len(tokens) < 950


def test_noise_is_a_function_of_seed_position_and_token_only():
    tokens = np.arange(100)
    full = gumbel_noise(7, 12, tokens)
    assert np.array_equal(gumbel_noise(7, 12, tokens[[5, 50, 99]]), full[[5, 50, 99]])
    assert np.array_equal(gumbel_noise(7, 12, tokens), full)
    assert not np.array_equal(gumbel_noise(7, 13, tokens), full)
    assert not np.array_equal(gumbel_noise(8, 12, tokens), full)


def test_noise_is_standard_gumbel():
    samples = np.concatenate([gumbel_noise(3, position, np.arange(1000)) for position in range(50)])
    euler_gamma = 0.5772156649
    assert abs(samples.mean() - euler_gamma) < 0.02
    assert abs(samples.var() - math.pi**2 / 6) < 0.05
    # The CDF of a standard Gumbel at 0 is exp(-1).
    assert abs((samples < 0).mean() - math.exp(-1)) < 0.01


def test_greedy_pick_is_the_argmax_after_the_penalties():
    logits = torch.tensor([0.0, 2.0, 1.9, -1.0])
    seen = torch.tensor([False, True, False, False])
    plain = GenerationConfig()
    penalized = GenerationConfig(repetition_penalty=1.2)
    assert pick(logits, plain, seed=0, position=0, occurrences=Occurrences(in_text=seen)) == 1
    assert pick(logits, penalized, seed=0, position=0, occurrences=Occurrences(in_text=seen)) == 2
    # Token 1 twice and token 2 once in the output: presence counts tokens, frequency each occurrence.
    in_output = Occurrences(in_output=torch.tensor([0.0, 2.0, 1.0, 0.0]))
    assert pick(logits, GenerationConfig(presence_penalty=0.2), 0, 0, in_output) == 1  # 1.8 against 1.7
    assert pick(logits, GenerationConfig(frequency_penalty=0.2), 0, 0, in_output) == 2  # 1.6 against 1.7
    assert pick(logits, GenerationConfig(frequency_penalty=-0.2), 0, 0, in_output) == 1  # 2.4 against 2.1


def test_pick_is_reproducible_and_varies_with_position():
    logits = torch.zeros(500)
    config = GenerationConfig(temperature=1.0)
    draws = [pick(logits, config, seed=11, position=p) for p in range(20)]
    assert draws == [pick(logits, config, seed=11, position=p) for p in range(20)]
    assert len(set(draws)) > 10


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("presence_penalty", float("nan")),
        ("frequency_penalty", -2.1),
        ("seed", -1),
        ("seed", 1.5),
        ("logit_bias", {5: 101}),
        ("logit_bias", {"w5": 1}),
        ("logit_bias", {-1: 1}),
        ("logit_bias", {5: float("nan")}),
        ("logit_bias", 5),
        ("logprobs", -1),
        ("logprobs", True),
        ("logprobs", 2.0),
    ],
)
def test_invalid_settings_are_rejected_with_the_setting_named(field, value):
    with pytest.raises(ValueError, match=field):
        GenerationConfig(**{field: value})
