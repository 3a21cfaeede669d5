"""Calibration of drafted nodes: the bucketed estimator and which nodes a verification tested."""

from __future__ import annotations

import pytest

from reader_spec.drafters.calibration import ProbabilityCalibrator, node_trials, verified_trials
from reader_spec.engine.tree import Proposal


@pytest.mark.parametrize("shift_priors", [False, True])
def test_calibration_table_equals_one_built_from_scratch_after_every_update(shift_priors):
    """The table (what the calibrator answers from) is kept current cell by cell as updates arrive:
    after each, it equals the table of a new calibrator given the same updates."""
    calibrator = ProbabilityCalibrator(3, prior_strength=2.0, shift_priors=shift_priors)
    trials = ((0.01, True, 0), (0.5, False, 1), (0.97, True, 2), (0.5, True, 1), (1.0, False, 2))
    for seen, (q, hit, context) in enumerate(trials, 1):
        calibrator.table()
        calibrator.update(q, hit, context)
        fresh = ProbabilityCalibrator(3, prior_strength=2.0, shift_priors=shift_priors)
        for update in trials[:seen]:
            fresh.update(*update)
        assert calibrator.table() == fresh.table()
        assert [calibrator(q, c) for c in range(3)] == [fresh.table()[fresh.cell(q, c)] for c in range(3)]
    if not shift_priors:
        assert calibrator(0.5, 1) == pytest.approx((0.55 * 2 + 1) / 4)


def test_a_calibrator_learns_and_keeps_contexts_apart():
    calibrator = ProbabilityCalibrator(2)
    before = calibrator(0.95)
    for _ in range(40):
        calibrator.update(0.95, False)
    assert calibrator(0.95) < before / 3
    assert calibrator(0.95, 1) == before
    with pytest.raises(ValueError):
        ProbabilityCalibrator(0)


def test_node_trials_follow_the_accepted_path() -> None:
    chain = Proposal((1, 2, 3), (-1, 0, 1), (0.5, 0.4, 0.3))
    assert node_trials(chain, []) == [(0, False)]
    assert node_trials(chain, [0]) == [(0, True), (1, False)]
    assert node_trials(chain, [0, 1, 2]) == [(0, True), (1, True), (2, True)]
    tree = Proposal((1, 4, 2, 5), (-1, -1, 0, 1), (0.5, 0.2, 0.3, 0.1))
    # Both root children were tested; the one accepted decides which children were tested next.
    assert node_trials(tree, [0, 2]) == [(0, True), (1, False), (2, True)]
    assert node_trials(tree, [1]) == [(0, False), (1, True), (3, False)]


def test_shifted_priors_carry_a_context_s_evidence_to_buckets_without_trials():
    shifted, plain = ProbabilityCalibrator(2, 2.0, shift_priors=True), ProbabilityCalibrator(2, 2.0)
    assert [shifted(q) for q in (0.01, 0.3, 0.9)] == [plain(q) for q in (0.01, 0.3, 0.9)]  # no evidence
    for calibrator in (shifted, plain):
        for _ in range(30):  # a draft model's likeliest child: accepted whatever its probability said
            calibrator.update(0.35, True, context=0)
            calibrator.update(0.55, True, context=0)
    # A bucket never tried moves with its context in log-odds, keeping the raw order; without the
    # shift it stays at its raw estimate, as does the other context either way.
    assert shifted(0.12) > 0.8 and shifted(0.01) < shifted(0.12) < shifted(0.75)
    assert plain(0.12) == pytest.approx(0.15)
    assert shifted(0.12, 1) == plain(0.12, 1) == pytest.approx(0.15)
    misses = ProbabilityCalibrator(1, 2.0, shift_priors=True)
    for _ in range(30):
        misses.update(0.85, False)
    assert misses(0.5) < 0.05
    assert misses.table()[misses.cell(0.5)] == misses(0.5)


def test_only_the_drafters_own_nodes_verified_teach_it() -> None:
    drafted = Proposal((1, 2, 3), (-1, 0, 1), (0.5, 0.4, 0.3))
    assert verified_trials(drafted, drafted.truncated(2), [0]) == [(0, True), (1, False)]  # cut to budget
    assert verified_trials(drafted, Proposal((1, 9), (-1, 0), (0.5, 0.4)), [0]) == []  # another tree
    assert verified_trials(drafted, drafted.truncated(0), []) == []  # nothing verified
    assert verified_trials(None, drafted, [0]) == []  # nothing drafted
