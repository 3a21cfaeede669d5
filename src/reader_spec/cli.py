"""The ``reader`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from reader_spec.bench_methods import METHODS
from reader_spec.config import GenerationConfig
from reader_spec.drafters import ContextDrafter
from reader_spec.engine import DEFAULT_BUDGET, Engine, Output
from reader_spec.loading import ModelLoadError, load_model
from reader_spec.prompts import InputRecord, PromptError, read_jsonl


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _quiet_libraries()
    try:
        return args.handler(args)
    except (ModelLoadError, PromptError, ValueError, OSError) as e:
        print(f"reader: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _quiet_libraries() -> None:
    """Keep the terminal for our own progress and results; say when a slow first load happens."""
    import logging

    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.basicConfig(format="reader: %(message)s")
    logging.getLogger("reader_spec").setLevel(logging.INFO)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reader", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser(
        "generate",
        help="generate text with speculative decoding",
        description="Generate with retrieval-drafted speculative decoding; "
        "the output equals plain greedy decoding.",
    )
    gen.add_argument("--model", help="hub id, local directory or .gguf file (default: SmolLM2-135M-Instruct)")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt")
    source.add_argument("--input", help='JSONL file of {"id", "messages"} or {"id", "prompt"} lines')
    gen.add_argument(
        "--chat", action="store_true", help="send --prompt as a user message through the chat template"
    )
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--batch-size", type=int, default=1, help="requests decoded together (default 1)")
    gen.add_argument(
        "--budget",
        type=int,
        default=DEFAULT_BUDGET,
        help=f"most draft tokens per sequence and step ({DEFAULT_BUDGET})",
    )
    gen.add_argument(
        "--fixed-budget",
        action="store_true",
        help="always verify the whole budget instead of choosing the tree size from measured costs",
    )
    gen.add_argument("--drafter", choices=["context", "none"], default="context")
    gen.add_argument("--compare", action="store_true", help="also run plain decoding and report the speedup")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    gen.set_defaults(handler=_generate)

    bench = commands.add_parser(
        "bench",
        help="measure methods side by side on Spec-Bench",
        description="Run Spec-Bench prompts (both turns of two-turn questions) through several decoding "
        "methods in one process and report, per category, the speedup over plain decoding (ar), mean "
        "accepted tokens per step, exactness against ar, time shares and peak memory; then throughput at "
        "larger batch sizes.",
    )
    bench.add_argument(
        "--model", help="hub id, local directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    bench.add_argument(
        "--draft-model", help="draft model for hf-assisted (hub id, directory or .gguf); enables hf-assisted"
    )
    bench.add_argument(
        "--suite", help="JSONL with question_id, category, turns (default: Spec-Bench, shipped)"
    )
    bench.add_argument(
        "--categories", nargs="+", type=_names, help="only these categories (spaces or commas between)"
    )
    bench.add_argument("--limit", type=int, default=None, help="questions per category (default: all)")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument(
        "--methods",
        nargs="+",
        type=_names,
        help=f"from: {', '.join(METHODS)} (default: all; hf-assisted only with --draft-model)",
    )
    bench.add_argument(
        "--batch-sizes", nargs="+", type=int, default=[1], help="1: per-prompt figures; above 1: throughput"
    )
    bench.add_argument("--repeats", type=int, default=1, help="runs per prompt; the median-time run counts")
    bench.add_argument(
        "--budget", type=int, default=DEFAULT_BUDGET, help="draft budget of engine methods without their own"
    )
    bench.add_argument("--out", help="directory for results.json, results.md and PNG plots")
    bench.set_defaults(handler=_bench)
    return parser


def _generate(args: argparse.Namespace) -> int:
    if args.input:
        records = list(read_jsonl(args.input))
        if not records:
            raise PromptError(f"{args.input}: no prompts")
    else:
        prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
        records = [InputRecord(0, prompt)]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_strings=tuple(args.stop))
    if args.batch_size < 1:
        raise ValueError("--batch-size must be at least 1")
    loaded = load_model(args.model)
    drafter = ContextDrafter() if args.drafter == "context" else None
    engine = Engine(loaded, drafter, budget=args.budget, adaptive_budget=not args.fixed_budget)
    engine.warm_up(args.batch_size)
    prompts = [r.prompt for r in records]
    ids = [r.id for r in records]

    outputs, seconds = _timed_run(engine, prompts, ids, config, args.batch_size, "reader")
    baseline, baseline_seconds = None, None
    if args.compare:
        plain = Engine(loaded)
        baseline, baseline_seconds = _timed_run(plain, prompts, ids, config, args.batch_size, "plain")

    summary = _summary(outputs, seconds, baseline, baseline_seconds)
    if args.json:
        print(json.dumps(_as_json(loaded.name, outputs, summary, baseline), ensure_ascii=False))
    else:
        _print_text(outputs, summary, baseline)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from reader_spec.bench import run_bench
    from reader_spec.spec_bench import load_questions, per_category

    if args.repeats < 1 or (args.limit is not None and args.limit < 1) or min(args.batch_sizes) < 1:
        raise ValueError("--repeats, --limit and --batch-sizes must be positive")
    methods = [m for group in args.methods for m in group] if args.methods else None
    unknown = [m for m in methods or [] if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if methods and "hf-assisted" in methods and not args.draft_model:
        raise ValueError("hf-assisted needs --draft-model")
    categories = [c for group in args.categories for c in group] if args.categories else None
    questions = per_category(load_questions(args.suite), args.limit, categories)
    loaded = load_model(args.model)
    draft = load_model(args.draft_model) if args.draft_model else None
    report = run_bench(
        loaded,
        questions,
        methods,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        batch_sizes=args.batch_sizes,
        budget=args.budget,
        draft=draft,
    )
    print(report.markdown())
    if args.out:
        written = report.save(Path(args.out))
        print(f"\nwrote {', '.join(str(p) for p in written)}")
    return 0


def _names(value: str) -> list[str]:
    """``a,b`` as well as ``a b``: one command-line word may hold several names."""
    return [name for name in value.split(",") if name]


def _timed_run(engine: Engine, prompts, ids, config, batch_size: int, label: str):
    with tqdm(total=len(prompts), desc=label, unit="prompt", file=sys.stderr, leave=False) as bar:
        start = time.perf_counter()
        outputs = engine.generate(
            prompts, config, batch_size=batch_size, ids=ids, on_finish=lambda _: bar.update()
        )
        return outputs, time.perf_counter() - start


def _summary(outputs: list[Output], seconds: float, baseline, baseline_seconds) -> dict:
    tokens = sum(len(o.tokens) for o in outputs)
    steps = sum(o.stats.steps for o in outputs)
    step_tokens = sum(o.stats.step_tokens for o in outputs)
    busy = sum(o.stats.seconds for o in outputs) or 1.0
    summary = {
        "requests": len(outputs),
        "new_tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "mean_accepted": step_tokens / steps if steps else 1.0,
        "draft_share": sum(o.stats.draft_seconds for o in outputs) / busy,
        "verify_share": sum(o.stats.verify_seconds for o in outputs) / busy,
        "prefill_share": sum(o.stats.prefill_seconds for o in outputs) / busy,
    }
    if baseline is not None:
        base_tokens = sum(len(o.tokens) for o in baseline)
        summary["baseline_seconds"] = baseline_seconds
        summary["baseline_tokens_per_second"] = base_tokens / baseline_seconds if baseline_seconds else 0.0
        summary["speedup"] = baseline_seconds / seconds if seconds else 0.0
        summary["identical"] = sum(o.tokens == b.tokens for o, b in zip(outputs, baseline, strict=True))
    return summary


def _as_json(model_name: str, outputs: list[Output], summary: dict, baseline) -> dict:
    requests = []
    for i, o in enumerate(outputs):
        entry = {
            "id": o.id,
            "tokens": o.tokens,
            "text": o.text,
            "finish_reason": o.finish_reason,
            "seconds": o.stats.seconds,
            "stats": o.stats.as_dict(),
        }
        if baseline is not None:
            entry["baseline"] = {"tokens": baseline[i].tokens, "seconds": baseline[i].stats.seconds}
        requests.append(entry)
    return {"model": model_name, "requests": requests, "summary": summary}


def _print_text(outputs: list[Output], summary: dict, baseline) -> None:
    for o in outputs:
        s = o.stats
        print(f"=== {o.id} ===")
        print(o.text)
        print(
            f"--- {len(o.tokens)} tokens in {s.seconds:.2f} s ({s.tokens_per_second:.1f} tok/s), "
            f"{s.mean_accepted:.2f} tokens/step, finish: {o.finish_reason}"
        )
    print()
    print(
        f"reader: {summary['new_tokens']} tokens in {summary['seconds']:.2f} s = "
        f"{summary['tokens_per_second']:.1f} tok/s, {summary['mean_accepted']:.2f} tokens/step; "
        f"time: draft {summary['draft_share']:.1%}, verify {summary['verify_share']:.1%}, "
        f"prefill {summary['prefill_share']:.1%}"
    )
    if baseline is not None:
        print(
            f"plain:  {summary['baseline_tokens_per_second']:.1f} tok/s "
            f"in {summary['baseline_seconds']:.2f} s; speedup {summary['speedup']:.2f}x; "
            f"identical outputs {summary['identical']}/{len(outputs)}"
        )


if __name__ == "__main__":
    sys.exit(main())
