"""``reader index``: build and inspect datastores, READER's long-term retrieval index."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import get_args

from tqdm import tqdm

from reader_spec.cli.common import add_model_option, load_target
from reader_spec.drafters.retrieval.datastore import META_FILE, Datastore, check_output
from reader_spec.prompts import IdFilter, PromptError


def add_parser(commands: argparse._SubParsersAction) -> None:
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
    add_model_option(build)  # --device, --dtype, --weights and --runner serve --from-model
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


def _index_build(args: argparse.Namespace) -> int:
    from itertools import chain

    from reader_spec.drafters.retrieval.corpus import (
        answer_documents,
        file_documents,
        file_sources,
        read_prompts,
    )
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
        loaded = load_target(args)
        with tqdm(total=len(records), desc="answering", unit="prompt", file=sys.stderr, leave=False) as bar:
            answers = answer_documents(
                loaded,
                records,
                args.max_new_tokens,
                args.batch_size,
                on_finish=lambda _: bar.update(),
                runner=args.runner,
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
