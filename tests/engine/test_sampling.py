"""Processed distributions match transformers' processors; the noise is a fixed function of its key."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from reader_spec.config import GenerationConfig
from reader_spec.engine.sampling import gumbel_noise, pick, support

SETTINGS = [
    GenerationConfig(temperature=1.0),
    GenerationConfig(temperature=0.7, top_p=0.9),
    GenerationConfig(temperature=1.3, top_k=5),
    GenerationConfig(temperature=0.8, min_p=0.1),
    GenerationConfig(temperature=1.0, top_k=40, top_p=0.5, min_p=0.02, repetition_penalty=1.3),
    GenerationConfig(temperature=0.5, top_p=0.999),
]


def reference_log_probs(logits: torch.Tensor, config: GenerationConfig, context: list[int]) -> torch.Tensor:
    """transformers' own processors, in generate's order, as an independent reference."""
    processors = []
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
    for processor in processors:
        scores = processor(ids, scores)
    return torch.log_softmax(scores[0], dim=-1)


def support_log_probs(logits, config, context, vocab) -> torch.Tensor:
    seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)  # as the sampling rule builds it
    seen[context] = True
    tokens, scores = support(logits, config, seen)
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
        theirs = reference_log_probs(logits, config, context)
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


def test_greedy_pick_is_the_argmax_after_the_penalty():
    logits = torch.tensor([0.0, 2.0, 1.9, -1.0])
    seen = torch.tensor([False, True, False, False])
    plain = GenerationConfig()
    penalized = GenerationConfig(repetition_penalty=1.2)
    assert pick(logits, plain, seed=0, position=0, seen=seen) == 1
    assert pick(logits, penalized, seed=0, position=0, seen=seen) == 2


def test_pick_is_reproducible_and_varies_with_position():
    logits = torch.zeros(500)
    config = GenerationConfig(temperature=1.0)
    draws = [pick(logits, config, seed=11, position=p, seen=None) for p in range(20)]
    assert draws == [pick(logits, config, seed=11, position=p, seen=None) for p in range(20)]
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
        ("seed", -1),
        ("seed", 1.5),
    ],
)
def test_invalid_settings_are_rejected_with_the_setting_named(field, value):
    with pytest.raises(ValueError, match=field):
        GenerationConfig(**{field: value})
