"""How many draft tokens each sequence of a step verifies, decided from measured costs.

A verification pass over more tokens costs more (on a 2-core CPU, 8 tree tokens cost about 1.8
plain steps at batch 1), so drafting only pays when the expected accepted tokens outweigh the extra
time. The cost of a pass is measured once per machine, model and batch size as a function of the
total draft tokens of the batch (passes are packed, so that is what they cost), plus how it grows
with the context length, and cached on disk.
Each step then ranks every sequence's candidate nodes together by their probability of being
accepted and keeps the count that maximises expected tokens per second for the whole batch: a
sequence with a long, sure match gets a deep tree, one with nothing likely gets none, and the total
follows the compute the hardware has to spare rather than batch size times a fixed tree.

A curve's points are timed in interleaved rounds, so that load from other processes during the
probe raises every point alike instead of bending the curve. Every total up to ``DENSE_TOKENS`` is
timed, not sampled: the curve is a staircase (on this 2-core CPU, batch 1: 3 tokens cost 1.07
plain steps, 4 cost 1.44, 13 cost 2.31 and 16 only 1.97, as the matrix kernels change block
shapes), and interpolating between sparse samples priced 3 tokens at 1.30 steps.
"""

from __future__ import annotations

import hashlib
import heapq
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

DENSE_TOKENS = 32
"""Passes of up to this many tree tokens (whole batch) are all timed; larger ones at ``SPARSE_TOKENS``."""
SPARSE_TOKENS = (48, 64, 96, 128, 192, 256, 384, 512)
PROBE_CONTEXT = 256
LONG_CONTEXT = 1024
"""A second context length, timed at two points per batch size: how a pass's cost grows with context."""
PROBE_ROUNDS = 9
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
    ``measure(batch, drafted, context)`` is called lazily for points not yet known; without it, the
    samples given are all there is (a context without samples is priced as ``PROBE_CONTEXT``).
    """

    samples: Curves = field(default_factory=dict)
    measure: Callable[[int, Sequence[int], int], dict[int, float]] | None = None
    budget: int = DENSE_TOKENS
    """Most draft tokens one sequence may verify: how far each curve is measured."""
    path: Path | None = None
    """Where measured curves are persisted (written atomically after each new curve)."""
    _tables: dict[int, tuple[list[float], list[float]]] = field(default_factory=dict, repr=False)

    def seconds(self, batch: int, drafted: int, context: float = PROBE_CONTEXT) -> float:
        lo = 1 << (batch.bit_length() - 1)
        if lo == batch:
            return self._seconds(batch, drafted, context)
        hi = 2 * lo
        t_lo, t_hi = self._seconds(lo, drafted, context), self._seconds(hi, drafted, context)
        return t_lo + (t_hi - t_lo) * (batch - lo) / (hi - lo)

    def table(self, batch: int, max_drafted: int, context: float = PROBE_CONTEXT) -> list[float]:
        """``seconds(batch, d, context)`` for every ``d`` up to ``max_drafted`` (budgets ask every step)."""
        tables = self._tables.get(batch)
        if tables is None or len(tables[0]) <= max_drafted:
            most = max(max_drafted, batch * self.budget)
            at_probe = [self.seconds(batch, d) for d in range(most + 1)]
            per_token = [self.seconds(batch, d, PROBE_CONTEXT + 1) - t for d, t in enumerate(at_probe)]
            tables = self._tables[batch] = (at_probe, per_token)
        extra = context - PROBE_CONTEXT
        return [t + extra * k for t, k in zip(tables[0][: max_drafted + 1], tables[1], strict=False)]

    def _seconds(self, batch: int, drafted: int, context: float) -> float:
        short = _interpolate(self._curve(batch, PROBE_CONTEXT), drafted)
        long = self._curve(batch, LONG_CONTEXT)
        if not long:
            return short
        short_at = {d: _interpolate(self._curve(batch, PROBE_CONTEXT), d) for d in long}
        slopes = {d: max(0.0, (t - short_at[d]) / (LONG_CONTEXT - PROBE_CONTEXT)) for d, t in long.items()}
        return short + (context - PROBE_CONTEXT) * max(0.0, _interpolate(slopes, drafted))

    def _curve(self, batch: int, context: int) -> dict[int, float]:
        curve = self.samples.setdefault(context, {}).setdefault(batch, {})
        most = batch * self.budget
        wanted = probe_points(batch, most) if context == PROBE_CONTEXT else sorted({0, min(2 * batch, most)})
        missing = [d for d in wanted if d not in curve]
        if missing and self.measure is not None:
            curve.update(self.measure(batch, missing, context))
            self._tables.clear()
            if self.path is not None:
                save_costs(self.path, self.samples)
        if not curve and context == PROBE_CONTEXT:
            raise KeyError(f"no cost measured for batch size {batch}")
        return curve


def probe_points(batch: int, max_drafted: int) -> list[int]:
    """Draft counts to time for a batch: every pass up to ``DENSE_TOKENS`` tokens, sparse ones
    beyond, and the largest the budget allows (so that no count in use is extrapolated)."""
    dense = max(batch, DENSE_TOKENS)
    totals = [*range(batch, dense + 1), *(t for t in SPARSE_TOKENS if t > dense)]
    points = [t - batch for t in totals if t - batch < max_drafted]
    return [*points, max_drafted]


def _interpolate(curve: dict[int, float], x: int) -> float:
    points = sorted(curve)
    if len(points) == 1 or x <= points[0]:
        return curve[points[0]]
    for lo, hi in itertools.pairwise(points):
        if x <= hi:
            return curve[lo] + (curve[hi] - curve[lo]) * (x - lo) / (hi - lo)
    lo, hi = points[-2], points[-1]
    return curve[hi] + (curve[hi] - curve[lo]) * (x - hi) / (hi - lo)


def allocate(
    proposals: Sequence[Proposal], costs: CostModel, budget: int, context: float = PROBE_CONTEXT
) -> list[int]:
    """Draft nodes each sequence verifies (a prefix of its proposal), maximising expected emitted
    tokens per second for the batch.

    With calibrated path probabilities, a sequence given ``n`` nodes emits one token (the bonus)
    plus the sum of their probabilities. One greedy pass takes the batch's nodes in order of
    probability (each proposal's own order kept, so that every kept set is a tree) and keeps the
    count whose rate is best; zero nodes, plain decoding, when nothing in the batch pays.
    ``context`` is the batch's mean context length, which the costs depend on.
    """
    batch = len(proposals)
    limits = [min(len(p), budget) for p in proposals]
    if not any(limits):
        return limits
    seconds = costs.table(batch, sum(limits), context)
    frontier = [(-p.probs[0], b, 0) for b, p in enumerate(proposals) if limits[b]]
    heapq.heapify(frontier)
    taken: list[int] = []
    expected, best_rate, best_taken = float(batch), batch / seconds[0], 0
    while frontier:
        negative_prob, b, node = heapq.heappop(frontier)
        taken.append(b)
        expected -= negative_prob
        rate = expected / seconds[len(taken)]
        if rate > best_rate:
            best_rate, best_taken = rate, len(taken)
        if node + 1 < limits[b]:
            heapq.heappush(frontier, (-proposals[b].probs[node + 1], b, node + 1))
    counts = [0] * batch
    for b in taken[:best_taken]:
        counts[b] += 1
    return counts


def fixed_allocation(
    proposals: Sequence[Proposal], costs: CostModel, budget: int, context: float = PROBE_CONTEXT
) -> list[int]:
    """Every sequence verifies its whole proposal, up to the budget."""
    return [min(len(p), budget) for p in proposals]


def cost_cache_path(model_key: str) -> Path:
    root = Path(os.environ.get("READER_SPEC_CACHE") or _default_cache_root())
    machine = f"{platform.machine()}-{platform.processor()}-{os.cpu_count()}-{torch.get_num_threads()}"
    key = f"{model_key}|{machine}|{torch.__version__}|{COSTS_FORMAT}"
    key = hashlib.sha256(key.encode()).hexdigest()[:20]
    return root / "costs" / f"{key}.json"


def _default_cache_root() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("reader-spec"))


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
