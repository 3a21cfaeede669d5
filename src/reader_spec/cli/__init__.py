"""The ``reader`` command line: one module per command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from reader_spec.cli import bench, bench_serve, calibrate, generate, index, serve
from reader_spec.drafters.retrieval.datastore import DatastoreError
from reader_spec.loading import ModelLoadError
from reader_spec.prompts import PromptError

COMMANDS = (generate, bench, index, calibrate, serve, bench_serve)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_libraries()
    try:
        return args.handler(args)
    except (ModelLoadError, PromptError, DatastoreError, ValueError, OSError) as e:
        print(f"reader: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reader", description="Lossless speculative decoding with retrieval drafts (READER)."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def _quiet_libraries() -> None:
    """Keep the terminal for our own progress and results; say when a slow first load happens."""
    import logging

    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.basicConfig(format="reader: %(message)s")
    logging.getLogger("reader_spec").setLevel(logging.INFO)


if __name__ == "__main__":
    sys.exit(main())
