"""``reader calibrate``: measure what verification passes cost on this machine, and print the curves.

The adaptive budget prices every step with these curves. ``reader generate`` and ``reader bench``
measure missing curves themselves before decoding (and say so); this command does it on purpose, for
the batch sizes a later run or a server will use, and shows what the budget will work with.
"""

from __future__ import annotations

import argparse

from reader_spec.budget.costs import LONG_CONTEXT, PROBE_CONTEXT, probed_batches
from reader_spec.cli.common import add_budget_option, add_model_option, load_target
from reader_spec.drafters import ReaderDrafter
from reader_spec.engine.loop import DEFAULT_BUDGET, Engine

SHOWN_DRAFTS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
FLOOR_WIDTHS = 32
"""Batch 1's pass widths printed against the floor: 1 to this many tokens."""


def add_parser(commands: argparse._SubParsersAction) -> None:
    calibrate = commands.add_parser(
        "calibrate",
        help="measure verification costs on this machine and print them",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    add_model_option(calibrate)
    calibrate.add_argument(
        "--batch-size", type=int, default=1, help="largest batch size to measure for (default 1)"
    )
    add_budget_option(
        calibrate, help=f"most draft tokens per sequence and step the curves must reach ({DEFAULT_BUDGET})"
    )
    calibrate.add_argument(
        "--again",
        action="store_true",
        help="measure every curve again, cached or not (after a calibration that other work on the "
        "machine slowed: its curves price every later run)",
    )
    calibrate.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.batch_size < 1 or args.budget < 1:
        raise ValueError("--batch-size and --budget must be positive")
    loaded = load_target(args)
    engine = Engine(loaded, ReaderDrafter(), budget=args.budget, runner=args.runner)
    if args.again:
        engine.costs.forget()
    engine.calibrate(args.batch_size)
    costs = engine.costs
    print(f"verification costs of {loaded.name} ({loaded.model.dtype}), cached in {costs.path}")
    print(f"milliseconds per pass at {PROBE_CONTEXT} tokens of context, by draft tokens of the whole batch;")
    print("in brackets, relative to the pass without drafts; last column: ms per context token x 1,000")
    for batch in probed_batches(args.batch_size):
        most = batch * args.budget
        plain = costs.seconds(batch, 0)
        cells = [
            f"{d}: {1e3 * costs.seconds(batch, d):.1f} ({costs.seconds(batch, d) / plain:.2f})"
            for d in SHOWN_DRAFTS
            if d <= most
        ]
        per_token = (costs.seconds(batch, 0, LONG_CONTEXT) - plain) / (LONG_CONTEXT - PROBE_CONTEXT)
        print(f"batch {batch:>3}: {'  '.join(cells)}  | context {1e6 * per_token:.2f}")
    _print_floor(engine)
    return 0


def _print_floor(engine: Engine) -> None:
    """Batch 1's passes of 1 to ``FLOOR_WIDTHS`` tokens beside this machine's floor for each, both
    timed in the same rounds (see :func:`~reader_spec.budget.probe.floor_and_passes`)."""
    from reader_spec.budget.probe import floor_and_passes

    floor, passes = floor_and_passes(engine.model, range(FLOOR_WIDTHS), PROBE_CONTEXT, engine.runner_name)
    unit = "OP" if floor.integer_products else "FLOP"
    print(
        f"\nfloor on this machine ({engine.runner_name} runner), measured in the passes' rounds: "
        f"{floor.weight_bytes / 1e6:.0f} MB of weights at {floor.bytes_per_second / 1e9:.1f} GB/s read, "
        f"{floor.parameters / 1e6:.1f}M parameters at {floor.flops_per_second / 1e9:.0f} G{unit}/s"
    )
    print(f"tokens in a pass at batch 1, {PROBE_CONTEXT} tokens of context: measured ms / floor ms (ratio)")
    cells = []
    for drafted, measured in passes.items():
        least = floor.seconds(drafted + 1)
        cells.append(f"{drafted + 1}: {1e3 * measured:.1f}/{1e3 * least:.1f} ({measured / least:.2f})")
    for start in range(0, len(cells), 8):
        print("  ".join(cells[start : start + 8]))
