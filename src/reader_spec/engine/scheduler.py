"""Which requests decode in the next step: waiting ones take free KV-cache rows in arrival order.

A finished request's row keeps the keys and values of its text until another request takes it, so a
request that starts with that text (the next turn of a conversation, a shared document, an agent
resending its history) prefills only what follows: prefix reuse, as vLLM and SGLang cache prefixes, in
a ragged cache whose unit is a row. A continuation takes the row itself; a request that shares only
the row's beginning (another question about the same document) gets that beginning copied into an
empty row, so that the row stays for its own next turn (a copy of a few thousand entries costs far
less than a forward pass over them). A request may also copy the beginning of a running request's
prompt, or of one starting in the same step (the choices of one OpenAI request, clients sharing a
system prompt): that row's prompt is prefilled before the copy and stays until the row is freed.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from reader_spec.config import GenerationConfig
from reader_spec.engine.sequence import DecodingSequence


@dataclass(frozen=True)
class Request:
    """A request that has not started decoding yet."""

    key: int
    request_id: object
    tokens: list[int]
    config: GenerationConfig


@dataclass(frozen=True)
class Admission:
    """A request that starts now, in ``row``, whose first ``reused`` tokens that row holds already, or
    will once they are copied from row ``source``."""

    row: int
    request: Request
    reused: int = 0
    source: int | None = None


class Scheduler:
    """Waiting requests (first come, first served) and the running batch, in ascending cache rows.

    A finished or cancelled sequence frees its row at once; nothing else moves. With ``reuse_prefixes``
    a free row remembers the tokens whose keys and values it holds, and a request reuses the longest
    prefix any of them holds: in that row where taking it discards no more than it reuses, else
    copied into an empty row where there is one. A request that reuses nothing takes an empty row, or
    the one freed longest ago.
    """

    def __init__(self, num_rows: int, reuse_prefixes: bool = True) -> None:
        self.num_rows = num_rows
        self.reuse_prefixes = reuse_prefixes
        self.waiting: deque[Request] = deque()
        self.running: list[DecodingSequence] = []
        self.free_rows = list(range(num_rows))
        self.held: dict[int, tuple[list[int], int]] = {}
        """Free rows that hold a finished request's text: its tokens and when it was freed."""
        self._frees = itertools.count()

    def __len__(self) -> int:
        """Requests not finished: waiting or running."""
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def admit(self) -> list[Admission]:
        """The waiting requests that start now, each with the row it takes, in the order their
        prefills must run (a copy from a row starting in this step follows that row's prefill)."""
        admitted: list[Admission] = []
        while self.waiting and self.free_rows:
            admission = self._place(self.waiting.popleft(), admitted)
            self.free_rows.remove(admission.row)
            self.held.pop(admission.row, None)
            admitted.append(admission)
        return admitted

    def _place(self, request: Request, starting: list[Admission]) -> Admission:
        """Where ``request`` starts. The last prompt token is never reused: it is the root of the first
        verified tree, whose pass computes it."""
        wanted = request.tokens[:-1]
        reused = {row: common_prefix(held, wanted) for row, (held, _) in self.held.items()}
        empty = [row for row in self.free_rows if row not in self.held]
        best = max(reused, key=lambda row: (reused[row], -self.held[row][1]), default=None)
        oldest = min(self.held, key=lambda row: self.held[row][1], default=None)
        live, shared = self._longest_live_prefix(wanted, starting) if self.reuse_prefixes else (None, 0)
        if live is not None and shared > (reused[best] if best is not None else 0):
            return Admission(empty[0] if empty else oldest, request, shared, source=live)
        if best is None or reused[best] == 0:
            return Admission(empty[0] if empty else oldest, request)
        discarded = len(self.held[best][0]) - reused[best]
        if discarded <= reused[best] or not empty:
            return Admission(best, request, reused[best])
        return Admission(empty[0], request, reused[best], source=best)

    def _longest_live_prefix(self, wanted: list[int], starting: list[Admission]) -> tuple[int | None, int]:
        """The row, running or starting in this step, whose prompt (all but its last token, what its
        prefill writes) begins with the longest part of ``wanted``, and that part's length."""
        prompts = [(seq.row, seq.tokens[: seq.prompt_length - 1]) for seq in self.running]
        prompts += [(admission.row, admission.request.tokens[:-1]) for admission in starting]
        shared = [(row, common_prefix(prompt, wanted)) for row, prompt in prompts]
        return max(shared, key=lambda pair: pair[1], default=(None, 0))

    def start(self, seq: DecodingSequence) -> None:
        bisect.insort(self.running, seq, key=lambda s: s.row)

    def finish(self, seq: DecodingSequence, held: Sequence[int] = ()) -> None:
        """``seq`` leaves the batch; its row keeps the keys and values of ``held`` (its first tokens)."""
        self.running.remove(seq)
        bisect.insort(self.free_rows, seq.row)
        if self.reuse_prefixes and held:
            self.held[seq.row] = (list(held), next(self._frees))

    def forget_prefixes(self) -> None:
        """Free rows hold nothing reusable any more (a new cache, or a run that must start cold)."""
        self.held.clear()

    def cancel(self, key: int) -> DecodingSequence | Request | None:
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


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (by halving: slices compare in C)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle - 1
    return low
