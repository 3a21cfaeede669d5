"""The ragged KV cache keeps what verification accepted, in place, for a whole batch at once."""

from __future__ import annotations

import pytest
import torch

from reader_spec.engine import kernels
from reader_spec.engine.kv_cache import RaggedKVCache
from tests.conftest import KERNELS_MISSING


@pytest.fixture(params=["compiled", "indexed"])
def moves(request, monkeypatch):
    """Commits run both ways a cache moves entries: the compiled call on a CPU, indexed copies elsewhere."""
    if request.param == "indexed":
        monkeypatch.setattr(kernels, "available", lambda: False)
    elif not kernels.available():
        pytest.fail(KERNELS_MISSING)
    return request.param


def _filled_cache(num_layers: int, rows: int, capacity: int, lengths: list[int]) -> RaggedKVCache:
    """A cache on the tests' device, its entries drawn on the CPU (the same everywhere)."""
    device = torch.get_default_device()
    cache = RaggedKVCache(num_layers, rows, capacity, device=device)
    generator = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        layer.keys = torch.randn(rows, 2, capacity, 4, generator=generator, device="cpu").to(device)
        layer.values = torch.randn(rows, 2, capacity, 4, generator=generator, device="cpu").to(device)
        layer.is_initialized = True
    cache.lengths[:] = torch.tensor(lengths)
    return cache


def test_commit_rows_moves_each_rows_accepted_entries_into_place(moves):
    lengths = [5, 9, 3, 7]
    cache = _filled_cache(3, 4, 24, lengths)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    accepted = {0: [0, 2, 5], 1: [0], 3: [0, 1, 3, 4]}  # row 2 runs no step; row 1 keeps only its root
    cache.commit_rows(list(accepted), list(accepted.values()))
    assert cache.lengths.tolist() == [5 + 3, 9 + 1, 3, 7 + 4]
    for layer, (keys, values) in zip(cache.layers, before, strict=True):
        for row in range(4):
            start = lengths[row]
            kept = accepted.get(row, [])
            expected_keys, expected_values = keys[row].clone(), values[row].clone()
            for offset, entry in enumerate(kept):
                expected_keys[:, start + offset] = keys[row, :, start + entry]
                expected_values[:, start + offset] = values[row, :, start + entry]
            end = start + len(kept)
            assert torch.equal(layer.keys[row, :, :end], expected_keys[:, :end])
            assert torch.equal(layer.values[row, :, :end], expected_values[:, :end])


def test_commit_of_one_row_leaves_the_others_alone(moves):
    cache = _filled_cache(2, 3, 16, [4, 4, 4])
    before = [layer.keys.clone() for layer in cache.layers]
    cache.commit(1, [0, 3])
    assert cache.lengths.tolist() == [4, 6, 4]
    for layer, keys in zip(cache.layers, before, strict=True):
        assert torch.equal(layer.keys[[0, 2]], keys[[0, 2]])
        assert torch.equal(layer.keys[1, :, 5], keys[1, :, 7])


def test_compiled_moves_read_every_entry_before_writing_like_an_indexed_copy(on_cpu, compiled_kernels):
    """Entries that trade places (never in a commit, whose entries only move down) end up swapped, as
    an indexed copy leaves them; entries outside a buffer are refused before anything moves."""
    generator = torch.Generator().manual_seed(1)
    buffers = [torch.randn(3, 2, 8, 5, generator=generator) for _ in range(4)]
    expected = [buffer.clone() for buffer in buffers]
    rows, destinations, sources = torch.tensor([2, 2, 0]), torch.tensor([1, 6, 3]), torch.tensor([6, 1, 0])
    for buffer in expected:
        buffer[rows, :, destinations] = buffer[rows, :, sources]
    torch.ops.reader_spec.move_entries(buffers, rows, destinations, sources)
    for buffer, wanted in zip(buffers, expected, strict=True):
        assert torch.equal(buffer, wanted)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.reader_spec.move_entries(buffers, rows, destinations, torch.tensor([6, 1, 8]))
    for buffer, wanted in zip(buffers, expected, strict=True):
        assert torch.equal(buffer, wanted)
