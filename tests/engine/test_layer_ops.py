"""The compiled operators between a layer's products compute PyTorch's formulas, row by row."""

import pytest
import torch
import torch.nn.functional as F

from reader_spec.engine import kernels


@pytest.fixture(scope="module")
def ops():
    if not kernels.available():
        pytest.fail("the compiled kernels must build on this machine (make builds them)")
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


def test_a_rows_result_does_not_depend_on_the_rest_of_the_pass(ops):
    """What makes speculation exact on the fast runner: a token's arithmetic is the same in a pass of
    one token and in a tree of many."""
    torch.manual_seed(3)
    hidden, residual, weight = torch.randn(7, 96), torch.randn(7, 96), torch.randn(96)
    together = ops.add_rms_norm(hidden.clone(), residual, weight, 1e-5)
    gate_up = torch.randn(7, 128)
    gated = ops.silu_mul(gate_up[:, :64], gate_up[:, 64:])
    for row in range(7):
        alone = ops.add_rms_norm(hidden[row : row + 1].clone(), residual[row : row + 1], weight, 1e-5)
        assert torch.equal(alone[0], together[row])
        assert torch.equal(
            ops.silu_mul(gate_up[row : row + 1, :64], gate_up[row : row + 1, 64:])[0], gated[row]
        )


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
