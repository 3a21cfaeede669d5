"""``reader bench``: decoding methods side by side on Spec-Bench, or drafters on recorded conversations.

The benchmark package (and matplotlib, for its plots) is imported only when the command runs:
``reader generate`` never loads it, and neither does ``import reader_spec``.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import get_args

from reader_spec.budget.costs import CostModel, load_costs
from reader_spec.cli.common import (
    add_budget_option,
    add_model_option,
    add_prefix_reuse_option,
    add_sampling_options,
    load_target,
    names,
    open_datastore,
    sampling_settings,
)
from reader_spec.config import GenerationConfig
from reader_spec.drafters.model import load_draft_model
from reader_spec.engine.loop import DEFAULT_BUDGET
from reader_spec.prompts import IdFilter, by_id_parity


def add_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser(
        "bench",
        help="measure methods side by side on Spec-Bench",
        description="Run Spec-Bench prompts (both turns of two-turn questions) through several decoding "
        "methods in one process and report, per category, the speedup over plain decoding (ar), mean "
        "accepted tokens per step, exactness against ar, time shares and peak memory; then throughput at "
        "larger batch sizes.",
    )
    add_model_option(bench)
    add_prefix_reuse_option(bench)
    bench.add_argument(
        "--draft-model",
        metavar="self|MODEL",
        help="draft model for model, reader-model, rasd and hf-assisted: self (the target's weights in 4 or "
        "8 bits) or a hub id, directory or .gguf with the target's tokenizer; enables those methods",
    )
    bench.add_argument(
        "--suite", help="JSONL with question_id, category, turns (default: Spec-Bench, shipped)"
    )
    bench.add_argument(
        "--categories", nargs="+", type=names, help="only these categories (spaces or commas between)"
    )
    bench.add_argument(
        "--question-ids",
        choices=get_args(IdFilter),
        default="all",
        help="only questions with odd or even ids, e.g. even ones against a datastore of the odd ones",
    )
    bench.add_argument("--limit", type=int, default=None, help="questions per category (default: all)")
    bench.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt (128)")
    bench.add_argument(
        "--methods",
        nargs="+",
        type=names,
        help="decoding methods to compare (default: all; those that draft with a model only with "
        "--draft-model; an unknown name lists the choices); with --replay, drafters (default: pld, suffix, "
        "reader)",
    )
    bench.add_argument(
        "--batch-sizes", nargs="+", type=int, default=[1], help="1: per-prompt figures; above 1: throughput"
    )
    bench.add_argument("--repeats", type=int, default=1, help="runs per prompt; the median-time run counts")
    add_budget_option(bench, help=f"draft budget of engine methods without their own ({DEFAULT_BUDGET})")
    bench.add_argument("--out", help="directory for results.json, results.md and PNG plots")
    bench.add_argument(
        "--datastore", metavar="DIR", help="corpus datastore for the reader method (live or replayed)"
    )
    add_sampling_options(bench)
    bench.add_argument(
        "--replay",
        metavar="FILE",
        help="instead, replay recorded conversations (JSONL, optionally .gz, of {messages: [...]}) through "
        "drafters, without running the model (only its tokenizer): accepted tokens per step per method; "
        "--limit counts tasks, --out gets replay.json and replay.md",
    )
    bench.add_argument(
        "--costs",
        metavar="FILE",
        help="with --replay: verification costs (the JSON `reader calibrate` wrote and named) by which "
        "adaptive drafters' trees are priced and cut each step, as the engine does at batch 1, and every "
        "method's passes are timed (a modelled speedup over plain decoding); default: trees fill the budget",
    )
    bench.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.replay is not None:
        return _bench_replay(args)
    if args.costs is not None:
        raise ValueError("--costs prices replayed trees: it needs --replay (live runs measure their own)")
    from reader_spec.bench.methods import method_names
    from reader_spec.bench.runner import run_bench
    from reader_spec.bench.spec_bench import load_questions, per_category

    if args.repeats < 1 or (args.limit is not None and args.limit < 1) or min(args.batch_sizes) < 1:
        raise ValueError("--repeats, --limit and --batch-sizes must be positive")
    if args.out and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--out draws plots with matplotlib: pip install 'reader-spec[bench]'")
    chosen = [m for group in args.methods for m in group] if args.methods else None
    methods = method_names(chosen, with_draft=args.draft_model is not None)
    categories = [c for group in args.categories for c in group] if args.categories else None
    questions = by_id_parity(load_questions(args.suite), args.question_ids)
    questions = per_category(questions, args.limit, categories)
    loaded = load_target(args)
    datastore = open_datastore(args, loaded)
    draft = load_draft_model(args.draft_model, loaded) if args.draft_model else None
    # Every method must draw the same randomness for outputs to compare: a seed is always set.
    sampling = GenerationConfig(**{**sampling_settings(args), "seed": args.seed or 0})
    report = run_bench(
        loaded,
        questions,
        methods,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        batch_sizes=args.batch_sizes,
        budget=args.budget,
        draft=draft,
        datastore=datastore,
        sampling=sampling,
        runner=args.runner,
        reuse_prefixes=not args.no_prefix_reuse,
    )
    print(report.markdown())
    if args.out:
        written = report.save(Path(args.out))
        print(f"\nwrote {', '.join(str(p) for p in written)}")
    return 0


def _bench_replay(args: argparse.Namespace) -> int:
    from reader_spec.bench.replay import METHODS, load_conversations, run_replay
    from reader_spec.drafters import DRAFTERS
    from reader_spec.files import cache_root
    from reader_spec.loading import load_tokenizer

    methods = [m for group in args.methods or [list(METHODS)] for m in group]
    replayable = [name for name, spec in DRAFTERS.items() if not spec.needs_draft_model]
    unknown = sorted(set(methods) - set(DRAFTERS))
    if unknown:
        raise ValueError(f"unknown replay method {', '.join(unknown)}; choose from {', '.join(replayable)}")
    with_model = sorted(set(methods) - set(replayable))
    if with_model:
        raise ValueError(f"replay runs no model, so it cannot replay {', '.join(with_model)}")
    if args.budget < 1 or (args.limit is not None and args.limit < 1):
        raise ValueError("--budget and --limit must be positive")
    loaded = load_tokenizer(args.model)
    datastore = open_datastore(args, loaded)
    costs = replay_costs(Path(args.costs), args.budget) if args.costs is not None else None
    conversations = load_conversations(
        args.replay, loaded.tokenizer, loaded.fingerprint, cache_root() / "replay"
    )[: args.limit]
    drafters = {m: DRAFTERS[m].build(datastore, None, "auto") for m in dict.fromkeys(methods)}
    settings = {
        "file": str(args.replay),
        "model": loaded.name,
        "costs": args.costs,
        "datastore": args.datastore,
    }
    priced = [m for m in drafters if DRAFTERS[m].adaptive]
    report = run_replay(conversations, drafters, args.budget, settings=settings, costs=costs, priced=priced)
    print(report.markdown())
    if args.out:
        report.save(Path(args.out))
        print(f"\nwrote {Path(args.out) / 'replay.json'} and {Path(args.out) / 'replay.md'}")
    return 0


def replay_costs(path: Path, budget: int) -> CostModel:
    """Batch-1 verification costs from a file ``reader calibrate`` wrote, or a one-line error."""
    curves = load_costs(path)
    costs = CostModel(curves, budget=budget)
    try:
        costs.table(1, budget)
    except KeyError:
        raise ValueError(
            f"{path} holds no batch-1 verification costs: run `reader calibrate` and pass the file it names"
        ) from None
    return costs
