"""Options and helpers the commands share."""

from __future__ import annotations

import argparse

from reader_spec.config import SAMPLING_FIELDS


def add_model_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", help="hub id, local directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "sampling", "exact sampling of the model's distribution; input lines may override each setting"
    )
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy decoding (default)")
    group.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    group.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top one")
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--seed", type=int, help="makes sampled output reproducible, whatever the drafter")


def sampling_settings(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in SAMPLING_FIELDS}


def names(value: str) -> list[str]:
    """``a,b`` as well as ``a b``: one command-line word may hold several names."""
    return [name for name in value.split(",") if name]


