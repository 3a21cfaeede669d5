"""Packed attention equals each cache row's alone; grouped-query attention equals transformers' ``sdpa``."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import reader_spec.engine.attention as attention
from reader_spec.engine.attention import (
    MOST_CALL_COST,
    PACKED_EAGER,
    PACKED_SDPA,
    HeadShape,
    attention_call_cost,
    grouped_sdpa_attention,
    pack,
    packed,
)
from reader_spec.engine.runner import ModelRunner
from reader_spec.engine.tree import DraftTree
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


@pytest.mark.parametrize("queries", [2, 5, 16])
def test_equals_sdpa(queries, on_cpu):
    """Masked multi-token queries on a CPU: the queries it takes over (others go to transformers')."""
    query, key, value, mask = inputs(queries)
    ours, _ = grouped_sdpa_attention(Module(), query, key, value, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(Module(), query, key, value, mask, scaling=0.3)
    assert ours.shape == theirs.shape == (2, queries, 6, 8)
    assert (ours - theirs).abs().max() < 1e-6


def test_takes_over_only_masked_multi_token_queries(monkeypatch, on_cpu):
    """A CPU fix: on other devices transformers' ``sdpa`` runs as it is."""
    calls = []
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **k: calls.append(1) or (None, None))
    query, key, value, mask = inputs(4)
    grouped_sdpa_attention(Module(), query, key, value, mask)
    assert calls == []
    grouped_sdpa_attention(Module(), query[:, :, :1], key, value, mask[:, :, :1])  # one token
    grouped_sdpa_attention(Module(), query, key, value, None)  # causal, no mask
    grouped_sdpa_attention(Module(), query, key, value, mask, softcap=30.0)
    assert len(calls) == 3
    grouped_sdpa_attention(Module(), *(t.to("meta") for t in (query, key, value, mask)))  # not a CPU
    assert len(calls) == 4


def shape(layout):
    return [(g.first, g.count, g.width, g.kv_length, g.tokens, g.padding is not None) for g in layout.groups]


SMOLLM2 = HeadShape(heads=9, kv_heads=3, head_dim=64)
"""The default model's heads."""

CPU_CALL_COST = 1024
"""A call's cost in pairs on a CPU, as the examples below assume (measured: a few hundred)."""


def pack_rows(widths, lengths, call_cost=CPU_CALL_COST):
    """Trees in consecutive cache rows from row 0."""
    return pack(widths, lengths, list(range(len(widths))), call_cost)


def test_pack_groups_rows_by_cost():
    widths, lengths = [1, 1, 4, 4, 1, 2], [10, 30, 5, 7, 2, 9]
    # Free calls: every row alone, attending to exactly its own keys.
    assert shape(pack_rows(widths, lengths, call_cost=0)) == [
        (row, 1, w, n + w, w, False) for row, (w, n) in enumerate(zip(widths, lengths, strict=True))
    ]
    # Dear calls: everything in one padded group.
    assert shape(pack_rows(widths, lengths, call_cost=10**9)) == [(0, 6, 4, 34, 13, True)]
    # Equal rows stay together whatever a call costs.
    assert shape(pack_rows([2] * 5, [40] * 5, call_cost=0)) == [(0, 5, 2, 42, 10, False)]
    # One deep tree among lone roots is not worth padding 31 rows to 17 tokens of 600-token contexts,
    # nor one long prompt worth 31 short ones attending over 2,000 masked keys.
    assert shape(pack_rows([1] * 31 + [17], [600] * 32)) == [
        (0, 31, 1, 601, 31, False),
        (31, 1, 17, 617, 17, False),
    ]
    assert shape(pack_rows([1] * 32, [300] * 15 + [2000] + [300] * 16)) == [
        (0, 15, 1, 301, 15, False),
        (15, 1, 1, 2001, 1, False),
        (16, 16, 1, 301, 16, False),
    ]
    # A lone extra token is: padding 2 query rows costs less than two more calls.
    assert shape(pack_rows([1, 2, 1], [600] * 3)) == [(0, 3, 2, 602, 4, True)]


def test_padding_indices_are_made_on_the_passs_device():
    """Once per pass: indices left on the host would be copied to a GPU in every layer."""
    layout = pack([1, 3, 2], [5, 5, 5], [0, 1, 2], MOST_CALL_COST, torch.device("meta"))
    (group,) = layout.groups
    assert [index.device.type for index in group.padding] == ["meta", "meta"]


def test_groups_never_span_a_free_cache_row():
    layout = pack([1, 1, 1, 1, 1], [10] * 5, [0, 1, 3, 4, 5], call_cost=10**9)
    assert [(g.first, g.first_row, g.count) for g in layout.groups] == [(0, 0, 2), (2, 3, 3)]
    # Rows counted from the pass's first row: the span of rows 4..7 starts at row 4.
    layout = pack([2, 1], [10, 10], [4, 7], CPU_CALL_COST)
    assert [(g.first, g.first_row, g.count) for g in layout.groups] == [(0, 0, 1), (1, 3, 1)]


def test_a_call_costs_some_hundreds_of_pairs_on_a_cpu(on_cpu, monkeypatch):
    """Both sides of the ratio are resolved, the inputs draw no random numbers, and the figure is
    measured once per shape and device."""
    monkeypatch.setattr(attention, "_CALL_COSTS", {})
    state = torch.random.get_rng_state()
    cost = attention_call_cost(SMOLLM2, torch.float32, torch.device("cpu"), lambda: None)
    assert 10 < cost < 100_000
    assert torch.equal(torch.random.get_rng_state(), state)
    monkeypatch.setattr(attention, "_time_call_cost", lambda *args: pytest.fail("timed twice"))
    assert attention_call_cost(SMOLLM2, torch.float32, torch.device("cpu"), lambda: None) == cost


def test_where_pairs_are_free_a_batch_attends_in_one_call(monkeypatch):
    """A GPU: seven more calls cost time, a context 16 times longer none. A batch of mixed trees and
    contexts then packs into one group."""
    monkeypatch.setattr(attention, "_CALL_COSTS", {})
    monkeypatch.setattr(attention, "best_times", lambda calls, rounds: [1e-4, 8e-4, 1e-4])
    cost = attention_call_cost(SMOLLM2, torch.float32, torch.device("cpu"), lambda: None)
    assert cost == MOST_CALL_COST
    widths, lengths = [1] * 20 + [16] * 12, [100 + 61 * i for i in range(32)]
    assert shape(pack_rows(widths, lengths, cost)) == [(0, 32, 16, 100 + 61 * 31 + 16, 212, True)]
    monkeypatch.setattr(attention, "_CALL_COSTS", {})
    monkeypatch.setattr(attention, "best_times", lambda calls, rounds: [1e-4, 8e-4, 1e-4 + 8 * 960 * 1e-6])
    assert attention_call_cost(SMOLLM2, torch.float32, torch.device("cpu"), lambda: None) == 100


@pytest.mark.parametrize("call_cost", [0, 10**9, 30])
def test_packed_equals_each_row_alone(call_cost):
    torch.manual_seed(3)
    widths, lengths = [1, 1, 5, 2, 2, 1], [7, 19, 3, 12, 0, 15]
    kv_length = max(n + w for n, w in zip(lengths, widths, strict=True))
    query = torch.randn(1, 6, sum(widths), 8)
    key, value = torch.randn(len(widths), 2, kv_length, 8), torch.randn(len(widths), 2, kv_length, 8)
    allowed = torch.rand(len(widths), 1, max(widths), kv_length) > 0.3
    allowed[..., 0] = True
    for row, (width, length) in enumerate(zip(widths, lengths, strict=True)):
        allowed[row, :, :, length + width :] = False  # as the runner's masks: nothing past its own tokens
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    layout = pack_rows(widths, lengths, call_cost)
    ours, _ = packed(grouped_sdpa_attention)(
        Module(), query, key, value, mask, packed_layout=layout, scaling=0.3
    )
    assert layout.calls == 1
    start = 0
    for row, (width, length) in enumerate(zip(widths, lengths, strict=True)):
        keys = slice(0, length + width)
        alone, _ = sdpa_attention_forward(
            Module(),
            query[:, :, start : start + width],
            key[row : row + 1, :, keys],
            value[row : row + 1, :, keys],
            mask[row : row + 1, :, :width, keys],
            scaling=0.3,
        )
        assert (ours[:, start : start + width] - alone).abs().max() < 1e-6
        start += width


def test_the_runner_switches_any_model_it_runs_to_packed_passes(caplog):
    """However the model was loaded: packed attention is the runner's job, not the loader's."""
    model = make_tiny_llama()
    assert model.config._attn_implementation == "sdpa"
    assert ModelRunner(model, num_rows=2, capacity=16, runner="transformers").packed
    assert model.config._attn_implementation == PACKED_SDPA
    model.set_attn_implementation("eager")
    assert ModelRunner(model, num_rows=2, capacity=16, runner="transformers").packed
    assert model.config._attn_implementation == PACKED_EAGER
    model.set_attn_implementation("flex_attention")
    with caplog.at_level("WARNING", logger="reader_spec"):
        runner = ModelRunner(model, num_rows=2, capacity=16, runner="transformers")
    assert not runner.packed and model.config._attn_implementation == "flex_attention"  # left alone
    assert "'flex_attention' attention, which cannot verify several sequences in one pass" in caplog.text


def test_a_model_that_ignores_the_layout_is_refused():
    model = make_tiny_llama()
    runner = ModelRunner(model, num_rows=2, capacity=16, runner="transformers")
    model.set_attn_implementation("sdpa")  # plain sdpa cannot honour a packed layout
    assert runner.packed  # as the runner still believes
    for row in range(2):
        runner.prefill(row, [1, 2, 3])
    with pytest.raises(RuntimeError, match="batch size 1"):
        runner.verify([DraftTree([4, 5], [-1, 0]), DraftTree([6], [-1])], [0, 1])
