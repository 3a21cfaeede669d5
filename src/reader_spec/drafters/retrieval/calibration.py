"""The contexts a retrieval source's estimates are calibrated in: match length and agreement.

A source's raw estimate of a child is ``k / (n + 1)``: ``k`` of the ``n`` occurrences continuing past
the node went on with the child's token, and one count is kept for a continuation never seen (the
rule of succession). A plain share ``k / n`` calls a token seen once after a single occurrence as sure
as one seen after fifty, which agent traces show it is not. Calibration then splits each source's
buckets by two things the raw estimate cannot see: how long the text's match with the source is at
that depth (longer matches are stronger evidence), and how many sources propose the same token there.
The measurements behind this are in ``docs/architecture.md`` (Drafters).
"""

from __future__ import annotations

import functools
from bisect import bisect_right

from reader_spec.drafters.calibration import ProbabilityCalibrator

MATCH_BOUNDS = (1, 2, 4, 8)
"""Lower bounds of the match-length buckets."""
AGREEMENT_LEVELS = 4
"""Sources proposing the same token, counted 1, 2, 3 and 4 or more."""
PRIOR_STRENGTH = 4.0


def source_calibrator() -> ProbabilityCalibrator:
    """One source's calibrator: a context per (match-length bucket, agreement level)."""
    return ProbabilityCalibrator(len(MATCH_BOUNDS) * AGREEMENT_LEVELS, PRIOR_STRENGTH)


@functools.cache
def match_contexts(match_length: int, depth: int) -> tuple[int, ...]:
    """Per depth ``d`` (1 to ``depth``), the first context of the source's edges into depth ``d``,
    whose match with the text is then ``match_length + d - 1`` tokens long; the agreement level
    (0 for one source, up to ``AGREEMENT_LEVELS - 1``) is added where the sources are merged.
    Cached: every source of every request asks each step, with few distinct arguments."""
    buckets = (max(bisect_right(MATCH_BOUNDS, match_length + d) - 1, 0) for d in range(depth))
    return tuple(bucket * AGREEMENT_LEVELS for bucket in buckets)
