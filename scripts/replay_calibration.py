"""How well `reader`'s node estimates predict acceptance on recorded conversations.

Replays the recordings through the default ``ReaderDrafter`` (unpriced, the budget filled) and
records every calibration trial: each node verification tested, its labelling source, its raw
estimate ``k / (n + 1)``, its calibrated estimate at the time, how many sources proposed it, and
whether it was accepted. Prints acceptance by raw-estimate bucket and by agreement: the figures
behind the calibration design in ``docs/architecture.md`` (Drafters).

    F=../shared/data/agentic/deepseek_chat_test_1-100.jsonl.gz
    .venv/bin/python scripts/replay_calibration.py $F --limit 30
"""

from __future__ import annotations

from collections import defaultdict

from recordings import recorded_tasks, recording_arguments

from reader_spec.bench.replay import run_replay
from reader_spec.drafters import ReaderDrafter
from reader_spec.drafters.calibration import RAW_BOUNDS, raw_bucket
from reader_spec.drafters.retrieval.calibration import AGREEMENT_LEVELS


def record_trials(drafter: ReaderDrafter) -> list[tuple[str, float, float, int, bool]]:
    """Every later calibration trial of the drafter, as (source, raw, calibrated, agreeing, hit)."""
    trials: list[tuple[str, float, float, int, bool]] = []
    for name, calibrator in drafter.calibrators.items():

        def update(
            q: float, hit: bool, context: int = 0, name=name, calibrator=calibrator, inner=calibrator.update
        ):
            agreeing = context % AGREEMENT_LEVELS + 1
            trials.append((name, q, calibrator(q, context), agreeing, bool(hit)))
            inner(q, hit, context)

        calibrator.update = update
    return trials


def table(title: str, groups: dict[object, list[tuple[float, float, bool]]]) -> None:
    print(f"\n{title}: tested nodes, accepted, mean raw estimate, mean calibrated estimate")
    for key in sorted(groups):
        rows = groups[key]
        rate = sum(hit for *_, hit in rows) / len(rows)
        raw = sum(r for r, _, _ in rows) / len(rows)
        calibrated = sum(c for _, c, _ in rows) / len(rows)
        print(f"  {key}: {len(rows):>8,d}  {rate:6.1%}  {raw:.3f}  {calibrated:.3f}")


def main() -> None:
    args = recording_arguments(__doc__.split("\n\n")[0]).parse_args()
    conversations = recorded_tasks(args)
    drafter = ReaderDrafter()
    trials = record_trials(drafter)
    report = run_replay(conversations, {"reader": drafter}, args.budget, progress=False)
    stats = report.methods["reader"]
    print(
        f"{len(conversations)} tasks, budget {args.budget}: {stats.steps:,d} steps, {len(trials):,d} trials"
    )
    by_raw: dict[object, list[tuple[float, float, bool]]] = defaultdict(list)
    by_agreement: dict[object, list[tuple[float, float, bool]]] = defaultdict(list)
    by_source: dict[object, list[tuple[float, float, bool]]] = defaultdict(list)
    for source, raw, calibrated, agreeing, hit in trials:
        by_raw[f"raw >= {RAW_BOUNDS[raw_bucket(raw)]:.2f}"].append((raw, calibrated, hit))
        by_agreement[f"{agreeing} source(s)"].append((raw, calibrated, hit))
        by_source[source].append((raw, calibrated, hit))
    table("by raw estimate", by_raw)
    table("by sources agreeing", by_agreement)
    table("by labelling source", by_source)


if __name__ == "__main__":
    main()
