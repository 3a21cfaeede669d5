"""Build a datastore of 50M+ tokens from local text and time lookups (no model weights, no downloads).

Corpus, with the default model's tokenizer: the agentic traces' test split (chat messages, gzipped JSONL),
the Spec-Bench questions, then Python sources from this environment's site-packages in path order until
about ``--target-tokens`` (estimated from file sizes at 3.6 characters per token). Every 50th Python
file is held out, as is the agentic dev split; lookups use the last ``--context`` tokens before random
positions of that held-out text, as a drafter would while generating it.

Prints build time (tokenization included), peak RSS, size on disk, open time and the lookup latency
median and p99 (each query's first call, and its best of 3, which removes the scheduling noise of a
shared machine), plus how long the matches were.

    nice -n 10 .venv/bin/python scripts/bench_datastore.py [--output /tmp/reader-bench-datastore]
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import sys
import sysconfig
import time
from pathlib import Path

from tqdm import tqdm

from reader_spec.bench.spec_bench import default_suite
from reader_spec.drafters.retrieval.corpus import (
    file_documents,
    file_sources,
    read_documents,
    tokenize_documents,
)
from reader_spec.drafters.retrieval.datastore import Datastore
from reader_spec.loading import load_tokenizer

AGENTIC = Path("/work/shared/data/agentic")
CHARS_PER_TOKEN = 3.6
HOLD_OUT_EVERY = 50


def corpus_files(target_tokens: int) -> tuple[list[Path], list[Path]]:
    """(indexed files, held-out files)."""
    indexed = [AGENTIC / "deepseek_chat_test_1-100.jsonl.gz", default_suite()]
    held_out = [AGENTIC / "deepseek_chat_dev.jsonl.gz"]
    site = Path(sysconfig.get_paths()["purelib"])
    budget = target_tokens * CHARS_PER_TOKEN - sum(p.stat().st_size for p in indexed) * 4  # gz: ~4x
    for number, path in enumerate(sorted(site.rglob("*.py"))):
        if not path.is_file():
            continue
        if number % HOLD_OUT_EVERY == 0:
            held_out.append(path)
        elif budget > 0:
            indexed.append(path)
            budget -= path.stat().st_size
    return indexed, held_out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output", default="/tmp/reader-bench-datastore")
    parser.add_argument("--target-tokens", type=int, default=52_000_000)
    parser.add_argument("--lookups", type=int, default=10_000)
    parser.add_argument("--context", type=int, default=64, help="tokens of context per lookup")
    args = parser.parse_args()

    loaded = load_tokenizer()
    indexed, held_out = corpus_files(args.target_tokens)
    print(f"model: {loaded.name}, tokenizer fingerprint {loaded.fingerprint}")
    print(f"files: {len(indexed)} indexed ({sum(p.stat().st_size for p in indexed) / 1e6:.0f} MB on disk)")

    started = time.perf_counter()
    documents = file_documents(loaded.tokenizer, indexed)
    store = Datastore.build(
        args.output,
        tqdm(documents, desc="tokenizing", unit="doc", file=sys.stderr, mininterval=10),
        fingerprint=loaded.fingerprint,
        model=loaded.name,
        sources=file_sources(indexed),
    )
    build_seconds = time.perf_counter() - started
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kilobytes on Linux
    print(f"built: {len(store):,} tokens in {store.meta.documents:,} documents, {build_seconds:.1f} s in all")
    print(f"peak RSS: {peak_gb:.2f} GB; size on disk: {store.disk_bytes / 1e6:.0f} MB")
    del store

    started = time.perf_counter()
    store = Datastore.open(args.output, fingerprint=loaded.fingerprint)
    print(f"open: {(time.perf_counter() - started) * 1e3:.2f} ms")

    rng = random.Random(0)
    texts = [d for path in held_out for d in read_documents(path)]
    streams = [ids for ids in tokenize_documents(loaded.tokenizer, texts) if len(ids) > args.context]
    queries = []
    for _ in range(args.lookups):
        ids = rng.choice(streams)
        end = rng.randrange(args.context, len(ids))
        queries.append(ids[end - args.context : end])
    for query in queries[:200]:  # warm the page cache and code paths, outside the timing
        store.lookup(query)
    seconds, best, lengths, drafts = [], [], [], []
    for query in queries:
        times = []
        for _ in range(3):
            start = time.perf_counter_ns()
            found = store.lookup(query)
            times.append((time.perf_counter_ns() - start) / 1e6)
        seconds.append(times[0])
        best.append(min(times))
        lengths.append(found.match_length)
        drafts.append(len(found.continuations))
    print(f"lookup: {len(queries):,} held-out contexts of {args.context} tokens, default settings")
    for label, values in (("first call", seconds), ("best of 3 (without scheduling noise)", best)):
        print(
            f"  {label}: median {statistics.median(values):.3f} ms, "
            f"p99 {percentile(values, 0.99):.3f} ms, max {max(values):.3f} ms"
        )
    print(f"  load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(
        f"match length: mean {statistics.mean(lengths):.1f}, median {statistics.median(lengths):.0f}, "
        f">= 4 tokens in {sum(n >= 4 for n in lengths) / len(lengths):.0%}; "
        f"distinct continuations per lookup: mean {statistics.mean(drafts):.1f}"
    )


if __name__ == "__main__":
    main()
