"""Packed weights multiply like ``nn.Linear``, whichever kernel runs, and keep no second copy."""

import itertools

import pytest
import torch
from torch import nn

import reader_spec.engine.weights as weights
from reader_spec.engine import kernel_choice, kernels
from reader_spec.engine.layouts import int4_fits, to_blocks
from reader_spec.engine.weights import PackedLinear, pack_linears
from tests.conftest import KERNELS_MISSING

TOL = 1e-5


def linear(out_features: int, in_features: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias).requires_grad_(False)


KERNELS = {
    "compiled": kernel_choice.Kernel.COMPILED,
    "reading ahead": kernel_choice.Kernel.READING_AHEAD,
    "batched matmul": kernel_choice.Kernel.BATCHED,
}


@pytest.fixture(params=list(KERNELS))
def kernel(request, monkeypatch):
    """Force one kernel for every row count (the engine picks per shape and row count by timing);
    ``compiled`` stands for both compiled ones where only the arithmetic matters."""
    if request.param != "batched matmul" and not kernels.available():
        pytest.fail(KERNELS_MISSING)
    monkeypatch.setattr(weights, "fastest_kernel", lambda weights, rows, same_pass: KERNELS[request.param])
    return "batched matmul" if request.param == "batched matmul" else "compiled"


@pytest.mark.parametrize("rows", [0, 1, 3, 4, 7, 8, 14, 17, 70])
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
    tokens = torch.tensor([0, 31, 32, 95, 7, 15, 16, 48])  # either panel of a block
    assert torch.equal(packed.rows_of(tokens), weight[tokens])
    batched = tokens.view(2, 4)  # [batch, tokens] as well
    assert torch.equal(packed.rows_of(batched), weight[tokens].view(2, 4, 40))
    assert torch.equal(packed.rows_of(tokens[:0]), weight[:0])


def test_float32_blocks_are_stored_as_two_panels_of_16_columns():
    """``w[2 b + h, k, c] = W[32 b + 16 h + c, k]``, zero past the matrix: what every kernel reads."""
    weight = torch.arange(40 * 3, dtype=torch.float32).view(40, 3) + 1
    blocks = to_blocks(weight, 64)
    assert blocks.shape == (4, 3, 16)
    for column in (0, 7, 15, 16, 31, 32, 39):
        block, panel, within = column // 32, column % 32 // 16, column % 16
        assert torch.equal(blocks[2 * block + panel, :, within], weight[column])
    assert (blocks[2, :, 8:] == 0).all() and (blocks[3] == 0).all()


def test_the_compiled_product_refuses_a_matrix_in_another_layout(compiled_kernels):
    x = torch.randn(2, 40)
    wrong = (torch.zeros(2, 40, 32), torch.zeros(3, 40, 16), torch.zeros(4, 40, 16, dtype=torch.float64))
    for weight in wrong:  # blocks of 32 columns, half a block, float64
        with pytest.raises(RuntimeError, match=r"contiguous float32 \[blocks x 2, K, 16\] on the CPU"):
            torch.ops.reader_spec.blocked_linear(x, weight, None, 32)


def test_the_compiled_lookup_refuses_a_token_outside_the_matrix(compiled_kernels):
    packed, _ = pack_linears([linear(96, 40, bias=False, seed=3)])
    with pytest.raises(RuntimeError, match="token 96 outside the 96 rows"):
        packed.rows_of(torch.tensor([3, 96]))


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
        monkeypatch.setattr(kernel_choice, "_CHOICES", {})
        module = linear(64, 40, bias=True, seed=5)
        reference = module.weight.clone(), module.bias.clone()
        packed, _ = pack_linears([module])
        x = torch.randn(3, 40)
        assert torch.allclose(packed(x), nn.functional.linear(x, *reference), rtol=0, atol=TOL)
    finally:
        kernels.available.cache_clear()  # the next caller loads the real kernel again


# int8: symmetric per output row, in the same column blocks, k in groups of 4 (or dequantized where
# there are none). The compiled kernel also rounds each input row to integers (one int16 level, or two
# int8 levels with VNNI): each product is compared with the matmul of the dequantized matrix, within
# what that rounding can move it.


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` through int8 and back: ``round(w / s) * s`` per row, ``s = max |row| / 127``."""
    scale = weight.abs().amax(dim=1, keepdim=True) / 127
    return (weight / scale).round().clamp(-127, 127) * scale


def input_rounding(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """How far rounding each row of ``x`` to integers can move its products with ``weight`` (``[out,
    in]``): each feature moves at most half a step of the last level, below ``max |row| / 64516`` for
    one int16 level of at most 32,767 steps (K < 263) and for two int8 levels (127 x 254 x 2)."""
    step = x.abs().amax(dim=-1, keepdim=True) / 64516
    return step * weight.abs().sum(dim=1) + TOL


@pytest.mark.parametrize("rows", [0, 1, 3, 8, 9, 17, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_an_int8_matrix_multiplies_like_its_dequantized_matrix(kernel, rows, bias):
    module = linear(100, 70, bias, seed=rows)  # 100 outputs: the last block of 32 is partial
    weight, bias_values = module.weight.clone(), None if module.bias is None else module.bias.clone()
    packed, _ = pack_linears([module], weight_format="int8")
    assert packed.blocked and packed.weight.dtype == torch.uint8 and packed.weight_format == "int8"
    assert packed.weight.shape == (4, 18, 128) and packed.scales.shape == (128,)  # 70 k: 18 groups of 4
    x = torch.randn(2, rows, 70)
    expected = nn.functional.linear(x, dequantized(weight), bias_values)
    assert packed(x).shape == (2, rows, 100)
    tolerance = input_rounding(x, dequantized(weight)) if kernel == "compiled" else TOL
    assert ((packed(x) - expected).abs() <= tolerance).all()
    if kernel == "compiled" and rows:  # the inputs really are rounded: not the float product
        assert not torch.allclose(packed(x), expected, rtol=0, atol=1e-7)


def test_an_int8_product_of_rows_with_inf_or_nan_is_not_finite_there_only(kernel):
    module = linear(40, 16, bias=True, seed=2)
    packed, _ = pack_linears([module], weight_format="int8")
    x = torch.randn(3, 16)
    x[0, 5], x[2, 0] = float("inf"), float("nan")
    out = packed(x)
    assert not out[[0, 2]].isfinite().any() and out[1].isfinite().all()


def test_int8_weights_are_within_half_a_step_of_the_originals():
    module = linear(100, 70, bias=False, seed=1)
    weight = module.weight.clone()
    packed, _ = pack_linears([module], weight_format="int8")
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert torch.equal(packed.plain_weight(), dequantized(weight))
    assert ((packed.plain_weight() - weight).abs() <= step / 2 * (1 + 1e-5)).all()
    largest = (packed.weight.to(torch.int16) - 128).abs().amax(dim=(1, 2))
    assert largest[:3].eq(127).all()  # every full block's rows reach 127


def test_fused_int8_matrices_split_into_their_parts_and_views_stay_usable(kernel):
    parts = [linear(n, 48, bias=n == 16, seed=n) for n in (64, 16, 16)]  # q, k (with bias), v
    references = [(dequantized(p.weight), None if p.bias is None else p.bias.clone()) for p in parts]
    fused, views = pack_linears(parts, weight_format="int8")
    x = torch.randn(5, 48)
    expected = [nn.functional.linear(x, *ref) for ref in references]
    for got, want, view, ref in zip(fused.split(fused(x)), expected, views, references, strict=True):
        tolerance = input_rounding(x, ref[0]) if kernel == "compiled" else TOL
        assert ((got - want).abs() <= tolerance).all()
        assert ((view(x) - want).abs() <= tolerance).all()
        assert torch.equal(view.plain_weight(), ref[0])
    assert all(not hasattr(p, "weight") for p in parts)  # originals freed
    assert fused.weight.numel() == (64 + 32 + 32) * 48 and fused.scales.numel() == 64 + 32 + 32
    for view in views:
        assert view.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
        assert view.scales.untyped_storage().data_ptr() == fused.scales.untyped_storage().data_ptr()


def test_an_int8_module_saves_and_looks_up_the_dequantized_matrix():
    module = linear(96, 40, bias=True, seed=3)
    weight, bias = dequantized(module.weight), module.bias.clone()
    packed, _ = pack_linears([module], weight_format="int8")
    state = packed.state_dict()
    assert state.keys() == {"weight", "bias"}
    assert torch.equal(state["weight"], weight) and torch.equal(state["bias"], bias)
    assert state["weight"].dtype == torch.float32
    tokens = torch.tensor([0, 31, 32, 95, 7])
    assert torch.equal(packed.rows_of(tokens), weight[tokens])
    assert torch.equal(packed.rows_of(tokens[None]), weight[tokens][None])  # [batch, tokens] as well
    assert "int8" in repr(packed) and "float32" in repr(pack_linears([linear(8, 4, False, 0)])[0])


@pytest.mark.parametrize("weight_format", ["float32", "int8", "int4", "int8-grouped"])
def test_rows_do_not_depend_on_the_rest_of_the_pass(weight_format, compiled_kernels):
    """The compiled ops sum each column over k in order (quantized: in integers, exact in any order,
    each row rounded on its own), whatever the tile: a row's outputs are the same alone, among 2 or 3
    rows, in a full register tile, in several tiles, on 1 or 2 threads, requesting the weights ahead
    or not."""
    module = linear(157, 64, bias=True, seed=6)  # 5 blocks, the last partial: an unpaired one
    if weight_format in GRIDS:
        module.weight.copy_(GRIDS[weight_format](157, 64, seed=6))
    packed, _ = pack_linears([module], weight_format="int4" if weight_format in GRIDS else weight_format)
    assert packed.weight_format == weight_format
    x = torch.randn(27, 64)

    def run(rows, ahead=False):
        ops = torch.ops.reader_spec
        if weight_format == "int8":
            return ops.int8_linear(rows, packed.weight, packed.scales, packed.bias, 64, 157)
        if weight_format in GRIDS:
            return ops.grouped_linear(rows, packed.weight, packed.scales, packed.bias, 64, 157)
        return ops.blocked_linear(rows, packed.weight, packed.bias, 157, ahead)

    together = run(x)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            spans = [(0, 1), (4, 5), (26, 27), (0, 2), (3, 6), (10, 14), (20, 27)]
            spans += [(1, 9), (7, 17), (0, 12), (5, 18)]
            for (start, stop), ahead in itertools.product([*spans, (2, 27)], (False, True)):
                assert torch.equal(run(x[start:stop], ahead), together[start:stop])
    finally:
        torch.set_num_threads(threads)
    expected = nn.functional.linear(x, packed.plain_weight(), packed.bias)
    tolerance = input_rounding(x, packed.plain_weight()) if weight_format != "float32" else TOL
    assert ((together - expected).abs() <= tolerance).all()


def test_many_rows_taken_a_share_at_a_time_give_each_row_its_own_result(compiled_kernels):
    """Rows beyond what L2 holds beside a block (here 16 KB each) are multiplied a share at a time,
    every share by every block: each row's outputs stay those it gets alone."""
    module = linear(70, 4096, bias=True, seed=7)
    packed, _ = pack_linears([module])
    x = torch.randn(100, 4096)
    together = torch.ops.reader_spec.blocked_linear(x, packed.weight, packed.bias, 70)
    for row in range(100):
        alone = torch.ops.reader_spec.blocked_linear(x[row : row + 1], packed.weight, packed.bias, 70)
        assert torch.equal(alone[0], together[row])
    expected = nn.functional.linear(x, packed.plain_weight(), packed.bias)
    assert torch.allclose(together, expected, rtol=0, atol=1e-3)


def q4_grid(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """A matrix as a 4-bit file holds it (GGUF's Q4_1): per row and group of 32 inputs, q in 0..15
    (0 and 15 both used, as that quantizer makes them) times a float16 scale plus a float16 minimum."""
    generator = torch.Generator().manual_seed(seed)
    shape = (out_features, in_features // 32, 32)
    q = torch.randint(0, 16, shape, generator=generator)
    q[..., 3], q[..., 17] = 0, 15
    scale = (torch.rand(*shape[:2], 1, generator=generator) * 0.02 + 1e-6).half().float()  # some subnormal
    minimum = (-torch.rand(*shape[:2], 1, generator=generator) * 0.1).half().float()
    return (q * scale + minimum).view(out_features, in_features)


def q8_grid(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """A matrix as an 8-bit file holds it (GGUF's Q8_0): per row and group of 32 inputs, q in
    -127..127 (one of them +-127, as that quantizer makes it) times a float16 scale."""
    generator = torch.Generator().manual_seed(seed)
    shape = (out_features, in_features // 32, 32)
    q = torch.randint(-127, 128, shape, generator=generator)
    q[..., 5] = torch.where(torch.rand(shape[:2], generator=generator) < 0.5, -127, 127)
    q[..., 6] = 0
    scale = (torch.rand(*shape[:2], 1, generator=generator) * 0.002 + 1e-7).half().float()  # some subnormal
    return (q * scale).view(out_features, in_features)


GRIDS = {"int4": q4_grid, weights.INT8_GROUPED: q8_grid}
"""A GGUF file's matrices, by the format that stores them exactly."""


@pytest.fixture(params=list(GRIDS))
def grouped(request) -> str:
    """A storage format quantized per group of 32 inputs."""
    return request.param


def grid_linear(out_features: int, in_features: int, bias: bool, seed: int, stored: str = "int4"):
    module = linear(out_features, in_features, bias, seed)
    module.weight.copy_(GRIDS[stored](out_features, in_features, seed))
    return module


def test_int4_keeps_a_gguf_files_matrices_exactly(grouped, monkeypatch):
    module = grid_linear(100, 96, bias=True, seed=4, stored=grouped)  # 100 outputs: a partial last block
    weight, bias = module.weight.clone(), module.bias.clone()
    assert int4_fits(weight) == (grouped == "int4")
    packed, _ = pack_linears([module], weight_format="int4")
    assert packed.weight_format == grouped and packed.blocked and grouped in repr(packed)
    bits = weights.GROUPED_BITS[grouped]
    assert packed.weight.shape == (4, 3, 128 * bits) and packed.weight.dtype == torch.uint8
    assert packed.scales.shape == (4, 3, 64 if bits == 4 else 32) and packed.scales.dtype == torch.int16
    assert torch.equal(packed.plain_weight(), weight)  # not a bit lost
    state = packed.state_dict()
    assert torch.equal(state["weight"], weight) and torch.equal(state["bias"], bias)
    tokens = torch.tensor([0, 7, 8, 15, 16, 23, 24, 31, 32, 99])  # every octet of columns in a block
    assert torch.equal(packed.rows_of(tokens), weight[tokens])
    assert torch.equal(packed.rows_of(tokens[None]), weight[tokens][None])
    # the indexing gives the compiled lookup's rows
    monkeypatch.setattr(kernels, "available", lambda: False)
    assert torch.equal(packed.rows_of(tokens), weight[tokens])


def test_the_compiled_grouped_lookup_refuses_a_token_outside_the_matrix(grouped, compiled_kernels):
    packed, _ = pack_linears([grid_linear(100, 64, bias=False, seed=5, stored=grouped)], weight_format="int4")
    assert packed.weight_format == grouped
    with pytest.raises(RuntimeError, match="grouped_rows: token 128 outside the 128 rows"):
        packed.rows_of(torch.tensor([3, 128]))


def test_int4_stores_a_float_matrix_in_8_bits_per_group_or_per_row():
    float_matrix = linear(40, 64, bias=False, seed=1)
    weight = float_matrix.weight.clone()
    assert not int4_fits(weight)
    packed, _ = pack_linears([float_matrix], weight_format="int4")
    assert packed.weight_format == weights.INT8_GROUPED
    groups = weight.view(40, 2, 32)
    step = groups.abs().amax(-1, keepdim=True) / 127  # half a step of each group's own scale, at most
    assert ((packed.plain_weight().view(40, 2, 32) - groups).abs() <= step * 0.5 * 1.01).all()
    assert not int4_fits(q4_grid(8, 64, 0)[:, :48])  # 48 inputs: not whole groups of 32
    other, _ = pack_linears([linear(8, 48, bias=False, seed=2)], weight_format="int4")
    assert other.weight_format == "int8"


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 7, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_a_grouped_matrix_multiplies_like_its_dequantized_matrix(kernel, grouped, rows, bias):
    module = grid_linear(100, 64, bias, seed=rows, stored=grouped)
    weight, bias_values = module.weight.clone(), None if module.bias is None else module.bias.clone()
    packed, _ = pack_linears([module], weight_format="int4")
    assert packed.weight_format == grouped
    x = torch.randn(2, rows, 64)
    expected = nn.functional.linear(x, weight, bias_values)
    assert packed(x).shape == (2, rows, 100)
    tolerance = input_rounding(x, weight) if kernel == "compiled" else TOL
    assert ((packed(x) - expected).abs() <= tolerance).all()


def test_a_grouped_product_of_rows_with_inf_or_nan_is_not_finite_there_only(kernel, grouped):
    packed, _ = pack_linears([grid_linear(40, 32, bias=True, seed=2, stored=grouped)], weight_format="int4")
    x = torch.randn(3, 32)
    x[0, 5], x[2, 0] = float("inf"), float("nan")
    out = packed(x)
    assert not out[[0, 2]].isfinite().any() and out[1].isfinite().all()


def test_fused_grouped_matrices_split_into_their_parts_and_views_stay_usable(kernel, grouped):
    parts = [grid_linear(n, 64, bias=n == 16, seed=n, stored=grouped) for n in (64, 16, 16)]  # q, k, v
    references = [(p.weight.clone(), None if p.bias is None else p.bias.clone()) for p in parts]
    fused, views = pack_linears(parts, weight_format="int4")
    x = torch.randn(5, 64)
    for got, view, ref in zip(fused.split(fused(x)), views, references, strict=True):
        want = nn.functional.linear(x, *ref)
        tolerance = input_rounding(x, ref[0]) if kernel == "compiled" else TOL
        assert ((got - want).abs() <= tolerance).all() and ((view(x) - want).abs() <= tolerance).all()
        assert view.weight_format == grouped and torch.equal(view.plain_weight(), ref[0])
        assert view.scales.untyped_storage().data_ptr() == fused.scales.untyped_storage().data_ptr()
    assert fused.weight.shape == (4, 2, 128 * weights.GROUPED_BITS[grouped])  # parts padded to whole blocks


def test_a_matrix_fuses_in_int4_only_if_every_part_does():
    parts = [grid_linear(32, 64, False, seed=1), grid_linear(32, 64, False, seed=2, stored="int8-grouped")]
    q4, q8 = (p.weight.clone() for p in parts)
    fused, views = pack_linears(parts, weight_format="int4")
    assert fused.weight_format == weights.INT8_GROUPED
    assert all(view.weight_format == weights.INT8_GROUPED for view in views)
    assert torch.equal(views[1].plain_weight(), q8)
    step = q4.view(32, 2, 32).abs().amax(-1, keepdim=True) / 127  # the 4-bit part: within half a step
    assert ((views[0].plain_weight().view(32, 2, 32) - q4.view(32, 2, 32)).abs() <= step * 0.5 * 1.01).all()


def test_grouped_formats_on_other_dtypes_keep_the_plain_layout(grouped):
    module = grid_linear(64, 32, bias=True, seed=5, stored=grouped).to(torch.bfloat16)
    packed, _ = pack_linears([module], weight_format="int4")
    assert packed.weight_format == grouped and not packed.blocked
    assert packed.weight.shape == (64, 32) and packed.scales.shape == (64, 1, 2)
    plain = packed.plain_weight()
    assert plain.dtype == torch.bfloat16
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    assert torch.equal(packed(x), nn.functional.linear(x, plain, packed.bias))
    assert torch.equal(packed.rows_of(torch.tensor([5, 63])), plain[[5, 63]])


def test_int8_on_other_dtypes_keeps_the_plain_layout():
    module = linear(64, 32, bias=True, seed=4).to(torch.bfloat16)
    weight = module.weight.float()
    packed, _ = pack_linears([module], weight_format="int8")
    assert not packed.blocked and packed.weight.dtype == torch.int8 and packed.weight.shape == (64, 32)
    plain = packed.plain_weight()
    assert plain.dtype == torch.bfloat16 and packed.scales.dtype == torch.bfloat16
    assert (plain.float() - weight).abs().max() < 0.01 * weight.abs().max()
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    assert torch.equal(packed(x), nn.functional.linear(x, plain, packed.bias))
    assert torch.equal(packed.rows_of(torch.tensor([5, 63])), plain[[5, 63]])


def test_an_unknown_weight_format_is_refused_before_anything_is_packed():
    module = linear(8, 4, bias=False, seed=0)
    with pytest.raises(ValueError, match="weights must be one of float32, int8, int4"):
        pack_linears([module], weight_format="int3")
    assert isinstance(module.weight, nn.Parameter)


def _tiny_llama(tied: bool):
    from tests.conftest import make_tiny_llama

    model = make_tiny_llama()
    if tied:  # the output layer is the input embedding (SmolLM2's case)
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _fast_logits(model, tokens: list[int]) -> torch.Tensor:
    """Logits of ``tokens[9:]`` through the engine's fast runner (prefill, then one chain)."""
    from reader_spec.engine.runner import ModelRunner
    from reader_spec.engine.tree import DraftTree

    runner = ModelRunner(model, num_rows=1, capacity=32, runner="fast")
    runner.prefill(0, tokens[:9])
    chain = tokens[9:]
    return runner.verify([DraftTree(chain, list(range(-1, len(chain) - 1)))], [0])[0]


def _own_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_an_int8_model_predicts_close_to_float32_and_runs_its_own_forward(tied):
    import copy

    from reader_spec.engine.decoder import FastDecoder, _TiedEmbedding

    model = _tiny_llama(tied)
    reference = copy.deepcopy(model)
    model._reader_fast_decoder = FastDecoder(model, weight_format="int8")
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 1 + 7 * model.config.num_hidden_layers
    assert all(m.weight_format == "int8" for m in packed)
    assert isinstance(model.model.embed_tokens, _TiedEmbedding) == tied
    tokens = list(range(3, 20))
    expected = _own_logits(reference, tokens)
    own = _own_logits(model, tokens)  # transformers' forward over the int8 modules
    fast = _fast_logits(model, tokens)
    assert (fast - own[9:]).abs().max() < TOL  # the same int8 model either way
    error = (own - expected).abs().max()
    assert 0 < error < 0.02 * expected.abs().max()  # quantized, and close


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_copy_of_a_float32_packed_model_packs_again_as_int8(tied):
    import copy

    from reader_spec.engine.decoder import FastDecoder, _TiedEmbedding

    model = _tiny_llama(tied)
    fresh = copy.deepcopy(model)
    FastDecoder(fresh, weight_format="int8")  # int8 straight from nn.Linear: what the copy must become
    tokens = list(range(3, 20))
    expected = _own_logits(model, tokens)
    assert (_fast_logits(model, tokens) - expected[9:]).abs().max() < TOL  # packs float32 in place
    draft = copy.deepcopy(model)
    del draft._reader_fast_decoder
    draft._reader_fast_decoder = FastDecoder(draft, weight_format="int8")
    for (name, got), (_, want) in zip(draft.named_modules(), fresh.named_modules(), strict=True):
        if isinstance(want, PackedLinear):
            assert isinstance(got, PackedLinear) and got.weight_format == "int8", name
            assert torch.equal(got.weight, want.weight) and torch.equal(got.scales, want.scales), name
            assert got.parts == want.parts, name
    if tied:
        embed = draft.model.embed_tokens
        assert isinstance(embed, _TiedEmbedding) and embed.lm_head[0] is draft.lm_head
    assert (_fast_logits(draft, tokens) - _own_logits(fresh, tokens)[9:]).abs().max() < TOL
    # the float32 model is untouched by its copy's packing
    assert (_own_logits(model, tokens) - expected).abs().max() < TOL
    assert all(m.weight.dtype == torch.float32 for m in model.modules() if isinstance(m, PackedLinear))


def test_without_a_compiler_int8_weights_are_dequantized_for_each_product(monkeypatch):
    import torch.utils.cpp_extension

    def no_compiler(**kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    kernels.available.cache_clear()
    try:
        assert not kernels.available()
        module = linear(100, 40, bias=True, seed=7)
        reference = dequantized(module.weight), module.bias.clone()
        packed, _ = pack_linears([module], weight_format="int8")
        assert packed.blocked and packed.weight.dtype == torch.uint8
        for rows in (1, 9, 100):
            x = torch.randn(rows, 40)
            assert torch.allclose(packed(x), nn.functional.linear(x, *reference), rtol=0, atol=TOL)
    finally:
        kernels.available.cache_clear()  # the next caller loads the real kernel again


def test_the_kernel_library_is_loaded_once_whatever_the_cache_directory_says(monkeypatch, tmp_path):
    """A second library registering the same ops aborts the process (it did, in CI, when a test with its
    own cache directory loaded the kernel again): later loads reuse the first one's directory."""
    assert kernels.available()
    kernels.available.cache_clear()
    monkeypatch.setenv("READER_SPEC_CACHE", str(tmp_path))
    try:
        assert kernels.available()
        assert not (tmp_path / "kernels").exists()
    finally:
        kernels.available.cache_clear()


def test_kernels_are_timed_on_every_matrix_of_a_shape_and_the_compiled_one_wins_near_ties(
    monkeypatch, compiled_kernels
):
    """Timing reads each matrix of the shape once per round, as a pass does; the batched matmul runs a
    row bucket only where it timed clearly faster than the compiled kernel with or without requests
    ahead (a pass favours the compiled kernel, see ``BATCHED_MARGIN``); whether the compiled kernel
    requests ahead is its own choice (``_reads_ahead``)."""
    packed = [pack_linears([linear(64, 40, bias=False, seed=s)])[0] for s in range(3)]
    other = pack_linears([linear(32, 40, bias=False, seed=9)])[0]
    weights.time_together([*packed, other])
    assert all(p.same_shape == [q.weight for q in packed] for p in packed) and other.same_shape == [
        other.weight
    ]
    calls = []
    # (compiled, reading ahead, batched) per bucket timed: near ties with the batched matmul first;
    # buckets up to AHEAD_TIMED_ROWS (their requests are timed on the whole pass, here `_reads_ahead`)
    # and the compute-bound bucket time the compiled kernel without requests only
    times = iter([[1.05, 1.0], [1.05, 1.0], [1.2, 1.2, 1.0], [1.3, 1.2, 1.0], [1.3, 1.1, 1.5], [1.2, 1.0]])

    def timed(calls_to_time, rounds=5):
        calls.append((calls_to_time, rounds))
        return next(times)

    monkeypatch.setattr(kernel_choice, "_CHOICES", {})
    monkeypatch.setattr(kernel_choice, "best_times", timed)
    monkeypatch.setattr(kernel_choice, "_reads_ahead", lambda same_pass, rows: rows == 8)
    seen = []
    monkeypatch.setattr(
        torch.ops.reader_spec, "blocked_linear", lambda x, w, **kwargs: seen.append((w, kwargs["ahead"]))
    )
    Kernel = kernel_choice.Kernel
    assert packed[0].kernel_at(1) == Kernel.COMPILED and packed[1].kernel_at(8) == Kernel.READING_AHEAD
    assert packed[2].kernel_at(16) == Kernel.BATCHED and packed[0].kernel_at(64) == Kernel.BATCHED
    assert len(calls) == 4 and packed[1].kernel_at(50) == Kernel.BATCHED  # each bucket timed once, when first
    assert packed[2].kernel_at(7) == Kernel.COMPILED and len(calls) == 4  # bucket 8 timed already
    # beyond AHEAD_TIMED_ROWS the shape's own timing also decides the requests
    assert packed[0].kernel_at(12) == Kernel.READING_AHEAD and len(calls) == 5
    assert [len(timed_calls) for timed_calls, _ in calls] == [2, 2, 3, 3, 3]
    compiled, reading_ahead, _ = calls[2][0]
    compiled()  # one round of a compiled kernel reads every matrix of the shape
    assert seen == [(p.weight, False) for p in packed]
    seen.clear()
    reading_ahead()
    assert seen == [(p.weight, True) for p in packed]
    seen.clear()
    assert packed[2].kernel_at(300) == Kernel.BATCHED  # bucket 512: compute-bound, one matrix, fewer rounds
    assert len(calls[-1][0]) == 2  # the compiled kernel without requests and the batched matmul
    calls[-1][0][0]()
    assert seen == [(packed[0].weight, False)] and calls[-1][1] < 5
    beyond = kernel_choice.ROW_BUCKETS[-1] + 1
    assert packed[0].kernel_at(beyond) == Kernel.BATCHED and len(calls) == 6  # beyond: batched


def test_requests_ahead_are_timed_at_each_row_count_on_every_matrix_of_a_pass(monkeypatch, compiled_kernels):
    """Up to ``AHEAD_TIMED_ROWS`` rows, whether the compiled kernel requests its weights ahead is timed
    at each row count (not per bucket) on all the float32 matrices given together, in their order (as
    a pass reads them), once each; ties go to no requests."""
    first = pack_linears([linear(64, 40, bias=False, seed=1)])[0]
    wide = pack_linears([linear(96, 24, bias=False, seed=2)])[0]
    last = pack_linears([linear(64, 40, bias=False, seed=3)])[0]
    quantized = pack_linears([linear(64, 40, bias=False, seed=4)], weight_format="int8")[0]
    weights.time_together([first, quantized, wide, last])
    assert first.same_pass == [first.weight, wide.weight, last.weight] == last.same_pass
    assert kernel_choice.AHEAD_TIMED_ROWS >= 5
    rounds, timing_rows = [], []
    answers = {3: [1.0, 0.9], 4: [1.0, 1.0], 5: [0.9, 1.0]}  # (without, with) requests

    def timed(calls_to_time, rounds_=5):
        rounds.append(calls_to_time)
        return answers[timing_rows[-1]]

    seen = []

    def product(x, w, bias, out_features, ahead):
        seen.append((w, tuple(x.shape), out_features, ahead))

    monkeypatch.setattr(kernel_choice, "_READS_AHEAD", {})
    monkeypatch.setattr(kernel_choice, "best_times", timed)
    monkeypatch.setattr(torch.ops.reader_spec, "blocked_linear", product)
    for rows in (3, 4, 5):
        timing_rows.append(rows)
        assert kernel_choice._reads_ahead(first.same_pass, rows) == (rows == 3)
    assert len(rounds) == 3
    assert kernel_choice._reads_ahead(last.same_pass, 3) and len(rounds) == 3  # the same pass: timed once
    without, ahead = rounds[0]
    without()  # one round reads every float32 matrix in turn, each with rows of its own width
    assert seen == [
        (first.weight, (3, 40), 64, False),
        (wide.weight, (3, 24), 96, False),
        (last.weight, (3, 40), 64, False),
    ]
    seen.clear()
    ahead()
    assert [request for *_, request in seen] == [True] * 3
