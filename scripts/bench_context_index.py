"""Time the context drafter's index build and per-step work on synthetic token streams (no model).

A verification pass costs ~60-150 ms on this project's CPU, so indexing a long prompt and drafting each
step must cost a small fraction of that. Two streams over a 49,152-token vocabulary bracket real text:
"phrases" repeats sentences drawn (Zipf-like) from a small pool, as documents quoted in answers do;
"uniform" never repeats, so almost every lookup misses. A decode loop replays the stream's own
continuation as if it were the target model's output (greedy tree walk), which also shows whether the
calibrated probabilities predict the accepted length.

    .venv/bin/python scripts/bench_context_index.py [--prompt-tokens 8000] [--steps 600]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Iterator

from reader_spec.bench.replay import replay_step
from reader_spec.drafters import ReaderDrafter

VOCAB = 49_152


def phrase_pool(rng: random.Random, pool_size: int = 400) -> list[list[int]]:
    """The sentences a phrase stream draws from, the most popular first."""
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(4, 16))] for _ in range(pool_size)]


def phrase_stream(rng: random.Random, pool_size: int = 400, filler: float = 0.15) -> Iterator[int]:
    """Sentences from a fixed pool, popular ones far more often, with some fresh random tokens between."""
    pool = phrase_pool(rng, pool_size)
    weights = [1.0 / (rank + 1) for rank in range(pool_size)]
    while True:
        if rng.random() < filler:
            yield from (rng.randrange(VOCAB) for _ in range(rng.randint(1, 6)))
        else:
            yield from rng.choices(pool, weights)[0]


def uniform_stream(rng: random.Random) -> Iterator[int]:
    while True:
        yield rng.randrange(VOCAB)


STREAMS: dict[str, Callable[[random.Random], Iterator[int]]] = {
    "phrases": phrase_stream,
    "uniform": uniform_stream,
}


def take(stream: Iterator[int], n: int) -> list[int]:
    return [next(stream) for _ in range(n)]


def summary_ms(samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return f"median {statistics.median(ordered) * 1e3:7.3f} ms   p99 {p99 * 1e3:7.3f} ms   (n={len(ordered)})"


def bench_build(prompt: list[int], repeats: int) -> list[float]:
    times = []
    for i in range(repeats):
        drafter = ReaderDrafter()
        start = time.perf_counter()
        drafter.begin(i, prompt)
        times.append(time.perf_counter() - start)
    return times


def bench_decode(prompt: list[int], output: list[int], max_nodes: int) -> dict[str, object]:
    drafter = ReaderDrafter()
    drafter.begin("r", prompt)
    hit_s, miss_s, feedback_s, expected, accepted = [], [], [], [], []
    position, root = 0, prompt[-1]
    while position < len(output):
        step = replay_step(drafter, "r", root, output[position:], max_nodes)
        (hit_s if step.proposal else miss_s).append(step.propose_seconds)
        feedback_s.append(step.feedback_seconds)
        expected.append(sum(step.proposal.probs))
        accepted.append(step.accepted)
        position += len(step.emitted)
        root = step.emitted[-1]
    late = len(accepted) // 2  # calibration has warmed up by the second half
    return {
        "steps": len(accepted),
        "propose, drafted": summary_ms(hit_s) if hit_s else "never",
        "propose, no match": summary_ms(miss_s) if miss_s else "never",
        "observe + extend": summary_ms(feedback_s),
        "tokens/step": sum(accepted) / len(accepted) + 1,
        "expected (2nd half)": sum(expected[late:]) / len(expected[late:]),
        "accepted (2nd half)": sum(accepted[late:]) / len(accepted[late:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=8000)
    parser.add_argument("--output-tokens", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=50, help="index builds timed per stream")
    parser.add_argument("--max-nodes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    for name, make in STREAMS.items():
        stream = make(random.Random(args.seed))
        prompt = take(stream, args.prompt_tokens)
        output = take(stream, args.output_tokens)
        print(f"== {name} stream: {args.prompt_tokens}-token prompt")
        print(f"  build index           {summary_ms(bench_build(prompt, args.repeats))}")
        for max_nodes in args.max_nodes:
            result = bench_decode(prompt, output, max_nodes)
            print(f"  decode, max_nodes={max_nodes}, {result['steps']} steps")
            print(f"    propose, drafted    {result['propose, drafted']}")
            print(f"    propose, no match   {result['propose, no match']}")
            print(f"    observe + extend    {result['observe + extend']}")
            print(
                f"    tokens/step {result['tokens/step']:.2f}; 2nd half: expected accepted "
                f"{result['expected (2nd half)']:.2f}, accepted {result['accepted (2nd half)']:.2f}"
            )


if __name__ == "__main__":
    main()
