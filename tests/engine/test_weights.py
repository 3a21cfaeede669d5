"""Packed weights multiply like ``nn.Linear``, whichever kernel runs, and keep no second copy."""

import pytest
import torch
from torch import nn

import reader_spec.engine.weights as weights
from reader_spec.engine import kernels
from reader_spec.engine.weights import PackedLinear, pack_linears

TOL = 1e-5


def linear(out_features: int, in_features: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias).requires_grad_(False)


@pytest.fixture(params=["compiled", "batched matmul"])
def kernel(request, monkeypatch):
    """Force one kernel for every row count (the engine picks per shape and row count by timing)."""
    if request.param == "compiled" and not kernels.available():
        pytest.fail("the compiled kernels must build on this machine (make builds them)")
    monkeypatch.setattr(weights, "_compiled_wins", lambda weight, rows: request.param == "compiled")
    return request.param


@pytest.mark.parametrize("rows", [0, 1, 3, 8, 17, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_matrix_multiplies_like_nn_linear(kernel, rows, bias):
    module = linear(100, 70, bias, seed=rows)  # 100 outputs: the last block of 32 is partial
    reference = module.weight.clone(), None if module.bias is None else module.bias.clone()
    packed, _ = pack_linears([module])
    x = torch.randn(2, rows, 70)
    expected = nn.functional.linear(x, *reference)
    assert packed.blocked and packed(x).shape == (2, rows, 100)
    assert torch.allclose(packed(x), expected, rtol=0, atol=TOL)


def test_fused_matrices_split_into_their_parts_and_views_stay_usable(kernel):
    parts = [linear(n, 48, bias=n == 16, seed=n) for n in (64, 16, 16)]  # q, k (with bias), v
    references = [(p.weight.clone(), None if p.bias is None else p.bias.clone()) for p in parts]
    fused, views = pack_linears(parts)
    x = torch.randn(5, 48)
    expected = [nn.functional.linear(x, *ref) for ref in references]
    for got, want, view in zip(fused.split(fused(x)), expected, views, strict=True):
        assert (got - want).abs().max() < TOL
        assert (view(x) - want).abs().max() < TOL
    assert all(not hasattr(p, "weight") for p in parts)  # originals freed
    stored = fused.weight.numel()
    assert stored == (64 + 32 + 32) * 48  # each part padded to whole blocks of 32 rows, nothing more
    assert all(
        v.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr() for v in views
    )


def test_a_packed_module_saves_and_looks_up_the_plain_matrix():
    module = linear(96, 40, bias=True, seed=3)
    weight, bias = module.weight.clone(), module.bias.clone()
    packed, _ = pack_linears([module])
    state = packed.state_dict()
    assert torch.equal(state["weight"], weight) and torch.equal(state["bias"], bias)
    tokens = torch.tensor([0, 31, 32, 95, 7])
    assert torch.equal(packed.rows_of(tokens), weight[tokens])


def test_other_dtypes_keep_the_plain_layout():
    module = linear(64, 32, bias=False, seed=4).to(torch.bfloat16)
    weight = module.weight.clone()
    packed, _ = pack_linears([module])
    assert not packed.blocked and torch.equal(packed.weight, weight)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    assert torch.equal(packed(x), nn.functional.linear(x, weight))


def test_packed_linear_is_what_the_model_holds_after_packing():
    """Every projection of a packed model is a PackedLinear."""
    from reader_spec.engine.decoder import FastDecoder
    from tests.conftest import make_tiny_llama

    model = make_tiny_llama()
    FastDecoder(model)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert not linears and len(packed) == 1 + 7 * model.config.num_hidden_layers


def _resident_file_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssFile"))


@pytest.mark.skipif(not weights.sys.platform.startswith("linux"), reason="reads /proc/self")
def test_a_copied_weight_mapped_from_a_file_leaves_memory_and_keeps_its_values(tmp_path):
    values = torch.arange(8 * 2**20, dtype=torch.float32)  # 32 MiB
    values.numpy().tofile(tmp_path / "weight.bin")
    mapped = torch.from_file(str(tmp_path / "weight.bin"), shared=False, size=values.numel())
    assert torch.equal(mapped, values)  # every page read: resident
    before = _resident_file_kib()
    weights.release_file_pages(mapped)
    assert before - _resident_file_kib() > 30 * 1024
    assert torch.equal(mapped, values)  # read back from the file


def test_weights_in_anonymous_memory_are_left_alone():
    values = torch.arange(8 * 2**20, dtype=torch.float32)
    weights.release_file_pages(values)
    assert torch.equal(values, torch.arange(8 * 2**20, dtype=torch.float32))


def test_without_a_compiler_the_runner_says_so_and_uses_pytorch(monkeypatch, caplog):
    import torch.utils.cpp_extension

    def no_compiler(**kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    kernels.available.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="reader_spec"):
            assert not kernels.available()
        assert "could not be built (no C++ compiler)" in caplog.text
        monkeypatch.setattr(weights, "_CHOICES", {})
        module = linear(64, 40, bias=True, seed=5)
        reference = module.weight.clone(), module.bias.clone()
        packed, _ = pack_linears([module])
        x = torch.randn(3, 40)
        assert torch.allclose(packed(x), nn.functional.linear(x, *reference), rtol=0, atol=TOL)
    finally:
        kernels.available.cache_clear()  # the next caller loads the real kernel again
