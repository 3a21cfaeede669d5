"""Where packed weights live: huge pages from one arena, and no second copy of file-mapped weights."""

import sys

import pytest
import torch
from torch import nn

from reader_spec.engine.kv_cache import RaggedKVCache
from reader_spec.engine.memory import ALIGNMENT, HUGE_PAGE, PageArena, release_file_pages
from reader_spec.engine.weights import pack_linears

LINUX = sys.platform.startswith("linux")


def test_arena_tensors_are_aligned_apart_and_keep_their_values():
    arena = PageArena(3 * HUGE_PAGE)
    first = arena.empty((1000, 3), torch.float32)
    second = arena.empty((7,), torch.int8)
    third = arena.empty((2, 5), torch.float32)
    first.fill_(1.5), second.fill_(-3), third.fill_(2.0)
    storage = first.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in (second, third))
    assert first.data_ptr() % HUGE_PAGE == 0  # the arena starts on a huge page boundary
    assert second.data_ptr() - first.data_ptr() == 12_032  # 12,000 bytes, rounded up to 64
    assert (third.data_ptr() - first.data_ptr()) % ALIGNMENT == 0
    assert first.eq(1.5).all() and second.eq(-3).all() and third.eq(2.0).all()


def test_a_full_arena_hands_out_ordinary_memory():
    arena = PageArena(1024)
    inside = arena.empty((256,), torch.float32)
    outside = arena.empty((256,), torch.float32)
    assert outside.untyped_storage().data_ptr() != inside.untyped_storage().data_ptr()
    assert outside.shape == (256,)


def mapping_of(address: int) -> tuple[str, str]:
    """The permissions (``rw-p``: private) and the flags (``hg``: advised to use huge pages) of the
    mapping holding ``address``."""
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    for index, line in enumerate(lines):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:
            low, high = (int(part, 16) for part in fields[0].split("-"))
            if low <= address < high:
                flags = next(entry for entry in lines[index + 1 :] if entry.startswith("VmFlags"))
                return fields[1], flags
    raise LookupError(f"address {address:#x} is not mapped")


def advised_huge(address: int) -> bool:
    return " hg" in mapping_of(address)[1]


@pytest.mark.skipif(not LINUX, reason="reads /proc/self/smaps")
def test_the_arena_asks_for_huge_pages_on_private_memory():
    """Shared anonymous memory is shmem, which gets no transparent huge pages by default: an arena
    mapped shared had none at all (AnonHugePages 0 kB against 538 MB for the default model)."""
    arena = PageArena(4 * HUGE_PAGE)
    address = arena.empty((HUGE_PAGE,), torch.uint8).data_ptr()
    permissions, _ = mapping_of(address)
    assert advised_huge(address) and permissions.endswith("p")


@pytest.mark.skipif(not LINUX, reason="reads /proc/self/smaps")
def test_the_huge_page_advice_ends_with_the_arena():
    """From malloc's heap, a freed arena's advised region was handed on to later allocations (a KV
    cache landed on huge pages once in a test run); its own mapping is unmapped instead."""
    torch.empty(30 * 2**20, dtype=torch.uint8)  # freed: glibc now serves up to 30 MB from its heap
    arena = PageArena(4 * HUGE_PAGE)
    address = arena.empty((HUGE_PAGE,), torch.uint8).data_ptr()
    assert advised_huge(address)
    del arena
    with pytest.raises(LookupError):
        advised_huge(address)


def test_cache_buffers_start_zeroed_on_ordinary_pages():
    """A masked position's value still meets a zero weight, so it must be finite: zero. Huge pages
    took seconds to fault in for a batch of 32 rows, for 1-2% faster passes (docs/runner.md)."""
    cache = RaggedKVCache(num_layers=1, num_rows=4, capacity=4096)
    layer = cache.layers[0]
    cache.set_window([0], [1])
    layer.write(torch.ones(1, 2, 64), torch.ones(1, 2, 64))  # [4, 2, 4096, 64] float32: 8 MB each
    assert int(layer.keys.count_nonzero()) == 2 * 64 and int(layer.values.count_nonzero()) == 2 * 64
    if LINUX:
        assert not advised_huge(layer.keys.data_ptr()) and not advised_huge(layer.values.data_ptr())


def test_packed_matrices_are_written_into_the_arena_and_multiply_alike():
    torch.manual_seed(0)
    modules = [nn.Linear(64, n, bias=False) for n in (96, 40, 40)]
    reference = [m.weight.detach().clone() for m in modules]
    arena = PageArena(4 * HUGE_PAGE)
    fused, views = pack_linears(modules, arena=arena)
    marker = arena.empty((1,), torch.float32).untyped_storage().data_ptr()
    assert fused.weight.untyped_storage().data_ptr() == marker
    x = torch.randn(3, 64)
    for view, weight in zip(views, reference, strict=True):
        assert (view(x) - x @ weight.T).abs().max() < 1e-5


def _resident_file_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssFile"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
def test_a_copied_weight_mapped_from_a_file_leaves_memory_and_keeps_its_values(tmp_path):
    values = torch.arange(8 * 2**20, dtype=torch.float32)  # 32 MiB
    values.numpy().tofile(tmp_path / "weight.bin")
    mapped = torch.from_file(str(tmp_path / "weight.bin"), shared=False, size=values.numel())
    assert torch.equal(mapped, values)  # every page read: resident
    before = _resident_file_kib()
    release_file_pages(mapped)
    assert before - _resident_file_kib() > 30 * 1024
    assert torch.equal(mapped, values)  # read back from the file


def test_weights_in_anonymous_memory_are_left_alone():
    values = torch.arange(8 * 2**20, dtype=torch.float32)
    release_file_pages(values)
    assert torch.equal(values, torch.arange(8 * 2**20, dtype=torch.float32))
