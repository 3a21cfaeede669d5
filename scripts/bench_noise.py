"""How far one batched `reader bench` speedup moves with nothing changed: plain decoding against itself.

Two `ar` engines (built as the bench builds methods, on one packed copy of the model) run the bench's
batched prompts, taking turns exactly as `reader bench` runs methods at a batch size, who goes first
alternating between repeats; the earlier turns' answers come from a third engine, as in the bench.
Prints each repeat's ratio (the first engine's seconds over the second's) and their median, minimum
and maximum per batch size: a `reader`/`ar` speedup inside that range is not told apart from 1.00
(docs/runner.md, "Session 56").

    .venv/bin/python scripts/bench_noise.py [--batch-sizes 8 32] [--repeats 5] [--limit 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from tqdm import tqdm

from reader_spec.bench.methods import DEFAULT_BUDGET, METHODS, BenchSetup
from reader_spec.bench.results import REFERENCE
from reader_spec.bench.runner import batched_prompts, in_turns
from reader_spec.bench.spec_bench import load_questions, per_category
from reader_spec.config import GenerationConfig
from reader_spec.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="hub id, local directory or .gguf file (default: the default model)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--limit", type=int, default=2, help="questions per category")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    if args.repeats < 1 or min(args.batch_sizes) < 1:
        parser.error("repeats and batch sizes must be positive")
    loaded = load_model(args.model)
    questions = per_category(load_questions(), args.limit)
    setup = BenchSetup(loaded, DEFAULT_BUDGET, None, None, GenerationConfig(), "auto", True)
    first, second = (METHODS[REFERENCE].build(setup) for _ in range(2))
    for method in (first, second):
        method.warm_up(max(args.batch_sizes))
    filler = METHODS[REFERENCE].build(setup)
    prompts = batched_prompts(filler, loaded.tokenizer, questions, args.max_new_tokens)
    print(
        f"{len(prompts)} prompts, {args.max_new_tokens} new tokens; ratio: first engine's seconds / second's"
    )
    total = len(prompts) * 2 * args.repeats * len(args.batch_sizes)
    with tqdm(total=total, desc="ar against ar", unit="request", file=sys.stderr) as bar:
        for size in args.batch_sizes:
            ratios = []
            for repeat in range(args.repeats):
                order = {"first": first, "second": second}
                if repeat % 2:
                    order = dict(reversed(order.items()))
                for method in order.values():
                    method.reset()
                    method.reserve(prompts, args.max_new_tokens, size)
                runs = in_turns(order, prompts, args.max_new_tokens, size, bar)
                ratios.append(runs["first"].seconds / runs["second"].seconds)
                tqdm.write(f"batch {size}, repeat {repeat + 1}: ratio {ratios[-1]:.4f}", file=sys.stdout)
            print(
                f"batch {size}: ratios {' '.join(f'{r:.4f}' for r in ratios)}; median "
                f"{statistics.median(ratios):.4f}, min {min(ratios):.4f}, max {max(ratios):.4f}"
            )


if __name__ == "__main__":
    main()
