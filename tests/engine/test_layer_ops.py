"""The compiled operators between a layer's products compute PyTorch's formulas, row by row."""

import pytest
import torch
import torch.nn.functional as F

from reader_spec.engine import kernels
from tests.conftest import KERNELS_MISSING


@pytest.fixture(scope="module")
def ops():
    if not kernels.available():
        pytest.fail(KERNELS_MISSING)
    return torch.ops.reader_spec


def rotate_half_reference(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("features", [32, 576, 70])  # 70: lanes left over after the vectors
def test_add_rms_norm_adds_in_place_and_normalises_like_pytorch(ops, features):
    torch.manual_seed(0)
    hidden, residual, weight = torch.randn(5, features), torch.randn(5, features), torch.randn(features)
    expected_hidden = hidden + residual
    expected = F.rms_norm(expected_hidden, (features,), weight, 1e-6)
    normed = ops.add_rms_norm(hidden, residual, weight, 1e-6)
    assert torch.equal(hidden, expected_hidden)
    assert (normed - expected).abs().max() < 1e-5
    before = hidden.clone()
    assert (
        ops.add_rms_norm(hidden, None, weight, 1e-6) - F.rms_norm(before, (features,), weight, 1e-6)
    ).abs().max() < 1e-5
    assert torch.equal(hidden, before)


@pytest.mark.parametrize("features", [64, 1536, 40])
def test_silu_mul_is_silu_of_the_gate_times_up(ops, features):
    torch.manual_seed(1)
    gate_up = torch.randn(6, 2 * features) * 8
    gate_up[0, :8] = torch.tensor([-100.0, -88.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 90.0])
    gate, up = gate_up[:, :features], gate_up[:, features:]  # views, as the fused projection splits
    expected = F.silu(gate) * up
    out = ops.silu_mul(gate, up)
    assert torch.isfinite(out).all()
    assert ((out - expected).abs() <= 1e-6 * expected.abs() + 1e-6).all()


def test_rotary_store_rotates_queries_and_keys_and_writes_only_the_tokens_cells(ops):
    torch.manual_seed(2)
    tokens, query_heads, kv_heads, dim = 4, 6, 2, 16
    qkv = torch.randn(tokens, (query_heads + 2 * kv_heads) * dim)
    query_key = qkv[:, : (query_heads + kv_heads) * dim].view(tokens, -1, dim)
    value = qkv[:, (query_heads + kv_heads) * dim :].view(tokens, -1, dim)
    cos, sin = torch.randn(tokens, dim), torch.randn(tokens, dim)
    keys, values = torch.randn(3, kv_heads, 10, dim), torch.randn(3, kv_heads, 10, dim)
    untouched_keys, untouched_values = keys.clone(), values.clone()
    rows, positions = torch.tensor([0, 0, 2, 2]), torch.tensor([4, 5, 7, 8])
    query = ops.rotary_store(query_key, value, cos, sin, keys, values, rows, positions, query_heads)
    rotated = rotate_half_reference(query_key, cos[:, None], sin[:, None])
    assert (query - rotated[:, :query_heads]).abs().max() < 1e-6
    assert (keys[rows, :, positions] - rotated[:, query_heads:]).abs().max() < 1e-6
    assert torch.equal(values[rows, :, positions], value)
    written = torch.zeros(3, 10, dtype=torch.bool)
    written[rows, positions] = True
    assert torch.equal(keys.transpose(1, 2)[~written], untouched_keys.transpose(1, 2)[~written])
    assert torch.equal(values.transpose(1, 2)[~written], untouched_values.transpose(1, 2)[~written])


@pytest.mark.parametrize("rows", [7, 300])  # 300: a prompt's chunk, its rows split between threads
def test_a_rows_result_does_not_depend_on_the_rest_of_the_pass(ops, rows):
    """What makes speculation exact on the fast runner: a token's arithmetic is the same in a pass of
    one token and in a tree of many, and in a prompt whose rows the threads share."""
    torch.manual_seed(3)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        hidden, residual, weight = torch.randn(rows, 96), torch.randn(rows, 96), torch.randn(96)
        together = ops.add_rms_norm(hidden.clone(), residual, weight, 1e-5)
        gate_up = torch.randn(rows, 128)
        gated = ops.silu_mul(gate_up[:, :64], gate_up[:, 64:])
        query_key, value = torch.randn(rows, 5, 16), torch.randn(rows, 1, 16)
        cos, sin = torch.randn(rows, 16), torch.randn(rows, 16)
        keys, values = torch.zeros(2, 1, rows, 16), torch.zeros(2, 1, rows, 16)
        positions = torch.arange(rows)
        queries = ops.rotary_store(
            query_key, value, cos, sin, keys, values, torch.zeros(rows, dtype=torch.long), positions, 4
        )
        for row in range(rows):
            alone = ops.add_rms_norm(hidden[row : row + 1].clone(), residual[row : row + 1], weight, 1e-5)
            assert torch.equal(alone[0], together[row])
            assert torch.equal(
                ops.silu_mul(gate_up[row : row + 1, :64], gate_up[row : row + 1, 64:])[0], gated[row]
            )
            one = ops.rotary_store(
                query_key[row : row + 1],
                value[row : row + 1],
                cos[row : row + 1],
                sin[row : row + 1],
                keys,
                values,
                torch.ones(1, dtype=torch.long),
                positions[row : row + 1],
                4,
            )
            assert torch.equal(one[0], queries[row])
        assert torch.equal(keys[1], keys[0]) and torch.equal(values[1], values[0])
    finally:
        torch.set_num_threads(threads)


def test_bad_operands_are_refused_with_a_reason(ops):
    with pytest.raises(RuntimeError, match="float32"):
        ops.add_rms_norm(torch.randn(2, 8, dtype=torch.float64), None, torch.randn(8), 1e-6)
    with pytest.raises(RuntimeError, match="features"):
        ops.add_rms_norm(torch.randn(2, 8), None, torch.randn(9), 1e-6)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rotary_store(
            torch.randn(1, 3, 8),
            torch.randn(1, 1, 8),
            torch.randn(1, 8),
            torch.randn(1, 8),
            torch.zeros(1, 1, 4, 8),
            torch.zeros(1, 1, 4, 8),
            torch.tensor([0]),
            torch.tensor([4]),
            2,
        )


def reference_attention(query, keys, values, visible, token_tree, token_offset, token_row, scaling, softcap):
    """Softmax attention of each query head over the keys its token sees, in float64."""
    tokens, heads, dim = query.shape
    group = heads // keys.shape[1]
    out = torch.zeros(tokens, heads, dim, dtype=torch.float64)
    for t in range(tokens):
        sees = visible[token_tree[t], token_offset[t]]
        kv_length = sees.shape[0]
        for h in range(heads):
            k = keys[token_row[t], h // group, :kv_length].double()
            v = values[token_row[t], h // group, :kv_length].double()
            scores = k @ query[t, h].double() * scaling
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            weights = torch.softmax(scores.masked_fill(~sees, float("-inf")), 0)
            out[t, h] = weights @ v
    return out


def random_pass(widths, rows, heads, kv_heads, dim, capacity=40, seed=0):
    """A pass of trees (``widths[i]`` tokens of tree i, in cache row ``rows[i]``) with random contexts
    and random visibility (every token sees at least its first context key)."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(max(rows) + 1, kv_heads, capacity, dim, generator=generator)
    values = torch.randn(max(rows) + 1, kv_heads, capacity, dim, generator=generator)
    kv_length = capacity - 4
    visible = torch.rand(len(widths), max(widths), kv_length, generator=generator) < 0.6
    visible[..., 0] = True
    token_tree = torch.arange(len(widths)).repeat_interleave(torch.tensor(widths))
    token_offset = torch.cat([torch.arange(w) for w in widths])
    token_row = torch.tensor(rows).repeat_interleave(torch.tensor(widths))
    query = torch.randn(sum(widths), heads, dim, generator=generator)
    return query, keys, values, visible, token_tree, token_offset, token_row


@pytest.mark.parametrize(
    "heads, kv_heads, dim",
    [(4, 2, 64), (6, 2, 128), (3, 1, 80), (4, 4, 8)],  # 80 and 8: lanes left over after the vectors
)
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_attention_is_softmax_over_the_keys_each_token_sees(ops, heads, kv_heads, dim, softcap):
    operands = random_pass([1, 7, 3, 12], [0, 2, 3, 5], heads, kv_heads, dim)
    scaling = dim**-0.5
    out = ops.attention(*operands, scaling, softcap)
    expected = reference_attention(*operands, scaling, softcap)
    assert (out.double() - expected).abs().max() < 1e-5


def test_a_tree_token_attends_bitwise_as_in_plain_decoding(ops):
    """A tree's node sees its context and its ancestors at scattered cache positions; plain decoding
    sees the same keys side by side. The attention output must be the same bits, whatever else the
    pass holds (several trees, a node among siblings, runs of tokens split across threads)."""
    torch.manual_seed(4)
    heads, kv_heads, dim, context = 6, 2, 64, 37
    #           0   1  2  3  4  5  6  7  8: tree nodes; the path 0 -> 2 -> 5 -> 8
    parents = [-1, 0, 0, 1, 2, 2, 3, 4, 5]
    path = [0, 2, 5, 8]
    nodes = len(parents)
    capacity = context + nodes + 3
    keys = torch.randn(2, kv_heads, capacity, dim)
    values = torch.randn(2, kv_heads, capacity, dim)
    query = torch.randn(nodes, heads, dim)
    sees = torch.zeros(nodes, context + nodes, dtype=torch.bool)
    sees[:, :context] = True
    for node, parent in enumerate(parents):
        sees[node, context + node] = True
        while parent >= 0:
            sees[node, context + parent] = True
            parent = parents[parent]
    # Row 1 holds the context and the path side by side, as plain decoding writes it.
    keys[1, :, :context], values[1, :, :context] = keys[0, :, :context], values[0, :, :context]
    for depth, node in enumerate(path):
        keys[1, :, context + depth] = keys[0, :, context + node]
        values[1, :, context + depth] = values[0, :, context + node]
    tree = ops.attention(
        query,
        keys,
        values,
        sees[None],
        torch.zeros(nodes, dtype=torch.long),
        torch.arange(nodes),
        torch.zeros(nodes, dtype=torch.long),
        0.125,
        0.0,
    )
    for depth, node in enumerate(path):
        plain_sees = torch.zeros(1, 1, context + depth + 1, dtype=torch.bool)
        plain_sees[..., :] = True
        plain = ops.attention(
            query[node : node + 1].contiguous(),
            keys,
            values,
            plain_sees,
            torch.zeros(1, dtype=torch.long),
            torch.zeros(1, dtype=torch.long),
            torch.ones(1, dtype=torch.long),
            0.125,
            0.0,
        )
        assert torch.equal(plain[0], tree[node])


def test_a_prompts_tokens_attend_bitwise_as_one_at_a_time(ops):
    """A causal prompt's runs of tokens are shared between threads in an order that balances their
    keys; each token's output must be the bits it gets when it is the only token of a pass."""
    torch.manual_seed(5)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        tokens, heads, kv_heads, dim = 150, 9, 3, 64
        keys, values = torch.randn(2, 1, kv_heads, tokens, dim)
        query = torch.randn(tokens, heads, dim)
        causal = torch.ones(1, tokens, tokens, dtype=torch.bool).tril_()
        zeros = torch.zeros(tokens, dtype=torch.long)
        prompt = ops.attention(query, keys, values, causal, zeros, torch.arange(tokens), zeros, 0.125, 0.0)
        for t in range(tokens):
            alone = ops.attention(
                query[t : t + 1].contiguous(),
                keys,
                values,
                torch.ones(1, 1, t + 1, dtype=torch.bool),
                zeros[:1],
                zeros[:1],
                zeros[:1],
                0.125,
                0.0,
            )
            assert torch.equal(alone[0], prompt[t])
    finally:
        torch.set_num_threads(threads)


def test_attention_refuses_tokens_outside_its_operands(ops):
    query, keys, values, visible, token_tree, token_offset, token_row = random_pass([2], [0], 4, 2, 16)
    with pytest.raises(RuntimeError, match="outside"):
        ops.attention(query, keys, values, visible, token_tree, token_offset + 5, token_row, 0.25, 0.0)
    with pytest.raises(RuntimeError, match="booleans"):
        ops.attention(query, keys, values, visible.float(), token_tree, token_offset, token_row, 0.25, 0.0)
    with pytest.raises(RuntimeError, match="multiple"):
        ops.attention(
            query[:, :3].contiguous(), keys, values, visible, token_tree, token_offset, token_row, 0.25, 0.0
        )
    # A tree's tokens come together, in one cache row: a run of them attends to its first token's row.
    query, keys, values, visible, token_tree, token_offset, token_row = random_pass([2, 2], [0, 1], 4, 2, 16)
    order = torch.tensor([0, 2, 1, 3])  # trees 0, 1, 0, 1
    tokens = (token_tree[order], token_offset[order], token_row[order])
    with pytest.raises(RuntimeError, match="tree 0 are not consecutive"):
        ops.attention(query[order], keys, values, visible, *tokens, 0.25, 0.0)
    split = torch.tensor([0, 0, 1, 0])
    with pytest.raises(RuntimeError, match="tree 1 lie in more than one cache row"):
        ops.attention(query, keys, values, visible, token_tree, token_offset, split, 0.25, 0.0)


def test_the_attention_choice_is_timed_on_the_cpu_whatever_the_default_device(ops, monkeypatch):
    """The compiled attention is CPU code: the timing that chooses it makes its inputs on the CPU even
    where torch's default device is another (a GPU's in ``READER_TEST_DEVICE=cuda`` runs; ``meta``
    here, on which the compiled op cannot run either)."""
    from reader_spec.engine import decoder

    monkeypatch.setattr(decoder, "_ATTENTION_CHOICES", {})
    with torch.device("meta"):
        assert decoder.compiled_attention_wins(4, 2, 8, 16) in (True, False)
