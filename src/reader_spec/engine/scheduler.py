"""Which requests decode in the next step: waiting ones take free KV-cache rows in arrival order."""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from reader_spec.config import GenerationConfig
from reader_spec.engine.sequence import Sequence


@dataclass(frozen=True)
class Request:
    """A request that has not started decoding yet."""

    key: int
    request_id: object
    tokens: list[int]
    config: GenerationConfig


class Scheduler:
    """Waiting requests (first come, first served) and the running batch, in ascending cache rows.

    A finished or cancelled sequence frees its row at once; nothing else moves.
    """

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self.waiting: deque[Request] = deque()
        self.running: list[Sequence] = []
        self.free_rows = list(range(num_rows))

    def __len__(self) -> int:
        """Requests not finished: waiting or running."""
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def admit(self) -> list[tuple[int, Request]]:
        """The waiting requests that start now, each with the row it takes."""
        admitted = []
        while self.waiting and self.free_rows:
            admitted.append((self.free_rows.pop(0), self.waiting.popleft()))
        return admitted

    def start(self, seq: Sequence) -> None:
        bisect.insort(self.running, seq, key=lambda s: s.row)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        bisect.insort(self.free_rows, seq.row)

    def cancel(self, key: int) -> Sequence | Request | None:
        """Drop a request wherever it is; a running one's row is freed. None if unknown or done."""
        for request in self.waiting:
            if request.key == key:
                self.waiting.remove(request)
                return request
        for seq in self.running:
            if seq.key == key:
                self.finish(seq)
                return seq
        return None

    def grow(self, num_rows: int) -> None:
        """Allow up to ``num_rows`` running sequences (the cache must have as many rows)."""
        if num_rows > self.num_rows:
            self.free_rows.extend(range(self.num_rows, num_rows))
            self.num_rows = num_rows
