"""``reader bench-serve``: the OpenAI server under concurrent streaming load, speculation on and off.

The server (fastapi, uvicorn) and the HTTP client (httpx) are imported only when the command runs:
``reader generate`` never loads them.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
from pathlib import Path

from reader_spec.cli.common import (
    add_budget_option,
    add_model_option,
    add_prefix_reuse_option,
    load_target,
    open_datastore,
)

NEEDED = ("fastapi", "uvicorn", "prometheus_client", "httpx")

log = logging.getLogger("reader_spec.bench")


def add_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser(
        "bench-serve",
        help="load the OpenAI server with concurrent streaming requests, speculation on and off",
        description="Start the server in this process and drive it with concurrent streaming chat "
        "clients over Spec-Bench questions (categories interleaved; first turns, or whole conversations "
        "with --turns all): at each concurrency, "
        "speculation off then on, batch size = concurrency. Reports throughput, time to first token and "
        "inter-token latency (p50, p99), the speedup of speculation, and whether outputs are identical.",
    )
    add_model_option(bench)
    add_prefix_reuse_option(bench)
    bench.add_argument(
        "--concurrency",
        nargs="+",
        type=int,
        default=[1, 8, 32],
        metavar="N",
        help="clients sending requests at once (default: 1 8 32)",
    )
    bench.add_argument("--limit", type=int, default=1, help="questions per category (default 1)")
    bench.add_argument(
        "--turns",
        choices=["first", "all"],
        default="first",
        help="first: each question's first message; all: a client sends a question's every message in "
        "turn, each after the answer to the last, with the conversation so far (default first)",
    )
    bench.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt (128)")
    add_budget_option(bench)
    bench.add_argument("--datastore", metavar="DIR", help="corpus datastore for the READER drafter")
    bench.add_argument("--out", help="directory for serve.json and serve.md")
    bench.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if any(importlib.util.find_spec(name) is None for name in NEEDED):
        raise ValueError(
            "reader bench-serve needs the serve and bench extras: pip install 'reader-spec[serve,bench]'"
        )
    if min(args.concurrency) < 1 or args.limit < 1 or args.max_new_tokens < 1 or args.budget < 0:
        raise ValueError("--concurrency, --limit and --max-new-tokens must be positive; --budget >= 0")
    from reader_spec.bench.environment import environment
    from reader_spec.bench.serve_load import run_serve_load
    from reader_spec.bench.spec_bench import interleave_categories, load_questions, per_category

    questions = interleave_categories(per_category(load_questions(), args.limit))
    conversations = [list(q.turns) if args.turns == "all" else [q.turns[0]] for q in questions]
    if len(conversations) < max(args.concurrency):
        log.info(
            "%d conversations: concurrency above that never has more requests in flight (raise --limit)",
            len(conversations),
        )
    loaded = load_target(args)
    datastore = open_datastore(args, loaded)
    report = run_serve_load(
        loaded,
        conversations,
        concurrency=args.concurrency,
        max_new_tokens=args.max_new_tokens,
        budget=args.budget,
        datastore=datastore,
        runner=args.runner,
        reuse_prefixes=not args.no_prefix_reuse,
        environment=environment(loaded),
        progress=log.info,
    )
    report.settings["questions"] = [q.id for q in questions]
    report.settings["categories"] = sorted({q.category for q in questions})
    print(report.markdown())
    if args.out:
        written = report.save(Path(args.out))
        print(f"\nwrote {', '.join(str(p) for p in written)}")
    return 0
