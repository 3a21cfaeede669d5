"""What a draft model's levels cost and whether one more pays: the two numbers its tree grows by.

A draft level is a pass of the draft model; it pays when the tokens it is expected to add to the
step, over the seconds it takes plus the larger verification it leads to, beat the step without it.
:class:`PassTimer` learns a level's seconds from the levels run; :class:`LevelPricing` compares the
step's best rate with and without the level, from the verification costs the engine gives.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from reader_spec.engine.tree import Proposal


@dataclass
class PassTimer:
    """Seconds a draft level costs by its number of tokens (its pass and the work around it: masks,
    the softmax, the tree), learned from the levels run; None until one was timed.

    Each count's estimate is the median of its last ``window`` levels: the first levels (cold
    caches, kernel choice, several times the usual) and bursts of load from other processes drop
    out, and what is left is what a level costs in a running engine. That is well above the fastest
    level (another model's weights pass through the caches between levels); priced at the fastest,
    as at first, the tree grew levels that cost more than they returned (docs/model-drafter.md, "the
    bench's drafters on the target's cache"). Between counts it interpolates; beyond the largest it
    extends the last two linearly (flat with one), since a pass of a few more tokens costs about the
    same on a bandwidth-bound machine.
    """

    window: int = 9
    recent: dict[int, deque[float]] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)
    """Each count's current estimate."""

    def record(self, tokens: int, seconds: float) -> None:
        recent = self.recent.setdefault(tokens, deque(maxlen=self.window))
        recent.append(seconds)
        self.seconds[tokens] = statistics.median(recent)

    def __call__(self, tokens: int) -> float | None:
        if not self.seconds:
            return None
        known = sorted(self.seconds)
        if tokens <= known[0]:
            return self.seconds[known[0]]
        above = next((k for k in known if k >= tokens), None)
        if above is None:
            if len(known) == 1:
                return self.seconds[known[0]]
            lo, hi = known[-2], known[-1]
        else:
            lo, hi = max(k for k in known if k < tokens), above
        slope = (self.seconds[hi] - self.seconds[lo]) / (hi - lo)
        return self.seconds[lo] + max(0.0, slope) * (tokens - lo)


class LevelPricing:
    """Whether one more draft pass pays, from the step's verification costs and the passes timed.

    A step emits, per sequence, the bonus token plus the accepted drafts; with ``k`` draft nodes
    verified (the best ``k`` of the step, any sequence) it expects ``batch + (sum of their
    probabilities)`` tokens in ``draft seconds + verify_seconds[k]``. A pass pays when the best rate
    with the nodes it is expected to add beats the best rate without it.
    """

    def __init__(
        self,
        verify_seconds: Sequence[float] | None,
        batch: int,
        alongside: Sequence[Proposal] | None,
    ) -> None:
        self.verify_seconds = verify_seconds
        self.batch = batch
        self.probs = sorted((p for proposal in alongside or () for p in proposal.probs), reverse=True)
        self.spent = 0.0

    def add_nodes(self, probs: Sequence[float]) -> None:
        self.probs = sorted([*self.probs, *probs], reverse=True)

    def _best_rate(self, probs: Sequence[float], spent: float) -> float:
        expected, best = float(self.batch), self.batch / (spent + self.verify_seconds[0])
        for k, p in enumerate(probs[: len(self.verify_seconds) - 1], 1):
            expected += p
            best = max(best, expected / (spent + self.verify_seconds[k]))
        return best

    def better(self, nodes: Sequence[float], seconds: float) -> bool:
        """Whether ``nodes`` after ``seconds`` more of drafting beat the nodes known now."""
        if self.verify_seconds is None:
            return True
        with_them = self._best_rate(sorted(nodes, reverse=True), self.spent + seconds)
        return with_them > self._best_rate(self.probs, self.spent)

    def best_count(self, gains: Sequence[float], pass_seconds: Callable[[int], float | None]) -> int:
        """How many of the candidate nodes, best first (``gains``: the probabilities their children are
        expected to add), one more pass should expand: the count whose pass raises the step's best
        rate most, 0 where none raises it (all while the verification or the pass is not priced)."""
        if self.verify_seconds is None:
            return len(gains) if any(g > 0 for g in gains) else 0
        without = self._best_rate(self.probs, self.spent)
        best, best_rate = 0, without
        for count in range(1, len(gains) + 1):
            seconds = pass_seconds(count)
            if seconds is None:
                return len(gains)
            hoped = sorted([*self.probs, *gains[:count]], reverse=True)
            rate = self._best_rate(hoped, self.spent + seconds)
            if rate > best_rate:
                best, best_rate = count, rate
        return best
