"""Options and helpers the commands share."""

from __future__ import annotations

import argparse

from reader_spec.config import SAMPLING_FIELDS
from reader_spec.drafters import ReaderDrafter
from reader_spec.drafters.retrieval.datastore import Datastore
from reader_spec.drafters.retrieval.history import DEFAULT_MAX_TOKENS
from reader_spec.engine.loop import DEFAULT_BUDGET, Engine
from reader_spec.engine.runner import RUNNERS
from reader_spec.loading import LoadedModel


def add_model_option(parser: argparse.ArgumentParser, runner: bool = True) -> None:
    """``--model``, and unless the command runs no forward, ``--runner``."""
    parser.add_argument(
        "--model", help="hub id, local directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    if runner:
        parser.add_argument(
            "--runner",
            choices=RUNNERS,
            default="auto",
            help="the model's forward: fast (the engine's decoder for Llama, Mistral, Qwen2/3, Phi-3, "
            "Gemma 2/3), transformers (the model's own), auto (fast where supported; default)",
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


def add_drafting_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--budget",
        type=int,
        default=DEFAULT_BUDGET,
        help=f"most draft tokens per sequence and step ({DEFAULT_BUDGET})",
    )
    parser.add_argument(
        "--fixed-budget",
        action="store_true",
        help="always verify the whole budget instead of choosing the tree size from measured costs",
    )
    parser.add_argument(
        "--drafter",
        choices=["reader", "none"],
        default="reader",
        help="reader: retrieval drafts from the request, earlier responses and --datastore; none: plain",
    )
    parser.add_argument("--datastore", metavar="DIR", help="corpus datastore built by `reader index build`")
    parser.add_argument("--no-history", action="store_true", help="do not draft from earlier responses")


def build_engine(args: argparse.Namespace, loaded: LoadedModel, max_batch_size: int) -> Engine:
    """The engine the drafting options describe (a datastore of another tokenizer fails here)."""
    drafter = None
    if args.drafter == "reader":
        datastore = Datastore.open(args.datastore, fingerprint=loaded.fingerprint) if args.datastore else None
        drafter = ReaderDrafter(
            history_tokens=0 if args.no_history else DEFAULT_MAX_TOKENS, datastore=datastore
        )
    return Engine(
        loaded,
        drafter,
        budget=args.budget,
        adaptive_budget=not args.fixed_budget,
        max_batch_size=max_batch_size,
        runner=args.runner,
    )
