"""Side-by-side measurement of decoding methods on Spec-Bench-style prompts.

Every method runs in the same process on the same loaded model, prompt by prompt with the methods
interleaved (so machine drift hits all of them alike), after a warm-up; the time of a prompt is the
median over repeats. Speedups are against ``ar``, plain decoding on the same engine, and every
output is checked token for token against ``ar``'s.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from reader_spec.config import GenerationConfig
from reader_spec.drafters import ReaderDrafter
from reader_spec.engine import DEFAULT_BUDGET, Engine, Output
from reader_spec.loading import LoadedModel
from reader_spec.prompts import encode_prompt
from reader_spec.spec_bench import Question, interleave_categories

MethodFactory = Callable[[LoadedModel, int], Engine]

METHODS: dict[str, MethodFactory] = {
    "ar": lambda loaded, budget: Engine(loaded),
    "reader": lambda loaded, budget: Engine(loaded, ReaderDrafter(), budget=budget),
}
"""Methods of this engine; ``ar`` is the reference for speed and exactness."""


@dataclass
class PromptResult:
    question: int
    category: str
    method: str
    seconds: float
    new_tokens: int
    steps: int
    step_tokens: int
    drafted: int
    accepted: int
    draft_seconds: float
    verify_seconds: float
    identical: bool


@dataclass
class BatchResult:
    method: str
    batch_size: int
    seconds: float
    new_tokens: int
    identical: int
    requests: int

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


@dataclass
class BenchReport:
    environment: dict
    settings: dict
    prompts: list[PromptResult] = field(default_factory=list)
    batches: list[BatchResult] = field(default_factory=list)

    def category_table(self) -> list[dict]:
        """Per category and method: speedup over ``ar``, mean accepted tokens per step, exactness."""
        rows = []
        categories = sorted({r.category for r in self.prompts})
        methods = list(dict.fromkeys(r.method for r in self.prompts))
        for category in [*categories, "overall"]:
            chosen = [r for r in self.prompts if category in ("overall", r.category)]
            base = sum(r.seconds for r in chosen if r.method == "ar")
            for method in methods:
                mine = [r for r in chosen if r.method == method]
                seconds = sum(r.seconds for r in mine)
                steps = sum(r.steps for r in mine)
                rows.append(
                    {
                        "category": category,
                        "method": method,
                        "tokens_per_second": sum(r.new_tokens for r in mine) / seconds if seconds else 0.0,
                        "speedup": base / seconds if seconds else 0.0,
                        "mean_accepted": sum(r.step_tokens for r in mine) / steps if steps else 1.0,
                        "identical": sum(r.identical for r in mine) / len(mine) if mine else 0.0,
                        "draft_share": sum(r.draft_seconds for r in mine) / seconds if seconds else 0.0,
                        "verify_share": sum(r.verify_seconds for r in mine) / seconds if seconds else 0.0,
                    }
                )
        return rows

    def markdown(self) -> str:
        rows = self.category_table()
        methods = list(dict.fromkeys(r["method"] for r in rows))
        categories = list(dict.fromkeys(r["category"] for r in rows))
        cell = {(r["category"], r["method"]): r for r in rows}
        lines = [
            "| category | " + " | ".join(f"{m} speedup | {m} tokens/step" for m in methods) + " |",
            "|---|" + "---:|---:|" * len(methods),
        ]
        for category in categories:
            cells = [
                f"{cell[category, m]['speedup']:.2f}x | {cell[category, m]['mean_accepted']:.2f}"
                for m in methods
            ]
            lines.append(f"| {category} | " + " | ".join(cells) + " |")
        category_rows = [r for r in rows if r["category"] != "overall"]
        for m in methods:
            speedups = [r["speedup"] for r in category_rows if r["method"] == m]
            exact = cell["overall", m]["identical"]
            lines.append(
                f"\n{m}: mean speedup over categories {statistics.mean(speedups):.2f}x, "
                f"min {min(speedups):.2f}x; outputs identical to ar: {exact:.0%}; "
                f"{cell['overall', m]['tokens_per_second']:.1f} tokens/s"
            )
        if self.batches:
            lines += ["", "| method | batch | tokens/s | speedup | identical |", "|---|---:|---:|---:|---:|"]
            for b in self.batches:
                base = next(x for x in self.batches if x.method == "ar" and x.batch_size == b.batch_size)
                lines.append(
                    f"| {b.method} | {b.batch_size} | {b.tokens_per_second:.1f} | "
                    f"{b.tokens_per_second / base.tokens_per_second:.2f}x | {b.identical}/{b.requests} |"
                )
        return "\n".join(lines)

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        payload = {
            "environment": self.environment,
            "settings": self.settings,
            "categories": self.category_table(),
            "prompts": [asdict(r) for r in self.prompts],
            "batches": [asdict(b) | {"tokens_per_second": b.tokens_per_second} for b in self.batches],
        }
        _write_atomic(directory / "results.json", json.dumps(payload, indent=1))
        _write_atomic(directory / "results.md", self.markdown() + "\n")


def run_bench(
    loaded: LoadedModel,
    questions: Sequence[Question],
    methods: Sequence[str] = ("ar", "reader"),
    *,
    max_new_tokens: int = 128,
    repeats: int = 1,
    batch_sizes: Sequence[int] = (1,),
    budget: int = DEFAULT_BUDGET,
) -> BenchReport:
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {sorted(METHODS)}")
    methods = ["ar", *[m for m in methods if m != "ar"]]
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    engines = {m: METHODS[m](loaded, budget) for m in methods}
    for engine in engines.values():
        engine.warm_up(max(batch_sizes))
    report = BenchReport(
        environment=environment(loaded),
        settings={
            "methods": methods,
            "max_new_tokens": max_new_tokens,
            "repeats": repeats,
            "batch_sizes": list(batch_sizes),
            "budget": budget,
            "questions": [q.id for q in questions],
        },
    )
    prompts = [encode_prompt(loaded.tokenizer, q.messages) for q in questions]
    if 1 in batch_sizes:
        with tqdm(total=len(questions) * len(methods) * repeats, desc="batch 1", unit="run") as bar:
            for question, prompt in zip(questions, prompts, strict=True):
                reference = None
                for method in methods:
                    runs = [_timed(engines[method], [prompt], config, 1, bar) for _ in range(repeats)]
                    seconds = statistics.median(s for s, _ in runs)
                    output = runs[0][1][0]
                    reference = output.tokens if method == "ar" else reference
                    report.prompts.append(_prompt_result(question, method, seconds, output, reference))
    for batch_size in [b for b in batch_sizes if b > 1]:
        order = interleave_categories(list(questions))
        batch_prompts = [prompts[list(questions).index(q)] for q in order]
        with tqdm(total=len(methods) * repeats, desc=f"batch {batch_size}", unit="run") as bar:
            reference = None
            for method in methods:
                runs = [
                    _timed(engines[method], batch_prompts, config, batch_size, bar) for _ in range(repeats)
                ]
                outputs = runs[0][1]
                tokens = [o.tokens for o in outputs]
                reference = tokens if method == "ar" else reference
                report.batches.append(
                    BatchResult(
                        method,
                        batch_size,
                        statistics.median(s for s, _ in runs),
                        sum(len(t) for t in tokens),
                        sum(a == b for a, b in zip(tokens, reference, strict=True)),
                        len(tokens),
                    )
                )
    return report


def _timed(engine: Engine, prompts, config, batch_size: int, bar) -> tuple[float, list[Output]]:
    start = time.perf_counter()
    outputs = engine.generate(prompts, config, batch_size=batch_size)
    seconds = time.perf_counter() - start
    bar.update()
    return seconds, outputs


def _prompt_result(
    question: Question, method: str, seconds: float, output: Output, reference
) -> PromptResult:
    s = output.stats
    return PromptResult(
        question=question.id,
        category=question.category,
        method=method,
        seconds=seconds,
        new_tokens=s.new_tokens,
        steps=s.steps,
        step_tokens=s.step_tokens,
        drafted=s.drafted,
        accepted=s.accepted,
        draft_seconds=s.draft_seconds,
        verify_seconds=s.verify_seconds,
        identical=output.tokens == reference,
    )


def environment(loaded: LoadedModel) -> dict:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": loaded.name,
        "dtype": str(loaded.model.dtype),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
    }


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
