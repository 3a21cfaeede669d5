"""The ``reader`` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from reader_spec.config import GenerationConfig
from reader_spec.datastore import META_FILE, Datastore, DatastoreError, check_output
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
    except (ModelLoadError, PromptError, DatastoreError, ValueError, OSError) as e:
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
        description="Run prompts through several decoding methods in one process and report speedups over "
        "plain decoding (ar), mean accepted tokens per step and exactness, per category.",
    )
    bench.add_argument(
        "--model", help="hub id, local directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    bench.add_argument(
        "--suite", help="JSONL with question_id, category, turns (default: Spec-Bench, shipped)"
    )
    bench.add_argument("--categories", nargs="+", help="only these categories")
    bench.add_argument("--limit", type=int, default=None, help="prompts per category (default: all)")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--methods", nargs="+", default=["ar", "reader"], help="from: ar, reader")
    bench.add_argument("--batch-sizes", nargs="+", type=int, default=[1])
    bench.add_argument("--repeats", type=int, default=1, help="runs per prompt; the median time counts")
    bench.add_argument("--budget", type=int, default=DEFAULT_BUDGET)
    bench.add_argument("--out", help="directory for results.json and results.md")
    bench.set_defaults(handler=_bench)
    _add_index_commands(commands)
    return parser


def _add_index_commands(commands) -> None:
    index = commands.add_parser(
        "index",
        help="build and inspect datastores (READER's long-term retrieval index)",
        description="A datastore is a tokenized corpus with a suffix array; drafters propose what followed "
        "the current text's longest suffix found in it.",
    )
    actions = index.add_subparsers(dest="index_command", required=True)
    build = actions.add_parser(
        "build",
        help="index files and/or the model's own answers",
        description="Tokenize documents with the model's tokenizer and index them. --input files: .jsonl "
        '(optionally .gz) lines {"text"}, {"messages"}, {"prompt"} or {"turns"}; any other file is one '
        "plain-text document. --from-model: the model's greedy answers to the prompts, stored with their "
        "prompts as the token ids the model saw and produced.",
    )
    build.add_argument(
        "--model", help="hub id, local directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    build.add_argument("--input", nargs="+", default=[], metavar="FILE", help="documents to index")
    build.add_argument(
        "--from-model",
        metavar="PROMPTS.jsonl",
        help='prompts to answer: {"id", "prompt"|"messages"} lines or Spec-Bench questions (first turn)',
    )
    build.add_argument(
        "--question-ids",
        choices=["all", "odd", "even"],
        default="all",
        help="answer only prompts with odd or even integer ids (default: all)",
    )
    build.add_argument("--max-new-tokens", type=int, default=256, help="answer length limit (256)")
    build.add_argument("--batch-size", type=int, default=1, help="prompts answered together (default 1)")
    build.add_argument(
        "--output", required=True, help="datastore directory (replaced once the build is done)"
    )
    build.set_defaults(handler=_index_build)

    info = actions.add_parser("info", help="size and provenance of a datastore")
    info.add_argument("path", metavar="DIR")
    info.add_argument("--verify", action="store_true", help="also check every file's checksum")
    info.set_defaults(handler=_index_info)


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
    questions = per_category(load_questions(args.suite), args.limit, args.categories)
    loaded = load_model(args.model)
    report = run_bench(
        loaded,
        questions,
        args.methods,
        max_new_tokens=args.max_new_tokens,
        repeats=args.repeats,
        batch_sizes=args.batch_sizes,
        budget=args.budget,
    )
    print(report.markdown())
    if args.out:
        report.save(Path(args.out))
        print(f"\nwrote {Path(args.out) / 'results.json'} and {Path(args.out) / 'results.md'}")
    return 0


def _index_build(args: argparse.Namespace) -> int:
    from itertools import chain

    from reader_spec.corpus import answer_documents, file_documents, file_sources, read_prompts
    from reader_spec.loading import LoadedModel, LoadedTokenizer, load_tokenizer

    if not args.input and not args.from_model:
        raise ValueError("nothing to index: give --input FILES, --from-model PROMPTS.jsonl, or both")
    if args.max_new_tokens < 1 or args.batch_size < 1:
        raise ValueError("--max-new-tokens and --batch-size must be positive")
    check_output(Path(args.output))
    sources = file_sources(args.input)
    answers: list[list[int]] = []
    loaded: LoadedModel | LoadedTokenizer
    if args.from_model:
        records = read_prompts(args.from_model, args.question_ids)
        if not records:
            raise PromptError(f"{args.from_model}: no prompts with {args.question_ids} ids")
        loaded = load_model(args.model)
        with tqdm(total=len(records), desc="answering", unit="prompt", file=sys.stderr, leave=False) as bar:
            answers = answer_documents(
                loaded, records, args.max_new_tokens, args.batch_size, on_finish=lambda _: bar.update()
            )
        sources.append(
            {
                **file_sources([args.from_model])[0],
                "kind": "model answers",
                "question_ids": args.question_ids,
                "prompts": len(records),
                "max_new_tokens": args.max_new_tokens,
            }
        )
    else:
        loaded = load_tokenizer(args.model)  # the weights are not needed
    files = file_documents(loaded.tokenizer, args.input)
    read = tqdm(files, desc="tokenizing", unit="doc", file=sys.stderr, leave=False)
    store = Datastore.build(
        args.output, chain(read, answers), fingerprint=loaded.fingerprint, model=loaded.name, sources=sources
    )
    _print_datastore(store, verified=False)
    return 0


def _index_info(args: argparse.Namespace) -> int:
    _print_datastore(Datastore.open(args.path, verify=args.verify), verified=args.verify)
    return 0


def _print_datastore(store: Datastore, verified: bool, shown_sources: int = 10) -> None:
    meta = store.meta
    files = ", ".join(f"{name} {_size(f.bytes)}" for name, f in meta.files.items())
    print(f"datastore: {store.path}")
    print(f"tokens: {meta.tokens:,} in {meta.documents:,} documents")
    print(f"size on disk: {_size(store.disk_bytes)} ({files}, {META_FILE})")
    print(f"model: {meta.model}")
    print(f"tokenizer fingerprint: {meta.tokenizer_fingerprint}")
    print(f"built: {meta.built} in {meta.build_seconds:.1f} s, format version {meta.format_version}")
    print(f"checksums: {'verified' if verified else 'not checked (--verify checks them)'}")
    print(f"sources: {len(meta.sources)}")
    for source in meta.sources[:shown_sources]:
        shown = {k: v for k, v in source.items() if k not in ("path", "bytes") and (k, v) != ("kind", "file")}
        details = "".join(f", {k} {v}" for k, v in shown.items())
        print(f"  {source.get('path')} ({_size(source.get('bytes', 0))}{details})")
    if len(meta.sources) > shown_sources:
        print(f"  ... and {len(meta.sources) - shown_sources} more")


def _size(size: float) -> str:
    for unit in ("B", "kB", "MB"):
        if size < 1000:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.2f} GB"


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
