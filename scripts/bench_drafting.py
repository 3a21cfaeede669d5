"""Time a whole batch's drafting per step (propose + feed back), by drafter, batch size and context.

No model runs: each request's continuation is replayed as the target model's greedy output, as in
``reader bench --replay``. A batch of B requests, each with a C-token prompt drawn from the
phrase stream of ``bench_context_index.py`` (Zipf-popular sentences with fresh tokens between; each
request draws its own), is indexed (``begin``), then decodes ``--steps`` steps; a step is the batch's
proposals (``propose_all``: one ``propose_batch`` call where the drafter has one, as the engine calls
it) and every request's feedback (``observe`` + ``extend``). Prints the index build and the median and
p99 of the batch's drafting time per step (verifying against the recording is not counted).

``--datastore-tokens N`` adds a corpus datastore of N tokens to the drafters that read one
(``reader``): documents of sentences drawn, Zipf-popular, from the same pools as the requests' text,
built once and kept under the cache directory (``--datastore-dir``), so that lookups find long matches
with many occurrences, the expensive case.

    .venv/bin/python scripts/bench_drafting.py [--batch-sizes 1 8 32] [--contexts 1000 8000 64000]
        [--datastore-tokens 50000000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from bench_context_index import phrase_pool, phrase_stream, take

from reader_spec.bench.replay import settle
from reader_spec.drafters import DRAFTERS
from reader_spec.drafters.base import propose_all
from reader_spec.drafters.retrieval.datastore import Datastore, DatastoreError
from reader_spec.files import cache_root

FINGERPRINT = "synthetic-phrases"
DOCUMENT_SENTENCES = 200


def request_seeds(seed: int, batch: int) -> list[float]:
    """The seed of each request's phrase stream: request r has the same text at every batch size."""
    rng = random.Random(seed)
    return [rng.random() for _ in range(batch)]


def corpus(seeds: list[float], tokens: int, seed: int) -> Iterator[np.ndarray]:
    """Documents of Zipf-popular sentences from the requests' pools, ``tokens`` in all."""
    pools = [[np.array(s) for s in phrase_pool(random.Random(request_seed))] for request_seed in seeds]
    popularity = 1.0 / np.arange(1, len(pools[0]) + 1)
    popularity /= popularity.sum()
    rng = np.random.default_rng(seed)
    written = 0
    while written < tokens:
        pool = pools[rng.integers(len(pools))]
        document = np.concatenate([pool[i] for i in rng.choice(len(pool), DOCUMENT_SENTENCES, p=popularity)])
        written += len(document)
        yield document


def open_or_build(directory: Path, seeds: list[float], tokens: int, seed: int) -> Datastore:
    try:
        return Datastore.open(directory, fingerprint=FINGERPRINT)
    except (DatastoreError, FileNotFoundError):
        pass
    started = time.perf_counter()
    store = Datastore.build(
        directory, corpus(seeds, tokens, seed), fingerprint=FINGERPRINT, model="synthetic"
    )
    print(
        f"built a datastore of {store.meta.tokens:,} tokens in {time.perf_counter() - started:.0f} s "
        f"({directory})"
    )
    return store


def run(
    drafter_name: str,
    batch: int,
    context: int,
    steps: int,
    budget: int,
    seed: int,
    datastore: Datastore | None,
) -> dict[str, float]:
    drafter = DRAFTERS[drafter_name].build(datastore, None, "auto")
    spec_budget = DRAFTERS[drafter_name].budget or budget
    streams = [phrase_stream(random.Random(s)) for s in request_seeds(seed, batch)]
    prompts = [take(stream, context) for stream in streams]
    outputs = [take(stream, (spec_budget + 1) * steps) for stream in streams]  # the most a run emits
    started = time.perf_counter()
    for request, prompt in enumerate(prompts):
        drafter.begin(request, prompt)
    build = time.perf_counter() - started
    positions, roots = [0] * batch, [p[-1] for p in prompts]
    per_step, emitted = [], 0
    requests = list(range(batch))
    for _ in range(steps):
        started = time.perf_counter()
        proposals = propose_all(drafter, requests, spec_budget)
        seconds = time.perf_counter() - started
        for request, proposal in zip(requests, proposals, strict=True):
            recording = outputs[request][positions[request] :]
            step = settle(drafter, request, roots[request], recording, proposal.truncated(spec_budget))
            seconds += step.feedback_seconds
            positions[request] += len(step.emitted)
            roots[request] = step.emitted[-1]
            emitted += len(step.emitted)
        per_step.append(seconds)
    ordered = sorted(per_step)
    return {
        "build_s": build,
        "median_ms": statistics.median(ordered) * 1e3,
        "p99_ms": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] * 1e3,
        "tokens_per_step": emitted / (steps * batch),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--drafters",
        nargs="+",
        default=["pld", "suffix", "reader"],
        choices=[n for n, s in DRAFTERS.items() if not s.needs_draft_model],
    )
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--contexts", nargs="+", type=int, default=[1000, 8000, 64000])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument(
        "--budget", type=int, default=16, help="nodes per proposal for drafters without their own"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--datastore-tokens", type=int, default=0, help="corpus datastore size (0: none)")
    parser.add_argument("--datastore-dir", type=Path, help="where it is kept (default: the cache directory)")
    args = parser.parse_args()
    datastore = None
    if args.datastore_tokens:
        directory = args.datastore_dir or cache_root() / f"bench-drafting-{args.datastore_tokens}-{args.seed}"
        seeds = request_seeds(args.seed, max(args.batch_sizes))
        datastore = open_or_build(directory, seeds, args.datastore_tokens, args.seed)
    store = f"{datastore.meta.tokens:,}" if datastore is not None else "none"
    print(
        "| drafter | batch | context | datastore | index build s | drafting ms/step (median) | p99 "
        "| tokens/step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for context in args.contexts:
        for batch in args.batch_sizes:
            for name in args.drafters:
                r = run(name, batch, context, args.steps, args.budget, args.seed, datastore)
                print(
                    f"| {name} | {batch} | {context:,} | {store} | {r['build_s']:.2f} | "
                    f"{r['median_ms']:.2f} | {r['p99_ms']:.2f} | {r['tokens_per_step']:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
