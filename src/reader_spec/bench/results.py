"""Benchmark figures, their Spec-Bench aggregations, and the Markdown report.

Definitions (the README's Benchmark section says the same):

- *tokens/s* per category: each question's new tokens over its seconds, both turns together, averaged
  over questions (Spec-Bench's ``speed.py``); *speedup* is a method's tokens/s over ``ar``'s. For a
  category of one single-turn question that is ``ar`` seconds / method seconds.
- *tokens/step* (mean accepted tokens): all tokens emitted over all target-model steps, the bonus token
  included, i.e. the mean of Spec-Bench's per-step accept lengths; plain decoding scores exactly 1.00.
- *identical*: the share of outputs (one per turn) equal token for token to ``ar``'s on the same prompt.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from reader_spec.config import GenerationConfig
from reader_spec.engine.sequence import DraftCounts, mean_accepted

OVERALL = "overall"
REFERENCE = "ar"


@dataclass
class PromptResult:
    """One method on one turn of one question, at batch 1."""

    question: int
    category: str
    turn: int
    method: str
    seconds: float
    prompt_tokens: int
    new_tokens: int
    accept_lengths: list[int]
    drafted: int
    draft_seconds: float
    verify_seconds: float
    identical: bool
    peak_rss_mib: float
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    cached_tokens: int = 0
    """Prompt tokens found in the cache (prefix reuse), not prefilled."""

    @property
    def steps(self) -> int:
        return len(self.accept_lengths)

    def as_dict(self) -> dict:
        return asdict(self) | {"steps": self.steps}


@dataclass(kw_only=True)
class BatchResult(DraftCounts):
    """One method decoding every prompt at one batch size (``steps`` summed over sequences: a
    sequence's step is one verification of its draft)."""

    method: str
    batch_size: int
    seconds: float
    requests: int
    identical: int
    peak_rss_mib: float
    run_seconds: tuple[float, ...] = ()
    """Each repeat's whole-run seconds, in the order the repeats ran (``seconds`` is their median's)."""

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def drafted_per_step(self) -> float:
        return self.drafted / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        return asdict(self) | {
            "tokens_per_second": self.tokens_per_second,
            "mean_accepted": self.mean_accepted,
            "drafted_per_step": self.drafted_per_step,
        }


@dataclass(frozen=True)
class Summary:
    """One method over one category (or ``overall``) at batch 1."""

    category: str
    method: str
    questions: int
    prompts: int
    tokens_per_second: float
    speedup: float
    mean_accepted: float
    drafted_per_step: float
    identical: float
    draft_share: float
    verify_share: float
    other_share: float
    """Time outside drafting and the target's forwards: acceptance, caches, framework overhead."""
    peak_rss_mib: float


def question_speed(results: Iterable[PromptResult]) -> float:
    """Spec-Bench's tokens/s: per question (all turns together), then averaged over questions."""
    tokens: dict[tuple[str, int], int] = defaultdict(int)
    seconds: dict[tuple[str, int], float] = defaultdict(float)
    for r in results:
        tokens[r.category, r.question] += r.new_tokens
        seconds[r.category, r.question] += r.seconds
    rates = [tokens[q] / seconds[q] for q in tokens if seconds[q] > 0]
    return statistics.fmean(rates) if rates else 0.0


def pooled_mean_accepted(accept_lengths: Iterable[Sequence[int]]) -> float:
    """Mean tokens per step, bonus included, over every step of every output (no steps: 1.0)."""
    lengths = [n for per_output in accept_lengths for n in per_output]
    return mean_accepted(sum(lengths), len(lengths))


def summarize(results: Sequence[PromptResult]) -> list[Summary]:
    """Per category, then ``overall``, per method in order of first appearance."""
    methods = list(dict.fromkeys(r.method for r in results))
    categories = sorted({r.category for r in results})
    rows = []
    for category in [*categories, OVERALL]:
        chosen = [r for r in results if category in (OVERALL, r.category)]
        base = question_speed(r for r in chosen if r.method == REFERENCE)
        for method in methods:
            rows.append(_summary(category, method, [r for r in chosen if r.method == method], base))
    return rows


def _summary(category: str, method: str, mine: list[PromptResult], base: float) -> Summary:
    speed = question_speed(mine)
    seconds = sum(r.seconds for r in mine)
    steps = sum(r.steps for r in mine)
    draft = sum(r.draft_seconds for r in mine) / seconds if seconds else 0.0
    verify = sum(r.verify_seconds for r in mine) / seconds if seconds else 0.0
    return Summary(
        category=category,
        method=method,
        questions=len({(r.category, r.question) for r in mine}),
        prompts=len(mine),
        tokens_per_second=speed,
        speedup=speed / base if base else 0.0,
        mean_accepted=pooled_mean_accepted(r.accept_lengths for r in mine),
        drafted_per_step=sum(r.drafted for r in mine) / steps if steps else 0.0,
        identical=sum(r.identical for r in mine) / len(mine) if mine else 0.0,
        draft_share=draft,
        verify_share=verify,
        other_share=max(0.0, 1.0 - draft - verify),
        peak_rss_mib=max((r.peak_rss_mib for r in mine), default=0.0),
    )


def category_means(rows: Iterable[Summary]) -> dict[str, float]:
    """Each method's speedup averaged over categories, each category counting once whatever its number
    of questions (Spec-Bench weighs its categories alike; ``overall`` weighs questions alike)."""
    speedups: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        if row.category != OVERALL:
            speedups[row.method].append(row.speedup)
    return {method: statistics.fmean(values) for method, values in speedups.items()}


def total_throughput(results: Iterable[PromptResult], method: str) -> float:
    """All new tokens over all seconds at batch 1: the batch-1 point of a throughput curve."""
    mine = [r for r in results if r.method == method]
    seconds = sum(r.seconds for r in mine)
    return sum(r.new_tokens for r in mine) / seconds if seconds else 0.0


def batch_speedup(result: BatchResult, batches: Sequence[BatchResult]) -> float:
    """Throughput over ``ar``'s at the same batch size: with repeats, the median over repeats of each
    repeat's ratio to ``ar``'s run of the same repeat. A shared host's speed drifts by a fifth within
    minutes; a ratio of runs minutes apart (each method's median run) carries that drift, a ratio of
    the runs of one repeat, which took turns of a tenth of a second, next to none of it."""
    base = next((b for b in batches if b.method == REFERENCE and b.batch_size == result.batch_size), None)
    if base is None or not base.tokens_per_second:
        return 0.0
    if len(result.run_seconds) > 1 and len(result.run_seconds) == len(base.run_seconds):
        ratios = [b / r for b, r in zip(base.run_seconds, result.run_seconds, strict=True) if r]
        return statistics.median(ratios) * result.new_tokens / base.new_tokens if ratios else 0.0
    return result.tokens_per_second / base.tokens_per_second


def markdown(
    environment: dict, settings: dict, prompts: Sequence[PromptResult], batches: Sequence[BatchResult]
) -> str:
    lines = [f"# reader bench: {environment.get('model', '?')}", "", _header(environment, settings, prompts)]
    if prompts:
        rows = summarize(prompts)
        lines += ["", *_category_table(rows), "", *_overall_table(rows), *_source_tables(prompts)]
    larger = [b for b in settings.get("batch_sizes", []) if b > 1]
    if larger:
        lines += ["", *_batch_table(batches, larger, settings)]
    lines += ["", *_legend()]
    return "\n".join(lines)


def _token_choice(settings: dict) -> str:
    """How tokens were chosen: greedy, or sampling at its temperature, with every setting changed from
    its default (runs recorded before settings held ``sampling`` were greedy)."""
    chosen = settings.get("sampling") or {}
    defaults = GenerationConfig()
    changed = [
        f"{name} {value}"
        for name, value in chosen.items()
        if name not in ("temperature", "seed")
        and value != getattr(defaults, name, value)
        and (value or getattr(defaults, name))  # an empty logit_bias read back from JSON is a list
    ]
    temperature, seed = chosen.get("temperature", 0), chosen.get("seed")
    base = "greedy" if temperature == 0 else f"sampling at temperature {temperature}, seed {seed}"
    return ", ".join([base, *changed])


def _header(environment: dict, settings: dict, prompts: Sequence[PromptResult]) -> str:
    questions = settings.get("questions", [])
    return (
        f"{len(questions)} questions ({settings.get('prompts', len(questions))} prompts, second turns "
        f"included) in {len(settings.get('categories', []))} categories; {_token_choice(settings)}, "
        f"{settings.get('max_new_tokens')} new tokens, {settings.get('repeats')} repeat(s). "
        f"{_processor(environment)}, {environment.get('threads', '?')} threads"
        f"{_accelerator(environment)}; "
        f"{environment.get('dtype', '?')}; torch "
        f"{environment.get('torch', '?')}, transformers {environment.get('transformers', '?')}; "
        f"commit {environment.get('commit') or '?'}, {environment.get('date', '?')}."
    )


def _processor(environment: dict) -> str:
    """The CPU's name, with its family and model and the vector instructions torch uses where known."""
    details = [d for d in (environment.get("cpu_id"), environment.get("cpu_capability")) if d]
    return str(environment.get("cpu", "?")) + (f" ({', '.join(details)})" if details else "")


def _accelerator(environment: dict) -> str:
    device = environment.get("device", "cpu")
    return "" if device == "cpu" else f", model on {device}"


def _category_table(rows: list[Summary]) -> list[str]:
    methods = [m for m in dict.fromkeys(r.method for r in rows) if m != REFERENCE]
    cell = {(r.category, r.method): r for r in rows}
    categories = list(dict.fromkeys(r.category for r in rows))
    lines = [
        "Speedup over ar by category (mean accepted tokens per step in brackets):",
        "",
        "| " + " | ".join(["category", "ar tokens/s", *methods]) + " |",
        "|---|---:|" + "---:|" * len(methods),
    ]
    for category in categories:
        name = f"**{category}**" if category == OVERALL else category
        cells = [f"{cell[category, m].speedup:.2f}x ({cell[category, m].mean_accepted:.2f})" for m in methods]
        ar = cell[category, REFERENCE].tokens_per_second
        lines.append("| " + " | ".join([name, f"{ar:.1f}", *cells]) + " |")
    means = category_means(rows)
    cells = [f"{means[m]:.2f}x" for m in methods]
    lines.append("| " + " | ".join(["**mean over categories**", "", *cells]) + " |")
    return lines


def _overall_table(rows: list[Summary]) -> list[str]:
    lines = [
        "Overall at batch 1 (time shares of each method's wall time; peak RSS of the whole process):",
        "",
        "| method | tokens/s | speedup | tokens/step | drafted/step | identical to ar "
        "| draft | verify | other | peak RSS MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in (r for r in rows if r.category == OVERALL):
        lines.append(
            f"| {r.method} | {r.tokens_per_second:.1f} | {r.speedup:.2f}x | {r.mean_accepted:.2f} | "
            f"{r.drafted_per_step:.1f} | {r.identical:.0%} | {r.draft_share:.1%} | {r.verify_share:.1%} | "
            f"{r.other_share:.1%} | {r.peak_rss_mib:.0f} |"
        )
    return lines


def source_shares(results: Iterable[PromptResult]) -> dict[str, float]:
    """Each source's share of all accepted draft tokens."""
    counts: dict[str, int] = defaultdict(int)
    for r in results:
        for source, accepted in r.accepted_by_source.items():
            counts[source] += accepted
    total = sum(counts.values())
    return {source: count / total for source, count in counts.items()} if total else {}


def _source_tables(prompts: Sequence[PromptResult]) -> list[str]:
    """For each method that drafts from several sources: who proposed the accepted tokens."""
    lines = []
    for method in dict.fromkeys(r.method for r in prompts):
        mine = [r for r in prompts if r.method == method]
        sources = sorted({s for r in mine for s in r.accepted_by_source})
        if len(sources) < 2:
            continue
        lines += [
            "",
            f"{method}: share of accepted draft tokens by source:",
            "",
            "| " + " | ".join(["category", *sources]) + " |",
            "|---|" + "---:|" * len(sources),
        ]
        for category in [*sorted({r.category for r in mine}), OVERALL]:
            shares = source_shares(r for r in mine if category in (OVERALL, r.category))
            name = f"**{category}**" if category == OVERALL else category
            lines.append("| " + " | ".join([name, *(f"{shares.get(s, 0.0):.0%}" for s in sources)]) + " |")
    return lines


def _batch_table(batches: Sequence[BatchResult], sizes: list[int], settings: dict) -> list[str]:
    lines = [
        f"Batches (all {settings.get('prompts')} prompts, categories interleaved; whole-run throughput, "
        "the methods taking turns of a tenth of a second):",
        "",
        "| method | batch | tokens/s | speedup | tokens/step | drafted/step | identical to ar "
        "| peak RSS MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size in sizes:
        for b in (b for b in batches if b.batch_size == size):
            lines.append(
                f"| {b.method} | {size} | {b.tokens_per_second:.1f} | {batch_speedup(b, batches):.2f}x | "
                f"{b.mean_accepted:.2f} | {b.drafted_per_step:.1f} | {b.identical}/{b.requests} | "
                f"{b.peak_rss_mib:.0f} |"
            )
        for method in settings.get("batch_1_only", []):
            lines.append(f"| {method} | {size} | n/a | n/a | n/a | n/a | batch 1 only | n/a |")
    return lines


def _legend() -> list[str]:
    return [
        "speedup: tokens/s over ar's, tokens/s per question (both turns) averaged over questions "
        "(Spec-Bench); mean over categories: the categories' speedups averaged, each category counting "
        "once; in batches, whole-run throughput over ar's at the same batch size, each method "
        "timed over its own steps while the methods take turns of a tenth of a second (with repeats, "
        "the median of each repeat's ratio to ar's run of that repeat, who goes first alternating; "
        "tokens/s is the median run's; peak RSS with every method's caches resident). "
        "tokens/step: tokens emitted per target-model step, bonus included (plain decoding 1.00). "
        "drafted/step: draft tokens verified per step and sequence. identical to ar: outputs equal "
        "token for token to ar's on the same prompt. verify: the target model's forward passes, prefill "
        "included; draft: proposing (not separable for hf-pld, whose search counts under other)."
    ]
