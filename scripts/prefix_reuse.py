"""What prefix reuse saves a chat's next turn: Spec-Bench's two-turn questions as conversations.

Each question's first turn, then its second turn carrying the first answer, through one engine with
prefix reuse and one without (the engines take turns, question by question, so the host's drift hits
both alike). Prints, per turn, the prompt tokens, how many were found in the cache, the prefill's
seconds (the time to the first verified step: what a server's time to first token is made of) and the
whole request's, and whether both engines gave the same tokens.

    .venv/bin/python scripts/prefix_reuse.py [--limit 3] [--drafter reader|none]
"""

from __future__ import annotations

import argparse
import statistics

from reader_spec.bench.runner import turn_messages
from reader_spec.bench.spec_bench import load_questions, per_category
from reader_spec.config import GenerationConfig
from reader_spec.drafters import ReaderDrafter
from reader_spec.engine.loop import Engine
from reader_spec.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=int, default=3, help="questions per category (two-turn ones kept)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--drafter", choices=["reader", "none"], default="none")
    args = parser.parse_args()
    loaded = load_model()
    questions = [q for q in per_category(load_questions(), args.limit) if len(q.turns) > 1]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    engines = {
        reuse: Engine(loaded, ReaderDrafter() if args.drafter == "reader" else None, reuse_prefixes=reuse)
        for reuse in (True, False)
    }
    for engine in engines.values():
        engine.warm_up(prompt_tokens=1024)
        engine.forget_prefixes()
    figures: dict[tuple[bool, int], list[tuple[int, int, float, float]]] = {}
    same = 0
    for question in questions:
        outputs = {}
        for reuse, engine in engines.items():
            answers: list[str] = []
            for turn in range(2):
                messages = turn_messages(question, turn, answers)
                output = engine.generate([messages], config)[0]
                stats = output.stats
                figures.setdefault((reuse, turn), []).append(
                    (stats.prompt_tokens, stats.cached_tokens, stats.prefill_seconds, stats.seconds)
                )
                answers.append(output.text)
                outputs[reuse, turn] = output.tokens
        same += all(outputs[True, t] == outputs[False, t] for t in range(2))
    print(f"{len(questions)} two-turn questions, {args.max_new_tokens} new tokens, drafter {args.drafter}")
    print("| prefix reuse | turn | prompt tokens | in the cache | prefill s (mean) | request s (mean) |")
    print("|---|---:|---:|---:|---:|---:|")
    for (reuse, turn), rows in sorted(figures.items(), key=lambda item: (not item[0][0], item[0][1])):
        prompt, cached = sum(r[0] for r in rows), sum(r[1] for r in rows)
        prefill, seconds = statistics.mean(r[2] for r in rows), statistics.mean(r[3] for r in rows)
        mode = "on" if reuse else "off"
        print(f"| {mode} | {turn + 1} | {prompt:,} | {cached:,} | {prefill:.3f} | {seconds:.2f} |")
    print(f"both turns identical with and without reuse: {same} of {len(questions)} questions")


if __name__ == "__main__":
    main()
