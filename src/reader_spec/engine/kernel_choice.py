"""Which kernel multiplies a blocked float32 matrix at a row count, chosen by timing on this machine.

Two kernels read the blocked layout (:mod:`reader_spec.engine.weights`): the compiled one of
:mod:`reader_spec.engine.kernels`, with or without requests for its weights ahead of its multiply-adds,
and PyTorch's batched matmul. Which is fastest depends on the processor, the matrix shape and the row
count, so each is timed once per process, when a pass first needs it, per shape and row bucket, on
every matrix of that shape as a pass reads them.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Sequence

import torch

from reader_spec.engine import kernels
from reader_spec.engine.layouts import PANEL
from reader_spec.engine.timing import best_times

ROW_BUCKETS = (1, 2, 4, 8, 12, 16, 32, 64, 128, 256, 512)
"""Row counts at which the kernels are timed; a pass uses the choice of the next bucket up (larger
passes, the batched matmul). 12 is the most rows one AVX-512 tile holds: up to it a product reads
its matrix once from memory in one stream, beyond it in several tiles, and whether requesting the
weights ahead pays differs between the two (docs/runner.md, "Requests into L2, timed per row count").
The largest covers a prompt's chunk (``runner.PREFILL_CHUNK``): PyTorch's batched matmul is near this
CPU's matrix rate on some processors and far below the compiled kernel's on others (docs/runner.md,
"On an AMD EPYC host")."""
AHEAD_TIMED_ROWS = 8
"""Up to this many rows whether the compiled kernel requests its weights ahead is timed at each row
count on the whole pass, not per bucket and shape: the answer turns within a few rows (docs/runner.md,
"requests ahead per row count on the whole pass"). Beyond 8 rows it held across each bucket in that
measurement (and AVX2's products of more than 7 rows make their own requests, whatever is chosen)."""
COMPUTE_BOUND_ROWS = 128
"""From this many rows a product is bound by arithmetic, not by reading its matrix: the kernels are
timed on one matrix of the shape, which caches cannot flatter, in fewer rounds."""
BATCHED_MARGIN = 1.1
"""The batched matmul runs a row bucket only where it timed at least this much faster: timed products
run back to back, while in a pass each follows other work, and there the compiled kernel did better
than timed (docs/runner.md, "Whole layers in one call, and a compiled attention")."""


class Kernel(enum.IntEnum):
    """Which kernel multiplies a blocked matrix at a row count (``PackedLinear.kernel_at``); the
    compiled decoder layers take the same numbers."""

    BATCHED = 0
    """PyTorch's batched matmul over the blocks (float32)."""
    COMPILED = 1
    """The compiled kernel, leaving it to the hardware's prefetcher to read the weights ahead."""
    READING_AHEAD = 2
    """The compiled kernel, requesting each block's weights into L2 a few KB ahead of its multiply-adds
    (float32): where the hardware's prefetcher alone leaves the memory idle part of the time
    (docs/runner.md, "Requests into L2, timed per row count"), while on other processors it only adds
    work."""


_CHOICES: dict[tuple[int, int], dict[int, Kernel]] = {}
_READS_AHEAD: dict[tuple[tuple[int, ...], ...], dict[int, bool]] = {}


def row_bucket(rows: int) -> int | None:
    """The bucket whose timed choice a pass of ``rows`` rows takes (None: past the last bucket)."""
    return next((bucket for bucket in ROW_BUCKETS if bucket >= rows), None)


def kernel_rows(max_rows: int) -> list[int]:
    """The row counts at which kernel choices are timed for passes of up to ``max_rows`` rows: each up
    to :data:`AHEAD_TIMED_ROWS`, then the buckets (through the one holding ``max_rows``)."""
    largest = row_bucket(max_rows) or ROW_BUCKETS[-1]
    exact = range(1, min(AHEAD_TIMED_ROWS, largest) + 1)
    return [*exact, *(b for b in ROW_BUCKETS if AHEAD_TIMED_ROWS < b <= largest)]


def fastest_kernel(weights: Sequence[torch.Tensor], rows: int, same_pass: Sequence[torch.Tensor]) -> Kernel:
    """The kernel for this shape and row count (timed once per process, when a pass first needs it, on
    ``weights``, every matrix of that shape, per row bucket; up to :data:`AHEAD_TIMED_ROWS` rows,
    whether the compiled kernel requests ahead is timed at the row count itself, on ``same_pass``).

    Integer weights (int8, and int4 or int8 per group, all stored as bytes): the compiled kernel up to
    the last row bucket, whenever it is built (the batched matmul first converts the whole matrix to
    float); beyond, where that conversion is paid once for many rows, the batched matmul, as for
    float32.
    """
    if weights[0].dtype == torch.uint8:
        return Kernel.COMPILED if rows <= ROW_BUCKETS[-1] and kernels.available() else Kernel.BATCHED
    bucket = row_bucket(rows)
    if bucket is None or not kernels.available():
        return Kernel.BATCHED
    choices = _CHOICES.setdefault((weights[0].shape[0], weights[0].shape[1]), {})
    if bucket not in choices:
        choices[bucket] = _time_kernels(weights, bucket)
    if choices[bucket] == Kernel.BATCHED or rows > AHEAD_TIMED_ROWS:
        return choices[bucket]
    return Kernel.READING_AHEAD if _reads_ahead(same_pass, rows) else Kernel.COMPILED


def _reads_ahead(same_pass: Sequence[torch.Tensor], rows: int) -> bool:
    """Whether the compiled kernel requests its weights ahead at ``rows`` rows (at most
    :data:`AHEAD_TIMED_ROWS`; timed once per process and row count)."""
    choices = _READS_AHEAD.setdefault(tuple(tuple(w.shape) for w in same_pass), {})
    if rows not in choices:
        choices[rows] = _time_reading_ahead(same_pass, rows)
    return choices[rows]


def _time_reading_ahead(same_pass: Sequence[torch.Tensor], rows: int) -> bool:
    """Whether ``rows`` rows times every matrix of ``same_pass`` in turn ran faster with requests ahead
    (the first of equals: without). Inputs come from a private generator, as in :func:`_time_kernels`."""
    blocked_linear = torch.ops.reader_spec.blocked_linear
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        inputs = {
            k: torch.randn(rows, k, generator=generator, device="cpu")
            for k in sorted({w.shape[1] for w in same_pass})
        }

        def stream(ahead: bool) -> Callable[[], None]:
            return lambda: [
                blocked_linear(inputs[w.shape[1]], w, None, w.shape[0] * PANEL, ahead) for w in same_pass
            ]

        without, ahead = best_times([stream(False), stream(True)])
    return ahead < without


def _time_kernels(weights: Sequence[torch.Tensor], rows: int) -> Kernel:
    """The fastest kernel at ``rows`` rows, over all ``weights`` in turn (one of them where products
    are compute-bound, and there without requests ahead, which only speed up reading the matrix; up to
    :data:`AHEAD_TIMED_ROWS` rows also without, the requests being timed on the whole pass).
    Inputs come from a private generator: the first pass of a process must not move the caller's
    random state (seeded sampling)."""
    blocked_linear = torch.ops.reader_spec.blocked_linear
    out_features = weights[0].shape[0] * PANEL
    compute_bound = rows >= COMPUTE_BOUND_ROWS
    timed = weights[:1] if compute_bound else weights
    generator = torch.Generator().manual_seed(0)

    def each(product: Callable[[torch.Tensor], object]) -> Callable[[], None]:
        return lambda: [product(weight) for weight in timed]

    plain_only = compute_bound or rows <= AHEAD_TIMED_ROWS
    candidates = [Kernel.COMPILED] if plain_only else [Kernel.COMPILED, Kernel.READING_AHEAD]
    with torch.inference_mode():
        x = torch.randn(rows, weights[0].shape[1], generator=generator, device="cpu")
        compiled = [
            each(functools.partial(blocked_linear, x, bias=None, out_features=out_features, ahead=ahead))
            for ahead in (kernel == Kernel.READING_AHEAD for kernel in candidates)
        ]
        batched = each(functools.partial(torch.matmul, x))
        *compiled_times, batched_time = best_times([*compiled, batched], rounds=3 if compute_bound else 5)
    fastest = compiled_times.index(min(compiled_times))  # the first of equals: no requests
    if compiled_times[fastest] > BATCHED_MARGIN * batched_time:
        return Kernel.BATCHED
    return candidates[fastest]
