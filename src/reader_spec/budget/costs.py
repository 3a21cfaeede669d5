"""What a verification pass costs, by batch size, draft tokens of the whole batch and context length.

A pass over more tokens costs more, so drafting only pays when the expected accepted tokens outweigh
the extra time, and how much more it costs depends on the machine and the model: it is measured once
per machine, model and batch size (``budget.probe``), cached on disk, and read by the allocation
every step. Passes are packed, so what a pass costs is the total of the batch's draft tokens.
Every total up to ``DENSE_TOKENS`` is measured, not sampled: on a CPU the curve is a staircase as
the matrix kernels change block shapes, and interpolating between sparse samples misprices it
(``docs/architecture.md``, "What it measures", has a measured curve).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from reader_spec.files import cache_root, write_atomic
from reader_spec.machine import cpu_key

DENSE_TOKENS = 32
"""Passes of up to this many tree tokens (whole batch) are all timed; larger ones at ``SPARSE_TOKENS``."""
SPARSE_TOKENS = (48, 64, 96, 128, 192, 256, 384, 512)
PROBE_CONTEXT = 256
LONG_CONTEXT = 1024
"""A second context length, timed at two points per batch size: how a pass's cost grows with context."""
COSTS_FORMAT = 5
"""Part of the cache key: curves measured by an older probe are measured again."""

Curves = dict[int, dict[int, dict[int, float]]]
"""Seconds by context length, then batch size, then draft tokens of the whole batch."""


@dataclass
class CostModel:
    """Seconds per verification pass, by batch size, draft tokens over the whole batch and context.

    At ``PROBE_CONTEXT`` every batch size probed (powers of two, interpolated between) has a full
    curve over draft counts (``probe_points``, up to ``budget`` per sequence); at ``LONG_CONTEXT``
    two points (no draft, two per sequence) give how much each context token adds, which is
    interpolated linearly in the draft count: attention is what grows with context, and on a CPU a
    batch of long contexts makes a pass dearer and each extra draft token relatively cheaper.
    Lookups never measure: :meth:`calibrate` measures the curves a run will need, up front, with
    ``measure(batch, drafted, context)``; a context without samples is priced as ``PROBE_CONTEXT``.
    """

    samples: Curves = field(default_factory=dict)
    measure: Callable[[int, Sequence[int], int], dict[int, float]] | None = None
    budget: int = DENSE_TOKENS
    """Most draft tokens one sequence may verify (the engine's budget): how far each curve reaches."""
    path: Path | None = None
    """Where measured curves are persisted (written atomically after each new curve)."""
    _tables: dict[int, tuple[list[float], list[float]]] = field(default_factory=dict, repr=False)

    def seconds(self, batch: int, drafted: int, context: float = PROBE_CONTEXT) -> float:
        return self.table(batch, drafted, context)[drafted]

    def table(self, batch: int, max_drafted: int, context: float = PROBE_CONTEXT) -> list[float]:
        """``seconds(batch, d, context)`` for every ``d`` up to ``max_drafted`` (budgets ask every step).

        Computed once per batch size for every count its budget allows, as arrays: the engine meets
        every batch size from its largest down to 1 as a batch drains, and pricing each count one by
        one cost milliseconds per size."""
        tables = self._tables.get(batch)
        if tables is None or len(tables[0]) <= max_drafted:
            count = max(max_drafted, batch * self.budget) + 1
            at_probe = self._batch_seconds(batch, count, PROBE_CONTEXT)
            per_token = self._batch_seconds(batch, count, PROBE_CONTEXT + 1) - at_probe
            tables = self._tables[batch] = (at_probe.tolist(), per_token.tolist())
        extra = context - PROBE_CONTEXT
        return [t + extra * k for t, k in zip(tables[0][: max_drafted + 1], tables[1], strict=False)]

    def _batch_seconds(self, batch: int, count: int, context: float) -> np.ndarray:
        """Seconds for 0..count-1 draft tokens; batch sizes between probed powers of two interpolated."""
        lo = 1 << (batch.bit_length() - 1)
        if lo == batch:
            return self._probed_seconds(batch, count, context)
        hi = 2 * lo
        t_lo, t_hi = self._probed_seconds(lo, count, context), self._probed_seconds(hi, count, context)
        return t_lo + (t_hi - t_lo) * (batch - lo) / (hi - lo)

    def _probed_seconds(self, batch: int, count: int, context: float) -> np.ndarray:
        short = self._curve(batch, PROBE_CONTEXT)
        drafted = np.arange(count)
        at_probe = _interpolate(short, drafted)
        long = self._curve(batch, LONG_CONTEXT)
        if not long:
            return at_probe
        points = sorted(long)
        gaps = np.array([long[d] for d in points]) - _interpolate(short, np.array(points))
        slopes = dict(zip(points, np.maximum(0.0, gaps) / (LONG_CONTEXT - PROBE_CONTEXT), strict=True))
        return at_probe + (context - PROBE_CONTEXT) * np.maximum(0.0, _interpolate(slopes, drafted))

    def _curve(self, batch: int, context: int) -> dict[int, float]:
        curve = self.samples.get(context, {}).get(batch, {})
        if not curve and context == PROBE_CONTEXT:
            raise KeyError(f"no cost measured for batch size {batch}: calibrate for it first")
        return curve

    def forget(self) -> None:
        """Drop every curve, so that :meth:`calibrate` measures them again (and overwrites the cache):
        for a calibration taken while other work held the machine, which prices every later run."""
        self.samples.clear()
        self._tables.clear()

    def missing(self, max_batch: int) -> list[tuple[int, int, list[int]]]:
        """(batch, context, draft counts) still to measure before any batch up to ``max_batch`` can be
        priced: the curves of every power of two up to the first at or above ``max_batch``."""
        found = []
        for batch in probed_batches(max_batch):
            most = batch * self.budget
            for context in (PROBE_CONTEXT, LONG_CONTEXT):
                wanted = probe_points(batch, most) if context == PROBE_CONTEXT else [0, min(2 * batch, most)]
                known = self.samples.get(context, {}).get(batch, {})
                todo = [d for d in dict.fromkeys(wanted) if d not in known]
                if todo:
                    found.append((batch, context, todo))
        return found

    def calibrate(self, max_batch: int, progress: Callable[[int, int], None] | None = None) -> None:
        """Measure every curve still missing for batches up to ``max_batch``, saving after each.

        ``progress(done, total)`` is called after each curve (the CLI draws a bar with it)."""
        todo = self.missing(max_batch)
        if todo and self.measure is None:
            raise RuntimeError("these costs cannot be measured: no measure function was given")
        for done, (batch, context, drafted) in enumerate(todo, 1):
            times = self.measure(batch, drafted, context)
            self.samples.setdefault(context, {}).setdefault(batch, {}).update(times)
            self._tables.clear()
            if self.path is not None:
                save_costs(self.path, self.samples)
            if progress is not None:
                progress(done, len(todo))


def probed_batches(max_batch: int) -> list[int]:
    """The batch sizes whose curves price every batch up to ``max_batch`` (others interpolate)."""
    return [1 << k for k in range((max(max_batch, 1) - 1).bit_length() + 1)]


def probe_points(batch: int, max_drafted: int) -> list[int]:
    """Draft counts to time for a batch: every pass up to ``DENSE_TOKENS`` tokens, sparse ones
    beyond, and the largest the budget allows (so that no count in use is extrapolated)."""
    dense = max(batch, DENSE_TOKENS)
    totals = [*range(batch, dense + 1), *(t for t in SPARSE_TOKENS if t > dense)]
    points = [t - batch for t in totals if t - batch < max_drafted]
    return [*points, max_drafted]


def _interpolate(curve: dict[int, float], x: np.ndarray) -> np.ndarray:
    """Piecewise linear through the curve's points, extended linearly beyond its last two."""
    points = np.array(sorted(curve), dtype=np.float64)
    values = np.array([curve[p] for p in sorted(curve)])
    result = np.interp(x, points, values)
    if len(points) > 1:
        slope = (values[-1] - values[-2]) / (points[-1] - points[-2])
        beyond = x > points[-1]
        result[beyond] = values[-1] + slope * (x[beyond] - points[-1])
    return result


def cost_cache_path(model_key: str) -> Path:
    root = cache_root()
    machine = f"{cpu_key()}-{os.cpu_count()}-{torch.get_num_threads()}"
    key = f"{model_key}|{machine}|{torch.__version__}|{COSTS_FORMAT}"
    key = hashlib.sha256(key.encode()).hexdigest()[:20]
    return root / "costs" / f"{key}.json"


def load_costs(path: Path) -> Curves:
    try:
        raw = json.loads(path.read_text())
        return {
            int(context): {int(b): {int(d): float(t) for d, t in c.items()} for b, c in curves.items()}
            for context, curves in raw.items()
        }
    except (OSError, ValueError, AttributeError):
        return {}


def save_costs(path: Path, samples: Curves) -> None:
    """Written atomically, so that concurrent engines never read half a file."""
    write_atomic(path, json.dumps(samples))
