"""How a matrix is rounded and laid out for the kernels that multiply it.

Float32 matrices are stored in column blocks of 32, each as two panels of 16 columns (``[out / 16,
in, 16]``): each block is read once and multiplied by every row of a pass, as two streams of whole
64-byte lines. int8 matrices (one scale per output row) take the same blocks with
each block's k in groups of 4, as VNNI's multiply-add reads them. Matrices quantized per group of 32
inputs follow GGUF: Q4_1 (4 bits with a scale and a minimum) and Q8_0 (8 bits with a scale), so a
model read from such a file gets its own weights back exactly. Which format a matrix gets, and which
kernel multiplies it, is :mod:`reader_spec.engine.weights`' choice; this module only computes the
numbers and their order in memory.
"""

from __future__ import annotations

import torch
from torch import nn

from reader_spec.engine import kernels
from reader_spec.engine.memory import PageArena

BLOCK = kernels.BLOCK
"""Output columns per block of a packed matrix."""
PANEL = kernels.PANEL
"""Output columns per panel of a float32 block (:func:`to_blocks`)."""
INT8_GROUP = 4
"""k per 32-bit lane of the integer product (VNNI multiplies and adds four byte pairs at once)."""
WEIGHT_GROUP = kernels.WEIGHT_GROUP
"""Inputs per scale (and minimum) of a matrix quantized per group (GGUF's blocks)."""


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: ``weight ≈ q * scales[:, None]``, ``scales = max |row| / 127``
    in the weight's dtype (q is rounded against that scale, so it is the one that dequantizes)."""
    values = weight.float()
    scales = (values.abs().amax(dim=1) / 127).to(weight.dtype)
    divisor = scales.float().clamp_min(torch.finfo(torch.float32).tiny)[:, None]  # all-zero rows: q = 0
    quantized = (values / divisor).round_().clamp_(-127, 127).to(torch.int8)
    return quantized, scales


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4 bits per weight with a scale and a minimum per row and group of 32 inputs, as GGUF's Q4_1
    quantizes: ``weight ≈ q * d + m``, ``m`` the group's least weight, ``d`` its range / 15, both
    float16, ``q`` rounded against them. Returns ``q`` (``[out, in]``, uint8), ``d`` and ``m``
    (``[out, in / 32]``, float16). A matrix read from a 4-bit file comes back exactly."""
    out_features, in_features = weight.shape
    groups = weight.float().view(out_features, in_features // WEIGHT_GROUP, WEIGHT_GROUP)
    least, most = groups.amin(-1), groups.amax(-1)
    minimum = least.half()
    scale = ((most - least) / 15).half()
    divisor = scale.float().clamp_min(torch.finfo(torch.float32).tiny)[..., None]  # flat groups: q = 0
    q = ((groups - minimum.float()[..., None]) / divisor).round_().clamp_(0, 15).to(torch.uint8)
    return q.view(out_features, in_features), scale, minimum


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The float32 ``[out, in]`` matrix of :func:`quantize_int4`'s parts."""
    groups = (
        q.view(*scale.shape, WEIGHT_GROUP).float() * scale.float()[..., None] + minimum.float()[..., None]
    )
    return groups.view(q.shape)


def quantize_int8_grouped(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """8 bits per weight with a scale per row and group of 32 inputs, as GGUF's Q8_0 quantizes:
    ``weight ≈ q * d``, ``d`` the group's largest magnitude / 127 in float16, ``q`` rounded against it.
    Returns ``q`` (``[out, in]``, int8) and ``d`` (``[out, in / 32]``, float16). A matrix read from an
    8-bit file comes back exactly."""
    out_features, in_features = weight.shape
    groups = weight.float().view(out_features, in_features // WEIGHT_GROUP, WEIGHT_GROUP)
    scale = (groups.abs().amax(-1) / 127).half()
    divisor = scale.float().clamp_min(torch.finfo(torch.float32).tiny)[..., None]  # all-zero groups: q = 0
    q = (groups / divisor).round_().clamp_(-127, 127).to(torch.int8)
    return q.view(out_features, in_features), scale


def int4_fits(weight: torch.Tensor) -> bool:
    """Whether int4 stores this matrix at least as closely as 8 bits per group do
    (:func:`quantize_int8_grouped`; the largest error of either): true for weights read from a 4-bit
    file, false for matrices trained in float and for an 8-bit file's (and where the inputs are not
    whole groups of 32)."""
    if weight.shape[1] % WEIGHT_GROUP:
        return False
    values = weight.float()
    int4_error = (dequantize_int4(*quantize_int4(values)) - values).abs().max()
    q8, scale8 = quantize_int8_grouped(values)
    int8_error = (q8.view(*scale8.shape, WEIGHT_GROUP) * scale8.float()[..., None]).view_as(values) - values
    return bool(int4_error <= int8_error.abs().max())


def to_nibbles(
    q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, rows: int, arena: PageArena | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """An int4 matrix as the grouped product reads it (``kernels/grouped_product.cpp``): per block of 32
    columns and group of 32 k, 16 pairs of k, each 32 bytes: column 8 h + c (h 0 or 1), k j at byte
    16 h + 2 c + j, low nibble; column 16 + 8 h + c at the same byte's high nibble.
    ``[rows / 32, in / 32, 512]`` (in ``arena`` if given); and ``[rows / 32, in / 32, 64]``, each
    group's 32 scales then its 32 minimums (float16 bits as int16). Padding columns (up to ``rows``)
    are zero."""
    out_features, in_features = q.shape
    groups = in_features // WEIGHT_GROUP
    q = nn.functional.pad(q, (0, 0, 0, rows - out_features))
    by_pair = q.view(rows // BLOCK, BLOCK, groups, WEIGHT_GROUP // 2, 2).permute(0, 2, 3, 1, 4)
    octets = by_pair.reshape(rows // BLOCK, groups, WEIGHT_GROUP // 2, 2, 2, 16)  # [..., high, h, 8 c x 2 k]
    packed = (octets[..., 0, :, :] | (octets[..., 1, :, :] << 4)).reshape(rows // BLOCK, groups, 512)
    if arena is not None:
        packed = arena.empty(packed.shape, packed.dtype).copy_(packed)
    pairs = torch.stack([scale, minimum]).to(torch.float16).view(torch.int16)  # [2, out, groups]
    pairs = nn.functional.pad(pairs, (0, 0, 0, rows - out_features))
    scales = pairs.view(2, rows // BLOCK, BLOCK, groups).permute(1, 3, 0, 2)
    return packed.contiguous(), scales.reshape(rows // BLOCK, groups, 64).contiguous()


def to_grouped_int8(
    q: torch.Tensor, scale: torch.Tensor, rows: int, arena: PageArena | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 matrix with a scale per group of 32 inputs as the grouped product reads it
    (``kernels/grouped_product.cpp``): per block of 32 columns and group of 32 k, 16 pairs of k, each
    64 bytes, column c's k j at byte 2 c + j (the int8 bits in uint8). ``[rows / 32, in / 32, 1024]``
    (in ``arena`` if given); and ``[rows / 32, in / 32, 32]``, each group's 32 scales (float16 bits as
    int16). Padding columns (up to ``rows``) are zero."""
    out_features, in_features = q.shape
    groups = in_features // WEIGHT_GROUP
    q = nn.functional.pad(q, (0, 0, 0, rows - out_features))
    by_pair = q.view(rows // BLOCK, BLOCK, groups, WEIGHT_GROUP // 2, 2).permute(0, 2, 3, 1, 4)
    packed = by_pair.reshape(rows // BLOCK, groups, 32 * WEIGHT_GROUP).view(torch.uint8)
    if arena is not None:
        packed = arena.empty(packed.shape, packed.dtype).copy_(packed)
    halves = nn.functional.pad(scale.to(torch.float16).view(torch.int16), (0, 0, 0, rows - out_features))
    scales = halves.view(rows // BLOCK, BLOCK, groups).transpose(1, 2)
    return packed.contiguous(), scales.contiguous()


def round_up(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def to_blocks(weight: torch.Tensor, rows: int, arena: PageArena | None = None) -> torch.Tensor:
    """``[rows / 16, in, 16]``: the matrix padded with zero rows to ``rows`` (a whole number of
    blocks), in panels of 16 columns (in ``arena`` if given). A block's two panels are side by side,
    so a kernel reads each block as two streams of whole cache lines: products of a few rows ran faster
    than from blocks of 32 columns stored as ``[in, 32]``, which a core reads as one stream
    (docs/runner.md, "blocks stored as two panels, 7-row panel tiles")."""
    out_features, in_features = weight.shape
    if rows != out_features:
        weight = torch.cat([weight, weight.new_zeros(rows - out_features, in_features)])
    blocks = weight.view(rows // PANEL, PANEL, in_features).transpose(1, 2)
    if arena is None:
        return blocks.contiguous()
    return arena.empty(blocks.shape, blocks.dtype).copy_(blocks)


def to_groups(quantized: torch.Tensor, rows: int, arena: PageArena | None = None) -> torch.Tensor:
    """An int8 ``[out, in]`` matrix as the integer product reads it: ``[rows / 32, ceil(in / 4), 128]``,
    each group of 4 k of a block's 32 columns side by side, as ``q + 128`` (the unsigned operand of
    VNNI's multiply-add), zero past ``in`` and ``out`` (in ``arena`` if given)."""
    out_features, in_features = quantized.shape
    groups = -(-in_features // INT8_GROUP)
    padded = nn.functional.pad(quantized, (0, groups * INT8_GROUP - in_features, 0, rows - out_features))
    grouped = padded.view(rows // BLOCK, BLOCK, groups, INT8_GROUP).transpose(1, 2)
    unsigned = (grouped.to(torch.int16) + 128).to(torch.uint8).flatten(2)
    if arena is None:
        return unsigned.contiguous()
    return arena.empty(unsigned.shape, unsigned.dtype).copy_(unsigned)
