"""How many draft tokens a step should verify, decided from measured costs.

A verification pass over a wider tree costs more (on a 2-core CPU, 8 tokens cost about 1.8 plain
steps), so drafting only pays when the expected accepted tokens outweigh the extra time. The cost of
a pass is measured once per machine, model and batch size and cached on disk; each step then picks
the tree width that maximises expected tokens per second for the whole batch. A curve's widths are
timed in interleaved rounds, so that load from other processes during the probe raises every width
alike instead of bending the curve. Every width up to ``DENSE_WIDTHS`` is timed, not sampled: the
curve is a staircase (on this 2-core CPU, batch 1: 3 tokens cost 1.07 plain steps, 4 cost 1.44, 13
cost 2.31 and 16 only 1.97, as the matrix kernels change block shapes), and interpolating between
sparse samples priced 3 tokens at 1.30 steps.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from reader_spec.tree import Proposal

DENSE_WIDTHS = 32
"""Widths up to this are all timed; wider ones at ``SPARSE_WIDTHS`` and interpolated between."""
SPARSE_WIDTHS = (48, 64, 96, 128)
PROBE_CONTEXT = 256
PROBE_ROUNDS = 9
COSTS_FORMAT = 3
"""Part of the cache key: curves measured by an older probe are measured again."""


@dataclass
class CostModel:
    """Seconds per verification pass, by batch size and tree width (tokens per sequence).

    Batch sizes are probed at powers of two and interpolated between; widths as ``probe_widths`` says.
    ``measure(batch, widths)`` is called lazily for the widths of a curve not yet known; without it,
    the samples given are all there is.
    """

    samples: dict[int, dict[int, float]] = field(default_factory=dict)
    measure: Callable[[int, Sequence[int]], dict[int, float]] | None = None
    max_width: int = DENSE_WIDTHS
    path: Path | None = None
    """Where measured curves are persisted (written atomically after each new curve)."""

    def seconds(self, batch: int, width: int) -> float:
        lo = 1 << (batch.bit_length() - 1)
        if lo == batch:
            return _interpolate(self._curve(batch), width)
        hi = 2 * lo
        t_lo, t_hi = _interpolate(self._curve(lo), width), _interpolate(self._curve(hi), width)
        return t_lo + (t_hi - t_lo) * (batch - lo) / (hi - lo)

    def _curve(self, batch: int) -> dict[int, float]:
        curve = self.samples.setdefault(batch, {})
        missing = [w for w in probe_widths(self.max_width) if w not in curve]
        if missing and self.measure is not None:
            curve.update(self.measure(batch, missing))
            if self.path is not None:
                save_costs(self.path, self.samples)
        if not curve:
            raise KeyError(f"no cost measured for batch size {batch}")
        return curve


def probe_widths(max_width: int) -> list[int]:
    """Every width up to ``min(max_width, DENSE_WIDTHS)``, then sparse ones up to the first past it."""
    widths = list(range(1, min(max_width, DENSE_WIDTHS) + 1))
    for width in SPARSE_WIDTHS:
        if widths[-1] >= max_width:
            break
        widths.append(width)
    return widths


def _interpolate(curve: dict[int, float], width: int) -> float:
    widths = sorted(curve)
    if len(widths) == 1 or width <= widths[0]:
        return curve[widths[0]]
    for lo, hi in itertools.pairwise(widths):
        if width <= hi:
            return curve[lo] + (curve[hi] - curve[lo]) * (width - lo) / (hi - lo)
    lo, hi = widths[-2], widths[-1]
    return curve[hi] + (curve[hi] - curve[lo]) * (width - hi) / (hi - lo)


def choose_width(proposals: Sequence[Proposal], costs: CostModel, max_width: int) -> int:
    """Tree width (root included) maximising expected emitted tokens per second for the batch.

    A sequence whose proposal is shorter than the width simply pads; with calibrated path
    probabilities, the expected tokens a sequence emits with ``w - 1`` draft nodes is one (the
    bonus) plus the sum of their probabilities.
    """
    batch = len(proposals)
    longest = max((len(p) for p in proposals), default=0)
    best_width, best_rate = 1, batch / costs.seconds(batch, 1)
    for width in range(2, min(max_width, longest + 1) + 1):
        expected = batch + sum(p.expected_accepted(width - 1) for p in proposals)
        rate = expected / costs.seconds(batch, width)
        if rate > best_rate:
            best_width, best_rate = width, rate
    return best_width


def fixed_width(proposals: Sequence[Proposal], costs: CostModel, max_width: int) -> int:
    """Always verify the full budget (when the drafter found that much)."""
    return min(max_width, max((len(p) for p in proposals), default=0) + 1)


def cost_cache_path(model_key: str) -> Path:
    root = Path(os.environ.get("READER_SPEC_CACHE") or _default_cache_root())
    machine = f"{platform.machine()}-{platform.processor()}-{os.cpu_count()}-{torch.get_num_threads()}"
    key = f"{model_key}|{machine}|{torch.__version__}|{COSTS_FORMAT}"
    key = hashlib.sha256(key.encode()).hexdigest()[:20]
    return root / "costs" / f"{key}.json"


def _default_cache_root() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("reader-spec"))


def load_costs(path: Path) -> dict[int, dict[int, float]]:
    try:
        raw = json.loads(path.read_text())
        return {int(b): {int(w): float(s) for w, s in curve.items()} for b, curve in raw.items()}
    except (OSError, ValueError, AttributeError):
        return {}


def save_costs(path: Path, samples: dict[int, dict[int, float]]) -> None:
    """Write atomically so concurrent engines never read half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(samples, f)
    os.replace(tmp, path)


def time_interleaved(calls: dict[int, Callable[[], object]], rounds: int = PROBE_ROUNDS) -> dict[int, float]:
    """Fastest wall time of each call over ``rounds`` after a warm-up round.

    Load from other processes only ever adds time, and on shared cores it comes in bursts that can
    cover half the rounds of one width (a burst during a median-based probe once priced 16 tokens at
    1.29 plain steps instead of 1.97); the minimum is the pass's own cost. Rounds alternate their
    order, so that slow drift hits every call alike.
    """
    keys = list(calls)
    times: dict[int, list[float]] = {key: [] for key in keys}
    for round_ in range(rounds + 1):
        for key in keys if round_ % 2 else reversed(keys):
            start = time.perf_counter()
            calls[key]()
            if round_:
                times[key].append(time.perf_counter() - start)
    return {key: min(samples) for key, samples in times.items()}
