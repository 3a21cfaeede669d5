"""Where a batch's decoding steps spend their time, on any device: ``torch.profiler`` over one run.

Spec-Bench prompts go through the engine (plain decoding or the reader drafter) at one batch size,
three times on different prompts: to warm up, timed, and under the profiler; prints the steps' wall
time, the profiler's top
operators by host time and, on a GPU, kernel launches per step and how long the GPU was busy. A pass
bound by launches shows a GPU busy for a small part of each step (on an H200 with the default model,
1.8 of 12.8 ms at batch 1; docs/runner.md, "On a GPU"): there, what a step costs is the host's work,
which grows with the batch and its trees.

    .venv/bin/python scripts/profile_steps.py [--device cuda] [--method reader] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from reader_spec.bench.spec_bench import interleave_categories, load_questions, per_category
from reader_spec.config import GenerationConfig
from reader_spec.drafters import ReaderDrafter
from reader_spec.engine.loop import Engine
from reader_spec.engine.runner import synchronizer
from reader_spec.loading import load_model
from reader_spec.prompts import encode_prompt

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")


def run_steps(engine: Engine, prompts: list[list[int]], config: GenerationConfig) -> int:
    """All prompts to the end, step by step (the engine keeps at most its batch size running);
    returns the number of steps."""
    for prompt in prompts:
        engine.add_request(prompt, config)
    steps = 0
    while engine.step():
        steps += 1
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--method", choices=("ar", "reader"), default="ar")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument(
        "--prompts", type=int, default=0, help="prompts in each of the three runs (default: the batch size)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rows", type=int, default=25, help="operators shown in each table")
    args = parser.parse_args()

    loaded = load_model(args.model, device=args.device)
    count = args.prompts or args.batch_size
    questions = interleave_categories(per_category(load_questions(), limit=3 * count // 13 + 1))
    prompts = [encode_prompt(loaded.tokenizer, q.messages) for q in questions]
    if len(prompts) < 3 * count:
        parser.error(f"the suite has {len(prompts)} prompts, fewer than the 3 x {count} the runs need")
    # Three runs (warm-up, timed, profiled) on different prompts: the reader drafter's history of
    # earlier responses would otherwise draft a repeated prompt's whole answer.
    warm_prompts, timed_prompts, profiled_prompts = (prompts[i * count : (i + 1) * count] for i in range(3))
    drafter = ReaderDrafter() if args.method == "reader" else None
    engine = Engine(loaded, drafter, max_batch_size=args.batch_size)
    engine.warm_up(args.batch_size, prompt_tokens=max(map(len, prompts)))
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    synchronize = synchronizer(loaded.model.device)
    run_steps(engine, warm_prompts, config)

    synchronize()
    started = time.perf_counter()
    steps = run_steps(engine, timed_prompts, config)
    synchronize()
    seconds = time.perf_counter() - started
    print(
        f"{args.method} at batch {args.batch_size} on {args.device}: {steps} steps, "
        f"{1e3 * seconds / steps:.2f} ms per step (prefill included), unprofiled"
    )

    on_gpu = loaded.model.device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]
    with profile(activities=activities) as profiled:
        steps = run_steps(engine, profiled_prompts, config)
        synchronize()
    events = profiled.key_averages()
    if on_gpu:
        launches = sum(e.count for e in events if e.key in LAUNCHES)
        kernels = (e for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        busy = sum(e.self_device_time_total for e in kernels) / 1e3
        print(f"kernel launches per step: {launches / steps:.0f}; GPU busy {busy / steps:.2f} ms per step")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if on_gpu:
        print(events.table(sort_by="self_device_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
