"""The ``reader`` command line."""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import get_args

from tqdm import tqdm

from reader_spec.bench_methods import METHODS
from reader_spec.config import SAMPLING_FIELDS, GenerationConfig
from reader_spec.datastore import META_FILE, Datastore, DatastoreError, check_output
from reader_spec.drafters import ReaderDrafter
from reader_spec.drafters.history import DEFAULT_MAX_TOKENS
from reader_spec.engine import DEFAULT_BUDGET, Engine, Output
from reader_spec.loading import ModelLoadError, load_model
from reader_spec.prompts import InputRecord, PromptError, read_jsonl
from reader_spec.spec_bench import IdFilter


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
    _add_sampling_options(gen)
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
    gen.add_argument(
        "--drafter",
        choices=["reader", "none"],
        default="reader",
        help="reader: retrieval drafts from the request, earlier responses and --datastore; none: plain",
    )
    gen.add_argument("--datastore", metavar="DIR", help="corpus datastore built by `reader index build`")
    gen.add_argument(
        "--no-history", action="store_true", help="do not draft from earlier responses of this run"
    )
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
    bench.add_argument(
        "--question-ids",
        choices=get_args(IdFilter),
        default="all",
        help="only questions with odd or even ids, e.g. even ones against a datastore of the odd ones",
    )
    bench.add_argument("--limit", type=int, default=None, help="questions per category (default: all)")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument(
        "--methods",
        nargs="+",
        type=_names,
        help=f"from: {', '.join(METHODS)} (default: all; hf-assisted only with --draft-model); with "
        "--replay, from: pld, suffix, reader (default: all)",
    )
    bench.add_argument(
        "--batch-sizes", nargs="+", type=int, default=[1], help="1: per-prompt figures; above 1: throughput"
    )
    bench.add_argument("--repeats", type=int, default=1, help="runs per prompt; the median-time run counts")
    bench.add_argument(
        "--budget", type=int, default=DEFAULT_BUDGET, help="draft budget of engine methods without their own"
    )
    bench.add_argument("--out", help="directory for results.json, results.md and PNG plots")
    bench.add_argument("--datastore", metavar="DIR", help="corpus datastore for the reader method")
    _add_sampling_options(bench)
    bench.add_argument(
        "--replay",
        metavar="FILE",
        help="instead, replay recorded conversations (JSONL, optionally .gz, of {messages: [...]}) through "
        "drafters, without running the model (only its tokenizer): accepted tokens per step per method; "
        "--limit counts tasks, --out gets replay.json and replay.md",
    )
    bench.set_defaults(handler=_bench)
    _add_index_commands(commands)
    return parser


def _add_sampling_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "sampling", "exact sampling of the model's distribution; input lines may override each setting"
    )
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy decoding (default)")
    group.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    group.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top one")
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--seed", type=int, help="makes sampled output reproducible, whatever the drafter")


def _sampling_settings(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in SAMPLING_FIELDS}


def _request_configs(args: argparse.Namespace, records: list[InputRecord]) -> list[GenerationConfig]:
    base = GenerationConfig(
        max_new_tokens=args.max_new_tokens, stop_strings=tuple(args.stop), **_sampling_settings(args)
    )
    configs = []
    for record in records:
        try:
            configs.append(replace(base, **record.settings))
        except (TypeError, ValueError) as e:
            raise PromptError(f"request {record.id!r}: {e}") from None
    return configs


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
        choices=get_args(IdFilter),
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
    config = _request_configs(args, records)
    if args.compare:
        # Plain and speculative runs must draw the same randomness to be comparable token for token.
        config = [
            c if c.greedy or c.seed is not None else replace(c, seed=secrets.randbits(63)) for c in config
        ]
    if args.batch_size < 1:
        raise ValueError("--batch-size must be at least 1")
    loaded = load_model(args.model)
    drafter = None
    if args.drafter == "reader":
        datastore = Datastore.open(args.datastore, fingerprint=loaded.fingerprint) if args.datastore else None
        drafter = ReaderDrafter(
            history_tokens=0 if args.no_history else DEFAULT_MAX_TOKENS, datastore=datastore
        )
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
    if args.replay is not None:
        return _bench_replay(args)
    from reader_spec.bench import run_bench
    from reader_spec.spec_bench import by_id_parity, load_questions, per_category

    if args.repeats < 1 or (args.limit is not None and args.limit < 1) or min(args.batch_sizes) < 1:
        raise ValueError("--repeats, --limit and --batch-sizes must be positive")
    methods = [m for group in args.methods for m in group] if args.methods else None
    unknown = [m for m in methods or [] if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if methods and "hf-assisted" in methods and not args.draft_model:
        raise ValueError("hf-assisted needs --draft-model")
    categories = [c for group in args.categories for c in group] if args.categories else None
    questions = by_id_parity(load_questions(args.suite), args.question_ids)
    questions = per_category(questions, args.limit, categories)
    loaded = load_model(args.model)
    draft = load_model(args.draft_model) if args.draft_model else None
    datastore = Datastore.open(args.datastore, fingerprint=loaded.fingerprint) if args.datastore else None
    # Every method must draw the same randomness for outputs to compare: a seed is always set.
    sampling = GenerationConfig(**{**_sampling_settings(args), "seed": args.seed or 0})
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
    )
    print(report.markdown())
    if args.out:
        written = report.save(Path(args.out))
        print(f"\nwrote {', '.join(str(p) for p in written)}")
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


def _bench_replay(args: argparse.Namespace) -> int:
    from reader_spec.loading import load_tokenizer, weights_cache_dir
    from reader_spec.replay import METHODS, load_conversations, run_replay

    methods = [m for names in args.methods or [list(METHODS)] for m in names]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"unknown replay method {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if args.budget < 1 or (args.limit is not None and args.limit < 1):
        raise ValueError("--budget and --limit must be positive")
    loaded = load_tokenizer(args.model)
    conversations = load_conversations(
        args.replay, loaded.tokenizer, loaded.fingerprint, weights_cache_dir().parent / "replay"
    )[: args.limit]
    drafters = {m: METHODS[m](args.budget) for m in dict.fromkeys(methods)}
    settings = {"file": str(args.replay), "model": loaded.name}
    report = run_replay(conversations, drafters, args.budget, settings=settings)
    print(report.markdown())
    if args.out:
        report.save(Path(args.out))
        print(f"\nwrote {Path(args.out) / 'replay.json'} and {Path(args.out) / 'replay.md'}")
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
        "accepted_by_source": dict(sum((Counter(o.stats.accepted_by_source) for o in outputs), Counter())),
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
    accepted = summary["accepted_by_source"]
    if accepted:
        total = sum(accepted.values())
        shares = ", ".join(f"{name} {count / total:.0%}" for name, count in sorted(accepted.items()))
        print(f"accepted draft tokens by source: {shares}")
    if baseline is not None:
        print(
            f"plain:  {summary['baseline_tokens_per_second']:.1f} tok/s "
            f"in {summary['baseline_seconds']:.2f} s; speedup {summary['speedup']:.2f}x; "
            f"identical outputs {summary['identical']}/{len(outputs)}"
        )


if __name__ == "__main__":
    sys.exit(main())
