"""The grouped-query attention equals transformers' ``sdpa`` on the inputs it takes over."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import reader_spec.attention as attention
from reader_spec.attention import GROUPED_SDPA, grouped_sdpa_attention, use_grouped_attention
from tests.conftest import make_tiny_llama


class Module(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


def inputs(queries: int, seed: int = 0):
    torch.manual_seed(seed)
    query = torch.randn(2, 6, queries, 8)
    key, value = torch.randn(2, 2, 20, 8), torch.randn(2, 2, 20, 8)
    allowed = torch.rand(2, 1, queries, 20) > 0.3
    allowed[..., 0] = True
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    return query, key, value, mask


@pytest.mark.parametrize("queries", [1, 2, 5, 16])
def test_equals_sdpa(queries):
    query, key, value, mask = inputs(queries)
    ours, _ = grouped_sdpa_attention(Module(), query, key, value, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(Module(), query, key, value, mask, scaling=0.3)
    assert ours.shape == theirs.shape == (2, queries, 6, 8)
    assert (ours - theirs).abs().max() < 1e-6


def test_takes_over_only_masked_multi_token_queries(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **k: calls.append(1) or (None, None))
    query, key, value, mask = inputs(4)
    grouped_sdpa_attention(Module(), query, key, value, mask)
    assert calls == []
    grouped_sdpa_attention(Module(), query[:, :, :1], key, value, mask[:, :, :1])  # one token
    grouped_sdpa_attention(Module(), query, key, value, None)  # causal, no mask
    grouped_sdpa_attention(Module(), query, key, value, mask, softcap=30.0)
    assert len(calls) == 3


def test_models_switch_to_it():
    model = make_tiny_llama()
    assert model.config._attn_implementation == GROUPED_SDPA
    model.set_attn_implementation("eager")
    use_grouped_attention(model)
    assert model.config._attn_implementation == "eager"  # only sdpa is replaced
