"""Time a whole batch's drafting per step (propose + feed back), by drafter, batch size and context.

No model runs: each request's continuation is replayed as the target model's greedy output, as in
``reader bench --replay``. A batch of B requests, each with a C-token prompt drawn from the
phrase stream of ``bench_context_index.py`` (Zipf-popular sentences with fresh tokens between; each
request draws its own), is indexed (``begin``), then decodes ``--steps`` steps; a step is every
request's ``propose`` and ``observe`` + ``extend`` one after the other, as the engine runs them today.
Prints the index build and the median and p99 of the batch's drafting time per step.

    .venv/bin/python scripts/bench_drafting.py [--batch-sizes 1 8 32] [--contexts 1000 8000 64000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench_context_index import phrase_stream, take

from reader_spec.bench.replay import replay_step
from reader_spec.drafters import DRAFTERS


def run(drafter_name: str, batch: int, context: int, steps: int, budget: int, seed: int) -> dict[str, float]:
    drafter = DRAFTERS[drafter_name].build(None, None)
    spec_budget = DRAFTERS[drafter_name].budget or budget
    rng = random.Random(seed)
    streams = [phrase_stream(random.Random(rng.random())) for _ in range(batch)]
    prompts = [take(stream, context) for stream in streams]
    outputs = [take(stream, (spec_budget + 1) * steps) for stream in streams]  # the most a run emits
    started = time.perf_counter()
    for request, prompt in enumerate(prompts):
        drafter.begin(request, prompt)
    build = time.perf_counter() - started
    positions, roots = [0] * batch, [p[-1] for p in prompts]
    per_step, emitted = [], 0
    for _ in range(steps):
        started = time.perf_counter()
        for request in range(batch):
            step = replay_step(
                drafter, request, roots[request], outputs[request][positions[request] :], spec_budget
            )
            positions[request] += len(step.emitted)
            roots[request] = step.emitted[-1]
            emitted += len(step.emitted)
        per_step.append(time.perf_counter() - started)
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
    args = parser.parse_args()
    print("| drafter | batch | context | index build s | drafting ms/step (median) | p99 | tokens/step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for context in args.contexts:
        for batch in args.batch_sizes:
            for name in args.drafters:
                r = run(name, batch, context, args.steps, args.budget, args.seed)
                print(
                    f"| {name} | {batch} | {context:,} | {r['build_s']:.2f} | {r['median_ms']:.2f} | "
                    f"{r['p99_ms']:.2f} | {r['tokens_per_step']:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
