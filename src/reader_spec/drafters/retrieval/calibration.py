"""How far each source's raw counts can be trusted, learned online from verification outcomes."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

from reader_spec.engine.tree import Proposal


def calibration_trials(
    proposal: Proposal, shares: Sequence[float], accepted: Sequence[int]
) -> list[tuple[int, bool, float]]:
    """What one verification says about a source: (depth, hit, exposure) per level it was tested at.

    At each depth the accepted path reached, the drafted children of the path's node there were
    tested. Their summed shares are the source's exposure; a hit means the accepted child is one the
    source proposed. Levels where the source proposed nothing tested carry no evidence and are skipped.
    """
    path = [-1, *accepted]
    tested_at = {node: depth for depth, node in enumerate(path, 1)}  # whose children depth d tests
    exposures = [0.0] * (len(path) + 1)
    for i, parent in enumerate(proposal.parents):
        depth = tested_at.get(parent)
        if depth is not None:
            exposures[depth] += shares[i]
    trials = []
    for depth in range(1, len(path) + 1):
        if exposures[depth] > 0:
            hit = depth < len(path) and shares[path[depth]] > 0
            trials.append((depth, hit, exposures[depth]))
    return trials


class AcceptanceCalibrator:
    """Online estimate of how often a drafted token is accepted, per match-length bucket.

    The model: once a draft's path has been accepted down to a node, the text's suffix matches the
    continuation source over some length m (the initial match L plus the accepted depth), and a child of
    that node is accepted with probability ``min(1, c[b(m)] * share)``, where share is the child's
    fraction of the continuations through the node and ``c[b]`` a per-bucket confidence. Path
    probabilities are products of these factors (``select_best_first``).

    Each attributable level of a verification (``calibration_trials``) is one trial at its bucket: a
    hit if the accepted path went on below it, with exposure equal to the summed shares of the nodes
    drafted there (1 for a chain whose occurrences all agree). The estimate is the Beta-Binomial
    posterior mean generalised to fractional exposures,

        c[b] = (prior_mean[b] * strength + hits[b]) / (strength + exposure[b]),

    which is the Beta(prior_mean * strength, (1 - prior_mean) * strength) posterior mean when every
    exposure is 1, and otherwise the rate that makes expected hits equal observed hits. Longer matches
    get higher prior means because they are stronger evidence; data overrides the prior quickly.
    """

    def __init__(
        self,
        bounds: Sequence[int] = (1, 2, 3, 4, 6, 9),
        prior_means: Sequence[float] = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7),
        prior_strength: float = 4.0,
    ) -> None:
        if len(bounds) != len(prior_means) or list(bounds) != sorted(bounds) or bounds[0] != 1:
            raise ValueError("bounds must be ascending from 1, one prior mean per bucket")
        if prior_strength <= 0 or not all(0.0 < m <= 1.0 for m in prior_means):
            raise ValueError("prior means must lie in (0, 1] and the strength be positive")
        self.bounds = tuple(bounds)
        self._alpha = [m * prior_strength for m in prior_means]
        self._trials = [float(prior_strength)] * len(bounds)

    def bucket(self, match_length: int) -> int:
        """Bucket ``i`` holds lengths from ``bounds[i]`` up to the next bound; the last is open-ended."""
        return max(bisect_right(self.bounds, match_length) - 1, 0)

    def confidence(self, match_length: int) -> float:
        b = self.bucket(match_length)
        return self._alpha[b] / self._trials[b]

    def confidences(self, first: int, count: int) -> list[float]:
        """``confidence(first + d)`` for ``d`` in ``range(count)``: one division per bucket crossed."""
        out: list[float] = []
        b, length, end = self.bucket(first), first, first + count
        while length < end:
            upto = self.bounds[b + 1] if b + 1 < len(self.bounds) else end
            run = min(upto, end) - length
            out += [self._alpha[b] / self._trials[b]] * run
            length, b = length + run, b + 1
        return out

    def update(self, match_length: int, hits: float, exposure: float) -> None:
        b = self.bucket(match_length)
        self._alpha[b] += hits
        self._trials[b] += exposure
