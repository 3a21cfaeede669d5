"""How the fast runner stores and multiplies every weight matrix: the one place that decides it.

A verification pass multiplies between one and a few dozen rows by each matrix, where PyTorch's
default ``F.linear`` takes slow paths on some CPUs (several times the bandwidth floor at 2 to 16
rows). On a CPU, float32 matrices are stored in column blocks (``[out / 32, in, 32]``): each block is
read from memory once and multiplied by every row of the pass. Two kernels read that layout, the
compiled one of :mod:`reader_spec.engine.kernels` and PyTorch's batched matmul; which one runs for
a given matrix shape and row count is decided by timing both once per process. Other devices and
dtypes keep the plain layout and ``F.linear``.

Packing replaces the model's ``nn.Linear`` modules by :class:`PackedLinear` modules (the model's own
forward still runs) and frees the originals, so no second copy of the weights is kept. Projections
that read the same input (query/key/value, gate/up) share one fused matrix; each original module
becomes a view of its rows.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import mmap
import sys
import time
from collections.abc import Sequence

import torch
from torch import nn

from reader_spec.engine import kernels

BLOCK = kernels.BLOCK
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
"""Row counts at which the kernels are timed; a pass uses the choice of the next bucket up."""


class PackedLinear(nn.Module):
    """``F.linear(x, W, b)`` with ``W`` stored for the shapes the engine runs.

    ``blocked``: ``weight`` is ``[blocks, in, 32]`` (CPU, float32), else the plain matrix. A fused
    matrix knows where its parts' outputs lie (``parts``: start and size of each), for :meth:`split`.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        out_features: int,
        blocked: bool,
        parts: Sequence[tuple[int, int]] = (),
    ):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features = out_features
        self.in_features = weight.shape[1]
        self.blocked = blocked
        self.parts = tuple(parts) or ((0, out_features),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.blocked:
            return nn.functional.linear(x, self.weight, self.bias)
        rows = x.numel() // self.in_features
        if _compiled_wins(self.weight, rows):
            return torch.ops.reader_spec.blocked_linear(x, self.weight, self.bias, self.out_features)
        flat = x.reshape(rows, self.in_features)
        out = torch.matmul(flat, self.weight).transpose(0, 1).reshape(rows, self.weight.shape[0] * BLOCK)
        out = out[:, : self.out_features]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        """A fused output's parts (views)."""
        return [out[..., start : start + size] for start, size in self.parts]

    def plain_weight(self) -> torch.Tensor:
        """The ``[out, in]`` matrix (a copy when blocked)."""
        if not self.blocked:
            return self.weight
        return self.weight.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features].contiguous()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # A packed model saves what nn.Linear would: save_pretrained writes loadable files.
        destination[prefix + "weight"] = self.plain_weight()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias[: self.out_features]

    def rows_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rows of the plain matrix (an embedding lookup in a tied output layer)."""
        if not self.blocked:
            return self.weight[tokens]
        return self.weight[tokens // BLOCK, :, tokens % BLOCK]

    def extra_repr(self) -> str:
        layout = "blocked" if self.blocked else "plain"
        return f"in_features={self.in_features}, out_features={self.out_features}, {layout}"


def pack_linears(
    modules: Sequence[nn.Linear], parts: Sequence[int] = ()
) -> tuple[PackedLinear, list[PackedLinear]]:
    """One fused :class:`PackedLinear` over ``modules`` (same input), and a view of it for each.

    ``parts`` gives the sizes of the outputs of a single module that is already fused (Phi-3).
    The originals' weights are freed one by one as they are packed: no second copy is kept.
    """
    blocked = _blocks(modules[0].weight)
    sizes = [m.weight.shape[0] for m in modules]
    stored = [_round_up(n) if blocked else n for n in sizes]
    has_bias = any(m.bias is not None for m in modules)
    weights, biases = [], []
    for module, size, room in zip(modules, sizes, stored, strict=True):
        weight = module.weight.detach()
        weights.append(_to_blocks(weight, room) if blocked else weight)
        if has_bias:
            bias = module.bias.detach() if module.bias is not None else weight.new_zeros(size)
            biases.append(torch.cat([bias, bias.new_zeros(room - size)]))
        if blocked:
            release_file_pages(weight)
        del module.weight, weight
    fused = weights[0] if len(weights) == 1 else torch.cat(weights)
    del weights
    bias = None if not has_bias else biases[0] if len(biases) == 1 else torch.cat(biases)
    if len(modules) == 1:
        offsets = [0, *itertools.accumulate(parts)][:-1] if parts else [0]
        bias = None if bias is None else bias[: sizes[0]]
        whole = PackedLinear(fused, bias, sizes[0], blocked, list(zip(offsets, parts or sizes, strict=True)))
        return whole, [whole]
    starts = [0, *itertools.accumulate(stored)][:-1]
    whole = PackedLinear(fused, bias, sum(stored), blocked, list(zip(starts, sizes, strict=True)))
    views = []
    for start, size, room in zip(starts, sizes, stored, strict=True):
        rows = slice(start // BLOCK, (start + room) // BLOCK) if blocked else slice(start, start + size)
        part_bias = None if bias is None else bias[start : start + size]
        views.append(PackedLinear(fused[rows], part_bias, size, blocked))
    return whole, views


def _blocks(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def _round_up(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def _to_blocks(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``[rows / 32, in, 32]``, the matrix padded with zero rows to ``rows``."""
    out_features, in_features = weight.shape
    if rows != out_features:
        weight = torch.cat([weight, weight.new_zeros(rows - out_features, in_features)])
    return weight.view(rows // BLOCK, BLOCK, in_features).transpose(1, 2).contiguous()


def release_file_pages(tensor: torch.Tensor) -> None:
    """Drop a copied weight's pages from memory where they are mapped from a file.

    transformers maps safetensors files: a weight is read from the file's pages, which stay resident
    as long as any tensor of the file lives (every norm does). Packing copies each matrix, so without
    this the process would hold the file's pages and the packed copy at once. Only whole pages inside
    the tensor, of a mapping backed by a file, are dropped: the kernel reads them back from the file
    if anything touches them again (weights are never written in place). Anywhere else (anonymous
    memory, other systems) this does nothing.
    """
    if _madvise is None or tensor.device.type != "cpu":
        return
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    if not any(low <= start and end <= high for low, high in _file_mappings()):
        return
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page
    if last > first:
        _madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED)


MADV_DONTNEED = 4


def _libc_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None


_madvise = _libc_madvise()


def _file_mappings() -> list[tuple[int, int]]:
    """Address ranges of this process mapped from files (``/proc/self/maps``)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) < 6 or not fields[5].startswith("/"):
                continue
            low, high = (int(part, 16) for part in fields[0].split("-"))
            ranges.append((low, high))
    return ranges


_CHOICES: dict[tuple[int, int], dict[int, bool]] = {}


def _compiled_wins(weight: torch.Tensor, rows: int) -> bool:
    """Whether the compiled kernel beats the batched matmul for this shape and row count (timed once)."""
    key = (weight.shape[0], weight.shape[1])
    choices = _CHOICES.get(key)
    if choices is None:
        choices = _CHOICES[key] = _time_kernels(weight) if kernels.available() else {}
    bucket = next((b for b in ROW_BUCKETS if b >= rows), None)
    return choices.get(bucket, False)


def _time_kernels(weight: torch.Tensor, rounds: int = 5) -> dict[int, bool]:
    """Time both kernels at each row bucket, alternating them so that load from elsewhere hits both
    alike; each kernel's fastest round counts."""
    blocked_linear = torch.ops.reader_spec.blocked_linear
    out_features = weight.shape[0] * BLOCK
    choices = {}
    with torch.inference_mode():
        for rows in ROW_BUCKETS:
            x = torch.randn(rows, weight.shape[1])
            kernels = (
                functools.partial(blocked_linear, x, weight, None, out_features),
                functools.partial(torch.matmul, x, weight),
            )
            best = [float("inf")] * len(kernels)
            for _ in range(rounds):
                for i, kernel in enumerate(kernels):
                    start = time.perf_counter()
                    kernel()
                    best[i] = min(best[i], time.perf_counter() - start)
            choices[rows] = best[0] <= best[1]
    return choices
