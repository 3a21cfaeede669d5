"""A KV cache where every sequence of a batch keeps its own length.

Each sequence of a batch owns a preallocated row ``[heads, capacity, head_dim]`` per layer, for as
long as it decodes: a finished sequence frees its row for the next one, and nothing else moves. A
forward pass is packed: its tokens are the rows' trees back to back (``[1, total]``), and the cache
writes token ``t`` of row ``r``'s tree at ``length[r] + t`` of that row, then returns a view of the
buffers over the rows of the pass, so nothing is concatenated or copied per step. After
verification, :meth:`RaggedKVCache.commit` moves the accepted tree nodes next to the context (a
gather of a few entries per layer) and advances the length: rejected drafts leave neither holes
nor padding behind, and the per-step cost is proportional to the tree, never to the context.

The class plugs into ``transformers`` as a :class:`transformers.Cache`, so models run their own
attention code unchanged; the engine supplies the 4D mask that hides other rows' padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from reader_spec.engine import kernels
from reader_spec.engine.host import longs


class RaggedLayer(CacheLayerMixin):
    """One layer's buffers; the write window is owned by the parent cache."""

    is_compileable = False
    is_sliding = False

    def __init__(self, owner: RaggedKVCache) -> None:
        super().__init__()
        self.owner = owner
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Buffers shaped after a pass's keys and values (``[..., heads, tokens, head_dim]``)."""
        owner = self.owner
        shape = (owner.num_rows, key_states.shape[-3], owner.capacity)
        # Zeroed (a masked position's value still meets a zero weight) and on ordinary pages: huge
        # pages made passes barely faster and were slow to fault in at large batches (docs/runner.md,
        # "The AVX2 host again: row tiles, an integer head, the KV cache").
        self.keys = key_states.new_zeros((*shape, key_states.shape[-1]))
        self.values = value_states.new_zeros((*shape, value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """transformers' entry: ``[1, heads, tokens, head_dim]``."""
        self.write(key_states[0].transpose(0, 1), value_states[0].transpose(0, 1))
        return self.attended()

    def write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store a pass's keys and values (``[tokens, heads, head_dim]``) in place."""
        rows, positions = self.destination(keys, values)
        self.keys[rows, :, positions] = keys
        self.values[rows, :, positions] = values

    def destination(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache row and position of each token of the pass, the buffers allocated after ``keys``
        and ``values`` (``[tokens, heads, head_dim]``) if need be: for a caller that writes them itself."""
        if not self.is_initialized:
            self.lazy_initialization(keys.transpose(0, 1), values.transpose(0, 1))
        _, rows, positions, _ = self.owner.window()
        return rows, positions

    def attended(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the keys and values the pass attends to, ``[rows, heads, kv_length, head_dim]``."""
        span, _, _, kv_length = self.owner.window()
        return self.keys[span, :, :kv_length], self.values[span, :, :kv_length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.window()[3], 0

    def get_seq_length(self) -> int:
        return int(self.owner.lengths.max()) if self.owner.lengths.numel() else 0

    def get_max_length(self) -> int:
        return self.owner.capacity

    def grow(self, num_rows: int, capacity: int) -> None:
        if self.keys is not None:
            self.keys = _padded(self.keys, num_rows, capacity)
            self.values = _padded(self.values, num_rows, capacity)


def _padded(buffer: torch.Tensor, num_rows: int, capacity: int) -> torch.Tensor:
    """``buffer`` (``[rows, heads, capacity, dim]``) in a larger zeroed one."""
    grown = buffer.new_zeros((num_rows, buffer.shape[1], capacity, buffer.shape[3]))
    grown[: buffer.shape[0], :, : buffer.shape[2]] = buffer
    return grown


class RaggedKVCache(Cache):
    """Rows ``0..num_rows-1``, each with its own committed length.

    Usage per forward: :meth:`set_window` (which rows, how many new tokens), run the model, then
    :meth:`commit` the accepted entries of each row.
    """

    def __init__(self, num_layers: int, num_rows: int, capacity: int, device: torch.device | str = "cpu"):
        super().__init__(layers=[])
        self.layers = [RaggedLayer(self) for _ in range(num_layers)]
        self.num_rows = num_rows
        self.capacity = capacity
        self.device = torch.device(device)
        self.lengths = torch.zeros(num_rows, dtype=torch.long, device="cpu")
        self._span = slice(0, 0)
        self._rows: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._kv_length = 0

    @property
    def allocated(self) -> bool:
        """Whether every layer's buffers exist (a pass writing them allocates them)."""
        return all(layer.is_initialized for layer in self.layers)

    def lengths_of(self, rows: Sequence[int]) -> np.ndarray:
        """The committed lengths of ``rows``, read through numpy (the same memory): after a pass has
        swept the caches an indexed tensor read costs many times a numpy one (docs/runner.md, "inside the
        compiled stack; a pass's Python")."""
        return self.lengths.numpy()[rows]

    # --- the window of the next forward pass -------------------------------------------------
    def set_window(self, rows: list[int], widths: list[int]) -> int:
        """Prepare a packed forward over ``rows`` (ascending), ``widths[i]`` new tokens for ``rows[i]``.

        Returns the key length the attention mask must have: the longest context among the rows
        plus its new tokens. Layers return keys and values for the span ``rows[0]..rows[-1]``.
        """
        lengths = self.lengths_of(rows).tolist()
        kv_length = max(length + width for length, width in zip(lengths, widths, strict=True))
        if kv_length > self.capacity:
            self.reserve(kv_length)
        # Built as lists: a pass has at most a few hundred tokens, and each tensor op costs tens of
        # microseconds after a pass (host.py).
        token_rows = [row for row, width in zip(rows, widths, strict=True) for _ in range(width)]
        positions = [length + i for length, width in zip(lengths, widths, strict=True) for i in range(width)]
        self._rows = longs(token_rows, self.device)
        self._positions = longs(positions, self.device)
        self._span, self._kv_length = slice(rows[0], rows[-1] + 1), kv_length
        return kv_length

    def window(self) -> tuple[slice, torch.Tensor, torch.Tensor, int]:
        """The span of rows, the row and position of each new token, and the key length of the next pass."""
        if self._rows is None:
            raise RuntimeError("RaggedKVCache.set_window must be called before a forward pass")
        return self._span, self._rows, self._positions, self._kv_length

    @torch.inference_mode()
    def reserve(self, capacity: int) -> None:
        """Grow every row to hold ``capacity`` tokens (amortised by doubling)."""
        if capacity <= self.capacity:
            return
        self.capacity = max(capacity, 2 * self.capacity)
        for layer in self.layers:
            layer.grow(self.num_rows, self.capacity)

    def add_rows(self, num_rows: int) -> None:
        """Grow to ``num_rows`` rows, keeping every row's entries (a copy of the buffers: for
        owners whose number of sequences is not known up front, such as a draft model's cache)."""
        if num_rows <= self.num_rows:
            return
        with torch.inference_mode():
            for layer in self.layers:
                layer.grow(num_rows, self.capacity)
        self.lengths = torch.cat([self.lengths, self.lengths.new_zeros(num_rows - self.num_rows)])
        self.num_rows = num_rows

    # --- after verification ----------------------------------------------------------------------
    def commit(self, row: int, accepted: list[int]) -> None:
        """:meth:`commit_rows` for one row."""
        self.commit_rows([row], [accepted])

    @torch.inference_mode()
    def commit_rows(self, rows: Sequence[int], accepted: Sequence[list[int]]) -> None:
        """Keep, for each of ``rows`` (distinct), the written entries at window offsets ``accepted[i]``
        (ascending): entry ``accepted[i][j]`` moves to offset ``j`` and the row grows by
        ``len(accepted[i])``. Only the moved entries are touched, for the whole batch at once: on a
        CPU in one compiled call over every layer (two indexed copies a layer, each dear after a pass has
        swept the caches; docs/runner.md, "the host's bookkeeping around a pass and a step, cut further"),
        elsewhere in one indexed copy per buffer (per-row copies would be 60 kernel launches per row)."""
        rows = list(rows)
        starts = self.lengths_of(rows).tolist()
        moved_rows, destinations, sources = [], [], []
        for row, start, kept in zip(rows, starts, accepted, strict=True):
            for offset, entry in enumerate(kept):
                if offset != entry:
                    moved_rows.append(row)
                    destinations.append(start + offset)
                    sources.append(start + entry)
        if moved_rows:
            self._move(moved_rows, destinations, sources)
        self.lengths.numpy()[rows] += [len(kept) for kept in accepted]

    def _move(self, rows: list[int], destinations: list[int], sources: list[int]) -> None:
        """Entry ``sources[i]`` of row ``rows[i]`` to ``destinations[i]`` in every buffer, all read first."""
        buffers = [
            buffer for layer in self.layers if layer.keys is not None for buffer in (layer.keys, layer.values)
        ]
        if buffers and self.device.type == "cpu" and kernels.available():
            torch.ops.reader_spec.move_entries(buffers, *map(longs, (rows, destinations, sources)))
            return
        row_index, dst, src = (longs(t, self.device) for t in (rows, destinations, sources))
        for buffer in buffers:
            buffer[row_index, :, dst] = buffer[row_index, :, src]

    @torch.inference_mode()
    def copy_row(self, src: int, dst: int, length: int | None = None) -> None:
        """Copy a row's first ``length`` entries (default: its committed ones) into another row, which
        then holds those (the cost probe fills rows from one prefill; a request reuses another's prefix)."""
        length = int(self.lengths[src]) if length is None else length
        for layer in self.layers:
            if layer.keys is not None:
                layer.keys[dst, :, :length] = layer.keys[src, :, :length]
                layer.values[dst, :, :length] = layer.values[src, :, :length]
        self.lengths[dst] = length

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length()

    @property
    def is_compileable(self) -> bool:
        return False
