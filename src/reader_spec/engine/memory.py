"""Where the fast runner's weights live in memory: page-level choices the packing step makes.

Two of them, both through ``madvise`` on Linux (elsewhere they do nothing and weights live in
ordinary memory):

- Packed matrices are carved from one :class:`PageArena` backed by 2 MB pages (transparent huge
  pages). A pass streams every matrix once; with 4 KB pages that is a TLB miss every 4 KB, whose page
  walk the prefetchers cannot run ahead of, so huge pages make whole passes faster (docs/runner.md,
  "Huge pages for the weights").
- The model's original weights, copied by packing, are dropped from memory where they are mapped
  from a file (:func:`release_file_pages`), so that packing keeps no second copy.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys

import torch

HUGE_PAGE = 2 * 2**20
"""The size of a transparent huge page on x86-64 and most arm64 systems."""
ALIGNMENT = 64
"""Bytes between the starts of two arena tensors are a multiple of this (a cache line)."""
MADV_DONTNEED = 4
MADV_HUGEPAGE = 14


def _libc_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None


_madvise = _libc_madvise()


def _anonymous_private(size: int) -> mmap.mmap:
    if hasattr(mmap, "MAP_PRIVATE"):  # Unix; Windows maps anonymous memory privately anyway
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
    return mmap.mmap(-1, size)


class PageArena:
    """Tensors carved one after another from a single allocation whose pages are huge where possible.

    ``capacity`` may overestimate: a page is only backed by memory once written, so what is never used
    costs address space, not memory. A request that does not fit gets ordinary memory.
    """

    def __init__(self, capacity: int):
        # A mapping of its own, not memory from malloc: the huge-page advice ends with the arena, where
        # a freed heap region would keep it and hand it on to later allocations (a KV cache's buffers).
        # Private: shared anonymous memory is shmem, which gets no transparent huge pages by default.
        self._buffer = torch.frombuffer(_anonymous_private(capacity + HUGE_PAGE), dtype=torch.uint8)
        self._offset = -self._buffer.data_ptr() % HUGE_PAGE  # the first huge page boundary
        self._end = self._offset + capacity
        if _madvise is not None and capacity >= HUGE_PAGE:
            start = self._buffer.data_ptr() + self._offset
            _madvise(
                ctypes.c_void_p(start), ctypes.c_size_t(capacity // HUGE_PAGE * HUGE_PAGE), MADV_HUGEPAGE
            )

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor in the arena (in ordinary memory once the arena is full)."""
        size = math.prod(shape) * dtype.itemsize
        if self._offset + size > self._end:
            return torch.empty(shape, dtype=dtype, device="cpu")
        tensor = self._buffer[self._offset : self._offset + size].view(dtype).view(shape)
        self._offset += -(-size // ALIGNMENT) * ALIGNMENT
        return tensor


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
