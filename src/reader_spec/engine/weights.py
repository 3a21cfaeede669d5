"""How the fast runner stores and multiplies every weight matrix: the one place that decides it.

A verification pass multiplies between one and a few dozen rows by each matrix, where PyTorch's
default ``F.linear`` takes slow paths on some CPUs (several times the bandwidth floor at 2 to 16
rows). On a CPU, float32 matrices are stored in column blocks of 32, each as two panels of 16 columns
(``[out / 16, in, 16]``, :func:`~reader_spec.engine.layouts.to_blocks`): each block is read from
memory once and multiplied by every row of the pass. Two kernels read that layout, the
compiled one of :mod:`reader_spec.engine.kernels` and PyTorch's batched matmul; which one runs for
a given matrix shape and row count, and whether the compiled one requests its weights ahead of its
multiply-adds, is decided by timing them once per process (:mod:`reader_spec.engine.kernel_choice`).
Other devices and dtypes keep the plain layout and ``F.linear``.

The storage format is a choice of the packing step (:data:`WEIGHT_FORMATS`): the model's own float
weights, or int8 with a float scale per output row (symmetric, per output channel), for a draft
model that only needs to be close. On a CPU int8 matrices take the same column blocks, each block's
k in groups of 4 (``[out / 32, in / 4, 128]``, unsigned), and are multiplied in integers by the
compiled ``int8_linear`` (a quarter of the bytes of float32, and no conversion of each weight to
float, which cost more than reading it at a few rows): each row of the input is rounded to 16-bit
integers (two int8 levels with AVX-512 VNNI) with a scale of its own, so a row's outputs do not
depend on the rest of the pass. Elsewhere, or without a compiler, int8 matrices are dequantized for
each product. PyTorch's own int8 kernel (``torch._weight_int8pack_mm``) is no use here: on a CPU it
is several times slower than float32 at a few rows. ``int4`` stores matrices as GGUF files do, per
group of 32 inputs: in 4 bits with a scale and a minimum (Q4_1) where that is at least as close as 8
bits with a scale (Q8_0), in those 8 bits elsewhere (:data:`INT8_GROUPED`); a model loaded from a
4-bit file, whose output layer is Q8_0, gets all its own weights back exactly, multiplied by the
compiled ``grouped_linear``. The rounding and the order of the numbers in memory are
:mod:`reader_spec.engine.layouts`'.

Packing replaces the model's ``nn.Linear`` modules by :class:`PackedLinear` modules (the model's own
forward still runs) and frees the originals, so no second copy of the weights is kept. Projections
that read the same input (query/key/value, gate/up) share one fused matrix; each original module
becomes a view of its rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn

from reader_spec.engine import kernels
from reader_spec.engine.kernel_choice import Kernel, fastest_kernel
from reader_spec.engine.layouts import (
    BLOCK,
    INT8_GROUP,
    PANEL,
    WEIGHT_GROUP,
    int4_fits,
    quantize_int4,
    quantize_int8,
    quantize_int8_grouped,
    round_up,
    to_blocks,
    to_grouped_int8,
    to_groups,
    to_nibbles,
)
from reader_spec.engine.memory import PageArena, release_file_pages

WEIGHT_FORMATS = ("float32", "int8", "int4")
"""How :func:`pack_linears` stores a matrix: ``float32``, the model's own weights, unquantized (blocked
where they are float32 on a CPU, other dtypes and devices as they are); ``int8``, symmetric per output
row (``W ≈ q * scale``, ``scale = max |row| / 127``, rounded to nearest), scales in the model's dtype;
``int4``, ``W ≈ q * d + m`` with ``q`` in 0..15 and float16 ``d`` and ``m`` per output row and group
of 32 inputs (:func:`quantize_int4`), for each matrix that this stores at least as closely as
:data:`INT8_GROUPED` (exactly, for weights read from a 4-bit file), that format for the others (int8
per output row where the inputs are not whole groups)."""
INT8_GROUPED = "int8-grouped"
"""How the ``int4`` format stores a matrix that 4 bits would store less closely: ``W ≈ q * d``, ``q``
in -127..127 and a float16 ``d`` per output row and group of 32 inputs (GGUF's Q8_0, the output layer
of a 4-bit file; :func:`quantize_int8_grouped`)."""
GROUPED_BITS = {"int4": 4, INT8_GROUPED: 8}
"""Bits per weight of the storage formats quantized per group (``grouped_linear`` multiplies both)."""


class PackedLinear(nn.Module):
    """``F.linear(x, W, b)`` with ``W`` stored for the shapes the engine runs.

    ``blocked``: ``weight`` is ``[blocks x 2, in, 16]`` (CPU, float32: :func:`to_blocks`) or
    ``[blocks, ceil(in / 4), 128]`` (int8: :func:`to_groups`), else the plain matrix. A fused matrix
    knows where its parts' outputs lie (``parts``: start and size of each), for :meth:`split`.
    ``scales`` (int8 weights): ``W = weight * scales`` per output row, one scale per stored row
    (blocked: padding rows included); the bias stays in the model's dtype.
    Weights quantized per group (``weight_format`` in :data:`GROUPED_BITS`): blocked, the layouts of
    :func:`to_nibbles` (int4) and :func:`to_grouped_int8`, ``scales`` ``[blocks, in / 32, 64 or 32]``
    (float16 bits held as int16 so that the model's dtype stays its float one); plain, ``q`` as
    ``[out, in]`` (uint8 or int8) and ``scales`` ``[out, in / 32, 2]`` (scale, minimum: 0 for
    int8-grouped) in the model's dtype.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        in_features: int,
        out_features: int,
        blocked: bool,
        parts: Sequence[tuple[int, int]] = (),
        scales: torch.Tensor | None = None,
        weight_format: str | None = None,
    ):
        super().__init__()
        self.weight_format = weight_format or ("float32" if scales is None else "int8")
        """How it stores its matrix: one of :data:`WEIGHT_FORMATS` or :data:`INT8_GROUPED`."""
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.scales = None if scales is None else nn.Parameter(scales, requires_grad=False)
        self.out_features = out_features
        self.in_features = in_features
        self.blocked = blocked
        self.parts = tuple(parts) or ((0, out_features),)
        self._kernel_by_rows: dict[int, Kernel] = {}
        """Which kernel runs a product of that many rows (:func:`_fastest_kernel`)."""
        self.same_shape: list[torch.Tensor] = [self.weight]
        """The matrices the kernels are timed on for this shape (:func:`time_together`)."""
        self.same_pass: list[torch.Tensor] = [self.weight]
        """The float32 matrices of a pass, in its order, on which requests ahead are timed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.blocked:  # quantized on another device or dtype: correct, not fast
            weight = self.weight if self.scales is None else self.plain_weight()
            return nn.functional.linear(x, weight, self.bias)
        rows = x.numel() // self.in_features
        kernel = self.kernel_at(rows)
        compiled = kernel != Kernel.BATCHED
        if self.weight_format in GROUPED_BITS:
            if compiled:
                return torch.ops.reader_spec.grouped_linear(
                    x, self.weight, self.scales, self.bias, self.in_features, self.out_features
                )
            return nn.functional.linear(x, self.plain_weight(), self.bias)  # no compiler, or past 512 rows
        if self.scales is not None:
            return self._forward_int8(x, rows, compiled)
        if compiled:
            return torch.ops.reader_spec.blocked_linear(
                x, self.weight, self.bias, self.out_features, kernel == Kernel.READING_AHEAD
            )
        flat = x.reshape(rows, self.in_features)
        return self._unblock(torch.matmul(flat, self.weight), x)

    def kernel_at(self, rows: int) -> Kernel:
        """Which kernel multiplies ``rows`` rows (blocked matrices; timed once per shape)."""
        kernel = self._kernel_by_rows.get(rows)
        if kernel is None:  # once per row count: a pass runs 100-200 products, each a few us of Python
            kernel = fastest_kernel(self.same_shape, rows, self.same_pass) if self.blocked else Kernel.BATCHED
            self._kernel_by_rows[rows] = kernel
        return kernel

    def _forward_int8(self, x: torch.Tensor, rows: int, compiled: bool) -> torch.Tensor:
        if compiled:
            return torch.ops.reader_spec.int8_linear(
                x, self.weight, self.scales, self.bias, self.in_features, self.out_features
            )
        # Without the compiled kernel: the blocks as floats, then the batched matmul, scaled per column.
        flat = x.reshape(rows, self.in_features)
        out = torch.matmul(flat, self._int8_blocks().to(flat.dtype)) * self.scales.view(-1, 1, BLOCK)
        return self._unblock(out, x)

    def _int8_blocks(self) -> torch.Tensor:
        """The grouped int8 matrix as signed ``[blocks, in, 32]``."""
        blocks, groups, _ = self.weight.shape
        grouped = self.weight.view(blocks, groups, BLOCK, INT8_GROUP).transpose(2, 3)
        signed = (grouped.to(torch.int16) - 128).to(torch.int8)
        return signed.reshape(blocks, groups * INT8_GROUP, BLOCK)[:, : self.in_features]

    def _unblock(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The batched matmul's ``[blocks or panels, rows, columns]`` as ``x``'s rows of outputs, plus the
        bias."""
        rows = out.shape[1]
        out = out.transpose(0, 1).reshape(rows, out.shape[0] * out.shape[2])
        out = out[:, : self.out_features]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        """A fused output's parts (views)."""
        return [out[..., start : start + size] for start, size in self.parts]

    def plain_weight(self) -> torch.Tensor:
        """The ``[out, in]`` matrix (a copy when blocked; dequantized, in the model's dtype, when
        quantized)."""
        if self.weight_format in GROUPED_BITS:
            return self._grouped_matrix()
        if not self.blocked:
            weight = self.weight
        else:
            blocks = self.weight if self.scales is None else self._int8_blocks()
            weight = blocks.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]
        if self.scales is not None:
            return weight.to(self.scales.dtype) * self.scales[: self.out_features, None]
        return weight if not self.blocked else weight.contiguous()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # A packed model saves what nn.Linear would: save_pretrained writes loadable files.
        destination[prefix + "weight"] = self.plain_weight()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias[: self.out_features]

    def rows_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rows of the plain matrix (an embedding lookup in a tied output layer; dequantized when
        quantized)."""
        if self.weight_format in GROUPED_BITS:
            return self._grouped_rows(tokens)
        if not self.blocked:
            rows = self.weight[tokens]
        elif self.scales is None:  # float32 blocks, on a CPU
            rows = self._blocked_rows(tokens)
        else:  # a column's bytes are [groups, 4] of its block: k in order once flattened
            columns = self.weight.view(*self.weight.shape[:2], BLOCK, INT8_GROUP)
            grouped = columns[tokens // BLOCK, :, tokens % BLOCK]  # [..., groups, 4]
            rows = grouped.flatten(-2)[..., : self.in_features].to(self.scales.dtype) - 128
        if self.scales is None:
            return rows
        return rows.to(self.scales.dtype) * self.scales[tokens].unsqueeze(-1)

    def _blocked_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rows of a float32 blocked matrix: each a column of its block, gathered in one compiled loop
        where the kernels are built (cheaper than indexing; docs/runner.md, "the host's bookkeeping
        around a pass and a step, cut further")."""
        if tokens.device.type == "cpu" and kernels.available():
            return torch.ops.reader_spec.blocked_rows(self.weight, tokens)
        return self.weight[tokens // PANEL, :, tokens % PANEL]

    def _grouped_matrix(self) -> torch.Tensor:
        """The whole matrix quantized per group, dequantized (``[out, in]`` in the model's dtype)."""
        if not self.blocked:
            return self._grouped_rows(torch.arange(self.out_features, device=self.weight.device))
        blocks, groups, _ = self.weight.shape
        if self.weight_format == "int4":
            halves = self.weight.view(blocks, groups, WEIGHT_GROUP // 2, 1, 2, 16)
            octets = torch.cat([halves & 15, halves >> 4], dim=3)  # columns 8 o + c: [..., 4 o, 8 c x 2 k]
            q = octets.view(blocks, groups, WEIGHT_GROUP // 2, BLOCK, 2).permute(0, 3, 1, 2, 4)
            pairs = self.scales.view(torch.float16).view(blocks, groups, 2, BLOCK)
            scale, minimum = pairs.permute(0, 3, 1, 2).float().unbind(-1)
        else:  # [..., pairs of k, column, k of the pair]
            q = self.weight.view(torch.int8).view(blocks, groups, WEIGHT_GROUP // 2, BLOCK, 2)
            q = q.permute(0, 3, 1, 2, 4)
            scale = self.scales.view(torch.float16).permute(0, 2, 1).float()
            minimum = torch.zeros_like(scale)
        values = (
            q.reshape(blocks, BLOCK, groups, WEIGHT_GROUP).float() * scale[..., None] + minimum[..., None]
        )
        return values.reshape(blocks * BLOCK, self.in_features)[: self.out_features]

    def _grouped_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` of the matrix quantized per group, dequantized (``[..., in]`` in the model's
        dtype): blocked, in one compiled loop where the kernels are built, or by the indexing below,
        which gives the same bits."""
        if self.blocked and rows.device.type == "cpu" and kernels.available():
            return torch.ops.reader_spec.grouped_rows(self.weight, self.scales, rows, self.in_features)
        groups = self.in_features // WEIGHT_GROUP
        if not self.blocked:
            q = self.weight[rows].view(*rows.shape, groups, WEIGHT_GROUP)
            scale, minimum = self.scales[rows].unbind(-1)
        elif self.weight_format == "int4":
            # column 8 h + c of 16 h' + 8 h + c: byte 16 h + 2 c + k of each pair, high nibble from 16
            column = rows % BLOCK
            pairs_of_k = self.weight[rows // BLOCK].view(*rows.shape, groups, WEIGHT_GROUP // 2, 32)
            first = (column % 16 // 8 * 16 + column % 8 * 2)[..., None, None, None]
            byte = pairs_of_k.gather(
                -1,
                (first + torch.arange(2, device=rows.device)).expand(
                    *rows.shape, groups, WEIGHT_GROUP // 2, 2
                ),
            )
            shift = (column // 16 * 4).to(torch.uint8)[..., None, None, None]
            q = ((byte >> shift) & 15).view(*rows.shape, groups, WEIGHT_GROUP)
            pairs = self.scales[rows // BLOCK].view(torch.float16).view(*rows.shape, groups, 2, BLOCK)
            picked = pairs.gather(-1, (rows % BLOCK)[..., None, None, None].expand(*rows.shape, groups, 2, 1))
            scale, minimum = picked.squeeze(-1).float().unbind(-1)
        else:  # column c's k j at byte 2 c + j of each pair of k
            column = (rows % BLOCK)[..., None, None, None, None]
            pairs_of_k = self.weight[rows // BLOCK].view(torch.int8)
            pairs_of_k = pairs_of_k.view(*rows.shape, groups, WEIGHT_GROUP // 2, BLOCK, 2)
            picked = pairs_of_k.gather(-2, column.expand(*rows.shape, groups, WEIGHT_GROUP // 2, 1, 2))
            q = picked.view(*rows.shape, groups, WEIGHT_GROUP)
            halves = self.scales[rows // BLOCK].view(torch.float16)  # [..., groups, 32]
            scale = halves.gather(-1, column[..., 0, 0].expand(*rows.shape, groups, 1)).squeeze(-1).float()
            minimum = torch.zeros_like(scale)
        dtype = torch.float32 if self.blocked else self.scales.dtype
        values = q.to(dtype) * scale.to(dtype)[..., None] + minimum.to(dtype)[..., None]
        return values.flatten(-2)

    def extra_repr(self) -> str:
        layout = "blocked" if self.blocked else "plain"
        stored = str(self.weight.dtype).removeprefix("torch.") if self.scales is None else self.weight_format
        return f"in_features={self.in_features}, out_features={self.out_features}, {layout}, {stored}"


def pack_linears(
    modules: Sequence[nn.Linear | PackedLinear],
    parts: Sequence[int] = (),
    weight_format: str = "float32",
    arena: PageArena | None = None,
) -> tuple[PackedLinear, list[PackedLinear]]:
    """One fused :class:`PackedLinear` over ``modules`` (same input), and a view of it for each.

    ``parts`` gives the sizes of the outputs of a single module that is already fused (Phi-3).
    ``weight_format`` is the storage format (:data:`WEIGHT_FORMATS`). ``modules`` may be packed already (a
    copy of a packed model, packed again in another format): their plain matrices are read.
    The originals' weights are freed one by one as they are packed: no second copy is kept. Blocked
    matrices are written into ``arena`` where one is given (:mod:`reader_spec.engine.memory`).
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}")
    if weight_format == "int4":
        weight_format = _grouped_format(modules)
    quantize = weight_format != "float32"
    blocked = _blocks(*_values_of(modules[0]))
    sizes = [m.out_features if isinstance(m, PackedLinear) else m.weight.shape[0] for m in modules]
    stored = [round_up(n) if blocked else n for n in sizes]
    has_bias = any(m.bias is not None for m in modules)
    matrices, biases, scales = [], [], []
    part_arena = arena if len(modules) == 1 else None  # parts of a fused matrix go there once joined
    for module, size, room in zip(modules, sizes, stored, strict=True):
        weight = _plain_of(module)
        if has_bias:
            bias = module.bias.detach()[:size] if module.bias is not None else weight.new_zeros(size)
            biases.append(torch.cat([bias, bias.new_zeros(room - size)]))
        matrix = weight
        if weight_format in GROUPED_BITS:
            matrix, scale = _grouped_parts(weight, weight_format, room, blocked, part_arena)
            scales.append(scale)
        elif quantize:
            matrix, scale = quantize_int8(weight)
            scales.append(torch.cat([scale, scale.new_zeros(room - size)]))
        if blocked and weight_format not in GROUPED_BITS:
            matrix = (to_groups if quantize else to_blocks)(matrix, room, part_arena)
        matrices.append(matrix)
        if blocked or quantize:
            release_file_pages(weight)
        del module.weight, weight, matrix
        if isinstance(module, PackedLinear) and module.scales is not None:
            del module.scales
    if len(matrices) == 1:
        fused = matrices[0]
    else:
        rows = sum(matrix.shape[0] for matrix in matrices)
        into = (
            None
            if arena is None or not blocked
            else arena.empty((rows, *matrices[0].shape[1:]), matrices[0].dtype)
        )
        fused = torch.cat(matrices, out=into)
    del matrices
    in_features = modules[0].in_features
    bias = None if not has_bias else biases[0] if len(biases) == 1 else torch.cat(biases)
    fused_scales = None if not quantize else scales[0] if len(scales) == 1 else torch.cat(scales)
    if len(modules) == 1:
        offsets = [0, *itertools.accumulate(parts)][:-1] if parts else [0]
        bias = None if bias is None else bias[: sizes[0]]
        part_sizes = list(zip(offsets, parts or sizes, strict=True))
        whole = PackedLinear(
            fused, bias, in_features, sizes[0], blocked, part_sizes, fused_scales, weight_format
        )
        return whole, [whole]
    starts = [0, *itertools.accumulate(stored)][:-1]
    part_sizes = list(zip(starts, sizes, strict=True))
    whole = PackedLinear(
        fused, bias, in_features, sum(stored), blocked, part_sizes, fused_scales, weight_format
    )
    views = []
    for start, size, room in zip(starts, sizes, stored, strict=True):
        unit = BLOCK if quantize else PANEL  # float32 blocks are stored as panels
        rows = slice(start // unit, (start + room) // unit) if blocked else slice(start, start + size)
        part_bias = None if bias is None else bias[start : start + size]
        part_scales = None
        if fused_scales is not None:  # grouped scales go by block (blocked) or row, int8's by column
            grouped = weight_format in GROUPED_BITS
            part_scales = fused_scales[rows] if grouped else fused_scales[start : start + room]
        views.append(
            PackedLinear(
                fused[rows],
                part_bias,
                in_features,
                size,
                blocked,
                scales=part_scales,
                weight_format=weight_format,
            )
        )
    return whole, views


def _values_of(module: nn.Linear | PackedLinear) -> tuple[torch.device, torch.dtype]:
    """The device and float dtype of the module's matrix (for the layout's choice)."""
    if isinstance(module, PackedLinear) and module.weight_format in GROUPED_BITS:  # blocked: float32 only
        return module.scales.device, torch.float32 if module.blocked else module.scales.dtype
    if isinstance(module, PackedLinear) and module.scales is not None:
        return module.scales.device, module.scales.dtype
    return module.weight.device, module.weight.dtype


def _plain_of(module: nn.Linear | PackedLinear) -> torch.Tensor:
    """The module's ``[out, in]`` float matrix, detached."""
    if isinstance(module, PackedLinear):
        return module.plain_weight().detach()
    return module.weight.detach()


def _blocks(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32


def _grouped_format(modules: Sequence[nn.Linear | PackedLinear]) -> str:
    """How the ``int4`` format stores these matrices, fused: int4 where every one fits
    (:func:`int4_fits`), else int8 per group, or per output row where the inputs are not whole groups."""
    if modules[0].in_features % WEIGHT_GROUP:
        return "int8"
    return "int4" if all(int4_fits(_plain_of(m)) for m in modules) else INT8_GROUPED


def _grouped_parts(
    weight: torch.Tensor, weight_format: str, rows: int, blocked: bool, arena: PageArena | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A matrix quantized per group as :class:`PackedLinear` stores it: blocked (:func:`to_nibbles`,
    :func:`to_grouped_int8`, padded to ``rows``) or plain (``q`` and ``[out, in / 32, 2]`` scales and
    minimums in the weight's dtype)."""
    if weight_format == "int4":
        q, scale, minimum = quantize_int4(weight)
        if blocked:
            return to_nibbles(q, scale, minimum, rows, arena)
    else:
        q, scale = quantize_int8_grouped(weight)
        if blocked:
            return to_grouped_int8(q, scale, rows, arena)
        minimum = torch.zeros_like(scale)
    return q, torch.stack([scale, minimum], dim=-1).to(weight.dtype)


def packed_bytes(module: nn.Linear | PackedLinear, weight_format: str) -> int:
    """The most bytes :func:`pack_linears` stores for this module's matrix in format ``weight_format``."""
    if weight_format in ("int8", "int4"):  # int4's matrices: 4 bits, or 8 (per group or output row)
        return round_up(module.out_features) * -(-module.in_features // INT8_GROUP) * INT8_GROUP
    return round_up(module.out_features) * module.in_features * 4


def time_together(linears: Sequence[PackedLinear]) -> None:
    """Have the kernels for each shape among ``linears`` timed on all its matrices, each read once per
    round, as a pass reads them: one matrix timed alone stays in the caches, where the batched matmul
    looked faster than in a pass (docs/runner.md, "Whole layers in one call, and a compiled attention").
    Whether the compiled kernel requests its weights ahead is timed on all of them in the given order, as
    a pass reads them: timed per shape, the small matrices (a layer's query/key/value and output
    projections) favoured requests that made whole passes of a few tokens slower (docs/runner.md,
    "requests ahead per row count on the whole pass")."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for linear in linears:
        groups.setdefault((tuple(linear.weight.shape), linear.weight.dtype), []).append(linear.weight)
    same_pass = [
        linear.weight for linear in linears if linear.blocked and linear.weight.dtype == torch.float32
    ]
    for linear in linears:
        linear.same_shape = groups[(tuple(linear.weight.shape), linear.weight.dtype)]
        linear.same_pass = same_pass
