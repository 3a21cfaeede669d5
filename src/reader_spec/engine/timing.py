"""Choosing between kernels by timing them on this machine, as the engine does once per process."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


def best_times(calls: Sequence[Callable[[], object]], rounds: int = 5) -> list[float]:
    """Each call's fastest round, in seconds. Calls alternate, so that load from elsewhere hits them
    alike."""
    best = [float("inf")] * len(calls)
    for _ in range(rounds):
        for i, call in enumerate(calls):
            start = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - start)
    return best
