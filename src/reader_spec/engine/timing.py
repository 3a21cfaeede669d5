"""Timing calls against each other on this machine: kernel choices (once per process) and cost curves."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


def best_times(
    calls: Sequence[Callable[[], object]], rounds: int = 5, synchronize: Callable[[], None] = lambda: None
) -> list[float]:
    """Each call's fastest round, in seconds, after a warm-up round.

    Load from other processes only ever adds time, and on shared cores it comes in bursts that can
    cover half the rounds of one call; the minimum is the call's own cost. Rounds alternate their
    order, so that slow drift hits every call alike. ``synchronize`` waits for an accelerator's queued
    work, so that each time is the call's own.
    """
    best = [float("inf")] * len(calls)
    for round_ in range(rounds + 1):
        for i in range(len(calls)) if round_ % 2 else reversed(range(len(calls))):
            start = time.perf_counter()
            calls[i]()
            synchronize()
            if round_:
                best[i] = min(best[i], time.perf_counter() - start)
    return best
