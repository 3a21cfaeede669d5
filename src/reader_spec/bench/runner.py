"""Side-by-side measurement of decoding methods on Spec-Bench-style prompts (``reader bench``).

Every method runs in one process on the same loaded model, after one warm-up each. At batch 1 the
methods are interleaved prompt by prompt, so machine drift hits all of them alike. A question's later
turns carry ``ar``'s earlier answers, so every method decodes exactly the same prompts and outputs
compare token for token. Batch runs decode every prompt (second turns included, categories
interleaved) at each batch size above 1, with every method that can batch, the methods taking
turns of a tenth of a second of steps (each timed over its own). Methods are reset before
every timed pass (each repeat, each batch size), so that a source that learns across requests (the
response history) has seen the earlier requests of its pass, never the answers it is being timed on.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from reader_spec.bench.environment import environment, peak_rss_mib, reset_peak_rss
from reader_spec.bench.methods import (
    METHODS,
    BenchSetup,
    EngineMethod,
    Generation,
    Method,
    generate,
    method_names,
)
from reader_spec.bench.results import (
    REFERENCE,
    BatchResult,
    PromptResult,
    category_means,
    markdown,
    summarize,
)
from reader_spec.bench.spec_bench import Question, interleave_categories
from reader_spec.config import SAMPLING_FIELDS, GenerationConfig
from reader_spec.drafters.retrieval.datastore import Datastore
from reader_spec.engine.loop import DEFAULT_BUDGET
from reader_spec.files import write_atomic
from reader_spec.loading import LoadedModel
from reader_spec.prompts import encode_prompt

Answers = dict[Question, list[str]]

TURN_SECONDS = 0.1
"""How long each method runs before the next takes its turn, in a batched run (see ``in_turns``).
Two identical ``ar`` engines measured closer together with turns of a tenth of a second than of a
second (docs/runner.md, "how far apart two identical engines measure"); a tenth still holds whole
passes at the batch sizes benched."""


@dataclass
class BenchReport:
    environment: dict
    settings: dict
    prompts: list[PromptResult] = field(default_factory=list)
    batches: list[BatchResult] = field(default_factory=list)
    recording: list[dict] = field(default_factory=list)
    """``ar``'s answers at batch 1 as conversations, one per question (see :func:`recorded`)."""

    def markdown(self) -> str:
        return markdown(self.environment, self.settings, self.prompts, self.batches)

    def save(self, directory: Path) -> list[Path]:
        """``results.json``, ``results.md``, the plots and, after a batch-1 run, ``recording.jsonl`` (for
        ``reader bench --replay``), each written atomically; returns their paths."""
        from reader_spec.bench.plots import render_plots

        directory.mkdir(parents=True, exist_ok=True)
        summary = summarize(self.prompts)
        payload = {
            "environment": self.environment,
            "settings": self.settings,
            "summary": [vars(s) for s in summary],
            "mean_over_categories": category_means(summary),
            "prompts": [r.as_dict() for r in self.prompts],
            "batches": [b.as_dict() for b in self.batches],
        }
        files = {
            "results.json": json.dumps(payload, indent=1).encode(),
            "results.md": (self.markdown() + "\n").encode(),
            **render_plots(self.prompts, self.batches, self.settings),
        }
        if self.recording:
            files["recording.jsonl"] = "".join(json.dumps(task) + "\n" for task in self.recording).encode()
        for name, data in files.items():
            write_atomic(directory / name, data)
        return [directory / name for name in files]


def run_bench(
    loaded: LoadedModel,
    questions: Sequence[Question],
    methods: Sequence[str] | None = None,
    *,
    max_new_tokens: int = 128,
    repeats: int = 1,
    batch_sizes: Sequence[int] = (1,),
    budget: int = DEFAULT_BUDGET,
    draft: LoadedModel | None = None,
    datastore: Datastore | None = None,
    sampling: GenerationConfig | None = None,
    runner: str = "auto",
    reuse_prefixes: bool = True,
) -> BenchReport:
    """Measure ``methods`` (default: all that need no missing draft model) on ``questions``.

    ``sampling`` sets how engine methods choose tokens (greedy by default; give a seed, so that every
    method draws the same randomness and outputs stay comparable token for token). With
    ``reuse_prefixes`` an engine method's later turn prefills only past what its earlier turn left in
    the cache (transformers' methods prefill everything: they keep nothing between calls).
    """
    names = method_names(methods, draft is not None)
    if repeats < 1 or not batch_sizes or min(batch_sizes) < 1:
        raise ValueError("repeats and batch sizes must be positive")
    larger = sorted({b for b in batch_sizes if b > 1})
    sampling = sampling or GenerationConfig()
    if not sampling.greedy and sampling.seed is None:
        raise ValueError("sampled benchmarks need a seed, so that every method draws alike")
    setup = BenchSetup(loaded, budget, draft, datastore, sampling, runner, reuse_prefixes)
    built = {name: METHODS[name].build(setup) for name in names}
    for method in built.values():
        method.warm_up(max(larger, default=1) if method.can_batch else 1)
    prompt_count = sum(len(q.turns) for q in questions)
    peaks_per_run = reset_peak_rss()
    report = BenchReport(
        environment={**environment(loaded, draft), "runner": _runner_names(built)},
        settings={
            "methods": names,
            "max_new_tokens": max_new_tokens,
            "repeats": repeats,
            "batch_sizes": sorted(set(batch_sizes)),
            "batch_1_only": [n for n, m in built.items() if not m.can_batch],
            "speculative": [n for n, m in built.items() if m.speculative],
            "budget": budget,
            "sampling": {k: getattr(sampling, k) for k in SAMPLING_FIELDS},
            "datastore": str(datastore.path) if datastore is not None else None,
            "categories": sorted({q.category for q in questions}),
            "questions": [q.id for q in questions],
            "prompts": prompt_count,
            "later_turns": f"carry {REFERENCE}'s earlier answers",
            "prefix_reuse": reuse_prefixes,
            "peak_rss": "per run" if peaks_per_run else "process lifetime",
        },
    )
    batchable = [n for n, m in built.items() if m.can_batch]
    total = prompt_count * repeats * (len(names) * (1 in batch_sizes) + len(batchable) * len(larger))
    answers: Answers = {}
    with tqdm(total=total, desc="reader bench", unit="request", file=sys.stderr) as bar:
        if 1 in batch_sizes:
            report.prompts = _batch_one(
                built, loaded.tokenizer, questions, max_new_tokens, repeats, bar, answers
            )
            report.recording = [recorded(q, answers[q]) for q in questions]
        if larger:
            # By an engine of its own: the timed engine that filled them ran its batches slower than
            # its twin (docs/runner.md, "the bench's own bias at batch 8 and 32"), which favoured every
            # other method.
            filler = METHODS[REFERENCE].build(setup)
            prompts = batched_prompts(filler, loaded.tokenizer, questions, max_new_tokens, answers)
            for size in larger:
                report.batches += _batched(built, batchable, prompts, size, max_new_tokens, repeats, bar)
    return report


def _runner_names(built: dict[str, Method]) -> dict[str, str]:
    """Which forward each engine method ran on (``fast`` or ``transformers``)."""
    return {name: m.engine.runner_name for name, m in built.items() if isinstance(m, EngineMethod)}


def turn_messages(question: Question, turn: int, answers: Sequence[str]) -> list[dict[str, str]]:
    """Turn ``turn`` of a question as chat messages, each earlier turn followed by its answer."""
    messages = []
    for earlier in range(turn):
        messages += [
            {"role": "user", "content": question.turns[earlier]},
            {"role": "assistant", "content": answers[earlier]},
        ]
    return [*messages, {"role": "user", "content": question.turns[turn]}]


def recorded(question: Question, answers: Sequence[str]) -> dict:
    """A question and its answers as a replayable task (``reader bench --replay``): every turn's
    messages, its id ``category-question_id`` and its category. An answer cut at ``max_new_tokens``
    ends, once the chat template closes it, with an end-of-turn token the model did not write."""
    messages = turn_messages(question, len(answers) - 1, answers[:-1])
    return {
        "id": f"{question.category}-{question.id}",
        "category": question.category,
        "messages": [*messages, {"role": "assistant", "content": answers[-1]}],
    }


def _batch_one(
    built: dict[str, Method],
    tokenizer: PreTrainedTokenizerBase,
    questions: Sequence[Question],
    max_new_tokens: int,
    repeats: int,
    bar: tqdm,
    answers: Answers,
) -> list[PromptResult]:
    """Every turn of every question through every method in turn; fills ``answers`` with ``ar``'s.

    Each repeat is a whole pass from reset methods, so that history sources have seen the same
    earlier requests in every repeat, and never the request itself."""
    runs: dict[tuple[Question, int, str], list[Run]] = {}
    prompts: dict[tuple[Question, int], list[int]] = {}
    for _ in range(repeats):
        for method in built.values():
            method.reset()
        for question in questions:
            for turn in range(len(question.turns)):
                if (question, turn) not in prompts:
                    messages = turn_messages(question, turn, answers.get(question, []))
                    prompts[question, turn] = encode_prompt(tokenizer, messages)
                for name, method in built.items():
                    run = _run(method, [prompts[question, turn]], max_new_tokens, 1, bar)
                    runs.setdefault((question, turn, name), []).append(run)
                if len(answers.setdefault(question, [])) == turn:
                    reference = runs[question, turn, REFERENCE][0].outputs[0].tokens
                    answers[question].append(tokenizer.decode(reference, skip_special_tokens=True))
    results = []
    for (question, turn, name), method_runs in runs.items():
        run = _median(method_runs)
        reference = runs[question, turn, REFERENCE][0].outputs[0].tokens
        prompt = prompts[question, turn]
        results.append(
            _prompt_result(question, turn, name, prompt, run.outputs[0], run.seconds, run.peak, reference)
        )
    return results


def batched_prompts(
    ar: Method,
    tokenizer: PreTrainedTokenizerBase,
    questions: Sequence[Question],
    max_new_tokens: int,
    answers: Answers | None = None,
) -> list[list[int]]:
    """Every turn of ``questions`` as the batched runs take them: categories interleaved, later turns
    carrying earlier answers (``answers`` from batch 1, else ``ar``'s, made here outside any timing)."""
    answers = {} if answers is None else answers
    _fill_answers(ar, tokenizer, questions, max_new_tokens, answers)
    return [
        encode_prompt(tokenizer, turn_messages(q, t, answers.get(q, [])))
        for q in interleave_categories(list(questions))
        for t in range(len(q.turns))
    ]


def _fill_answers(
    ar: Method,
    tokenizer: PreTrainedTokenizerBase,
    questions: Sequence[Question],
    max_new_tokens: int,
    answers: Answers,
) -> None:
    """``ar``'s answers to earlier turns where batch 1 did not run, outside any timing."""
    for question in questions:
        while len(answers.setdefault(question, [])) < len(question.turns) - 1:
            turn = len(answers[question])
            prompt = encode_prompt(tokenizer, turn_messages(question, turn, answers[question]))
            (output,) = generate(ar, [prompt], max_new_tokens, 1, lambda: None)
            answers[question].append(tokenizer.decode(output.tokens, skip_special_tokens=True))


def _batched(
    built: dict[str, Method],
    batchable: list[str],
    prompts: list[list[int]],
    size: int,
    max_new_tokens: int,
    repeats: int,
    bar: tqdm,
) -> list[BatchResult]:
    """Every method over all prompts at one batch size, the methods taking turns a step at a time: a
    shared host's speed drifts from one minute to the next, so runs made one after the other compare
    the minutes they ran in more than the methods (docs/runner.md, "batched methods measured in
    turns"). With repeats, who goes first alternates. Each method's median run gives its figures and
    every run's seconds are kept (its speedup pairs each run with ``ar``'s of the same repeat:
    ``batch_speedup``)."""
    runs: dict[str, list[Run]] = {name: [] for name in batchable}
    for repeat in range(repeats):
        order = batchable if repeat % 2 == 0 else batchable[::-1]
        for name in order:
            built[name].reset()
            built[name].reserve(prompts, max_new_tokens, size)
        turns = in_turns({name: built[name] for name in order}, prompts, max_new_tokens, size, bar)
        for name, run in turns.items():
            runs[name].append(run)
    results = []
    reference: list[list[int]] = []
    for name in batchable:
        run = _median(runs[name])
        outputs, seconds, peak = run.outputs, run.seconds, run.peak
        tokens = [o.tokens for o in outputs]
        reference = tokens if name == REFERENCE else reference
        results.append(
            BatchResult(
                method=name,
                batch_size=size,
                seconds=seconds,
                requests=len(outputs),
                new_tokens=sum(len(t) for t in tokens),
                steps=sum(len(o.accept_lengths) for o in outputs),
                drafted=sum(o.drafted for o in outputs),
                identical=sum(a == b for a, b in zip(tokens, reference, strict=True)),
                peak_rss_mib=peak,
                run_seconds=tuple(r.seconds for r in runs[name]),
            )
        )
    return results


@dataclass
class Run:
    outputs: list[Generation]
    seconds: float
    peak: float
    """Peak resident memory in MiB."""


def _run(method: Method, prompts: list[list[int]], max_new_tokens: int, batch_size: int, bar: tqdm) -> Run:
    reset_peak_rss()
    start = time.perf_counter()
    outputs = generate(method, prompts, max_new_tokens, batch_size, bar.update)
    seconds = time.perf_counter() - start
    return Run(outputs, seconds, peak_rss_mib())


def in_turns(
    methods: dict[str, Method], prompts: list[list[int]], max_new_tokens: int, batch_size: int, bar: tqdm
) -> dict[str, Run]:
    """Each method's run over the same prompts, the methods taking turns of ``TURN_SECONDS``: each
    runs pieces (an engine's prefill or pass) until its turn has lasted that long, in the reverse
    order every other round. A shared host's speed changes within seconds (a Zen 4 host here
    switches its memory bandwidth), so turns are short; and a piece can leave work behind that slows
    the next one (garbage to collect, memory to fault in), which a turn of several pieces leaves
    mostly to the method's own pieces, as a run alone would. A method's seconds are its own pieces';
    its peak memory the highest during them, with the other methods' models and caches resident (as
    at batch 1, where methods alternate by prompt)."""
    reset_peak_rss()
    running = {name: m.steps(prompts, max_new_tokens, batch_size, bar.update) for name, m in methods.items()}
    seconds = dict.fromkeys(methods, 0.0)
    peaks = dict.fromkeys(methods, 0.0)
    runs: dict[str, Run] = {}
    forwards = True
    while running:
        order = list(running) if forwards else list(running)[::-1]
        forwards = not forwards
        for name in order:
            steps, turn = running[name], 0.0
            reset_peak_rss(hand_back=False)
            while turn < TURN_SECONDS:
                start = time.perf_counter()
                try:
                    next(steps)
                    outputs = None
                except StopIteration as finished:
                    outputs = finished.value
                turn += time.perf_counter() - start
                if outputs is not None:
                    break
            seconds[name] += turn
            peaks[name] = max(peaks[name], peak_rss_mib())
            if outputs is not None:
                runs[name] = Run(outputs, seconds[name], peaks[name])
                del running[name]
    return runs


def _median(runs: list[Run]) -> Run:
    """The outputs and seconds of the median-time run, with the peak memory of all runs."""
    median = sorted(runs, key=lambda run: run.seconds)[len(runs) // 2]
    return Run(median.outputs, median.seconds, max(run.peak for run in runs))


def _prompt_result(
    question: Question,
    turn: int,
    method: str,
    prompt: list[int],
    output: Generation,
    seconds: float,
    peak: float,
    reference: list[int],
) -> PromptResult:
    return PromptResult(
        question=question.id,
        category=question.category,
        turn=turn,
        method=method,
        seconds=seconds,
        prompt_tokens=len(prompt),
        new_tokens=len(output.tokens),
        accept_lengths=output.accept_lengths,
        drafted=output.drafted,
        draft_seconds=output.draft_seconds,
        verify_seconds=output.verify_seconds,
        identical=output.tokens == reference,
        cached_tokens=output.cached_tokens,
        peak_rss_mib=peak,
        accepted_by_source=output.accepted_by_source,
    )
