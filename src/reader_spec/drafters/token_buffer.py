"""A request's token ids in one numpy buffer that the drafters' vectorized searches read in place."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class TokenBuffer:
    """Token ids with amortized O(1) appends (the buffer doubles) and a zero-copy view.

    Slots past the last token hold ``fill`` and at least ``spare`` of them are kept, so a search may
    read that far past the end without a bounds check (the suffix drafter's sentinel after the last
    sequence).
    """

    def __init__(self, tokens: Sequence[int] = (), fill: int = 0, spare: int = 0) -> None:
        initial = np.asarray(tokens, dtype=np.int32)
        self.fill = fill
        self.spare = spare
        self._buffer = np.full(max(2 * len(initial), 64, len(initial) + spare), fill, dtype=np.int32)
        self._buffer[: len(initial)] = initial
        self._length = len(initial)

    def __len__(self) -> int:
        return self._length

    @property
    def buffer(self) -> np.ndarray:
        """The whole buffer: the tokens, then ``fill`` (at least ``spare`` slots of it)."""
        return self._buffer

    def view(self) -> np.ndarray:
        """The tokens (a view, valid until the next append)."""
        return self._buffer[: self._length]

    def extend(self, tokens: Sequence[int] | np.ndarray) -> None:
        new = np.asarray(tokens, dtype=np.int32)
        end = self._length + len(new)
        if end + self.spare > len(self._buffer):
            grown = np.full(max(2 * len(self._buffer), end + self.spare), self.fill, dtype=np.int32)
            grown[: self._length] = self._buffer[: self._length]
            self._buffer = grown
        self._buffer[self._length : end] = new
        self._length = end
