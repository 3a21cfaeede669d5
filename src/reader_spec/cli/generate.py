"""``reader generate``: speculative decoding of prompts given on the command line or in a JSONL file."""

from __future__ import annotations

import argparse
import json
import math
import secrets
import sys
import time
from collections import Counter
from dataclasses import replace

from tqdm import tqdm

from reader_spec.cli.common import (
    add_drafting_options,
    add_model_option,
    add_prefix_reuse_option,
    add_sampling_options,
    build_engine,
    load_target,
    sampling_settings,
)
from reader_spec.config import GenerationConfig
from reader_spec.engine.loop import Engine
from reader_spec.engine.sequence import Output, mean_accepted
from reader_spec.prompts import InputRecord, PromptError, read_jsonl


def add_parser(commands: argparse._SubParsersAction) -> None:
    description = "Generate with retrieval-drafted speculative decoding; the output equals plain decoding's."
    gen = commands.add_parser(
        "generate", help="generate text with speculative decoding", description=description
    )
    add_model_option(gen)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt")
    source.add_argument("--input", help='JSONL file of {"id", "messages"} or {"id", "prompt"} lines')
    gen.add_argument(
        "--chat", action="store_true", help="send --prompt as a user message through the chat template"
    )
    gen.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate per prompt (128)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_sampling_options(gen)
    gen.add_argument("--batch-size", type=int, default=1, help="requests decoded together (default 1)")
    add_drafting_options(gen)
    add_prefix_reuse_option(gen)
    gen.add_argument("--compare", action="store_true", help="also run plain decoding and report the speedup")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    gen.add_argument(
        "--logprobs",
        type=int,
        metavar="K",
        help="record each output token's log-probability under the model and the K likeliest tokens "
        "at its position (0: the token's alone): listed with --json, summed up as perplexity otherwise",
    )
    gen.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.input:
        records = list(read_jsonl(args.input))
        if not records:
            raise PromptError(f"{args.input}: no prompts")
    else:
        prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
        records = [InputRecord(0, prompt)]
    config = request_configs(args, records)
    if args.compare:
        # Plain and speculative runs must draw the same randomness to be comparable token for token.
        config = [
            c if c.greedy or c.seed is not None else replace(c, seed=secrets.randbits(63)) for c in config
        ]
    if args.batch_size < 1:
        raise ValueError("--batch-size must be at least 1")
    loaded = load_target(args)
    engine = build_engine(args, loaded, max_batch_size=args.batch_size)
    prompts = [engine.encode(r.prompt) for r in records]  # bad prompts fail before any model work
    for record, request_config in zip(records, config, strict=True):
        try:
            engine.check_config(request_config)
        except ValueError as e:
            raise PromptError(f"request {record.id!r}: {e}") from None
    ids = [r.id for r in records]
    engine.warm_up(args.batch_size)

    outputs, seconds = _timed_run(engine, prompts, ids, config, args.batch_size, "reader")
    baseline, baseline_seconds = None, None
    if args.compare:
        plain = Engine(loaded, runner=args.runner, reuse_prefixes=not args.no_prefix_reuse)
        plain.warm_up(args.batch_size)  # as the speculative engine was: neither run pays a first pass
        baseline, baseline_seconds = _timed_run(plain, prompts, ids, config, args.batch_size, "plain")

    summary = _summary(outputs, seconds, baseline, baseline_seconds)
    if args.json:
        print(json.dumps(_as_json(loaded.name, outputs, summary, baseline), ensure_ascii=False))
    else:
        _print_text(outputs, summary, baseline)
    return 0


def request_configs(args: argparse.Namespace, records: list[InputRecord]) -> list[GenerationConfig]:
    base = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        stop_strings=tuple(args.stop),
        logprobs=args.logprobs,
        **sampling_settings(args),
    )
    configs = []
    for record in records:
        try:
            configs.append(replace(base, **record.settings))
        except (TypeError, ValueError) as e:
            raise PromptError(f"request {record.id!r}: {e}") from None
    return configs


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
    busy = sum(o.stats.seconds for o in outputs) or 1.0
    summary = {
        "requests": len(outputs),
        "new_tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "mean_accepted": mean_accepted(tokens, steps),
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
        if o.logprobs is not None:
            entry["logprobs"] = [
                {"token": lp.token, "logprob": lp.logprob, "top": [list(pair) for pair in lp.top]}
                for lp in o.logprobs
            ]
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
        if o.logprobs:
            mean = sum(lp.logprob for lp in o.logprobs) / len(o.logprobs)
            print(f"--- mean log-probability {mean:.3f}, perplexity {math.exp(-mean):.2f}")
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
