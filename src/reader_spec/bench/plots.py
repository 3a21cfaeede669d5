"""PNG plots of a benchmark, readable without the tables.

Drawn on matplotlib ``Figure`` objects with the Agg canvas: no pyplot, no global backend, no display.
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Sequence

from matplotlib.figure import Figure

from reader_spec.bench.results import (
    OVERALL,
    REFERENCE,
    BatchResult,
    PromptResult,
    pooled_mean_accepted,
    summarize,
    total_throughput,
)

CATEGORY_NAMES = {
    "qa": "QA",
    "rag": "RAG",
    "math_reasoning": "math reasoning",
    "mt_bench": "MT-Bench",
    OVERALL: "OVERALL",
}


def render_plots(
    prompts: Sequence[PromptResult], batches: Sequence[BatchResult], settings: dict
) -> dict[str, bytes]:
    """File name to PNG bytes, for the plots the results support.

    Speedups need batch-1 results of a method besides ``ar``, accepted lengths those of a speculative
    method; the throughput curve needs a batch size above 1.
    """
    plots = {}
    if any(r.method != REFERENCE for r in prompts):
        plots["speedup_by_category.png"] = speedup_plot(prompts)
        if histogram := accept_length_plot(prompts, settings):
            plots["accept_lengths.png"] = histogram
    if batches:
        plots["throughput_by_batch.png"] = throughput_plot(prompts, batches, settings)
    return plots


def category_label(category: str) -> str:
    return CATEGORY_NAMES.get(category, category.replace("_", " "))


def speedup_plot(prompts: Sequence[PromptResult]) -> bytes:
    rows = summarize(prompts)
    methods = [m for m in dict.fromkeys(r.method for r in rows) if m != REFERENCE]
    categories = list(dict.fromkeys(r.category for r in rows))
    speedup = {(r.category, r.method): r.speedup for r in rows}
    fig = Figure(figsize=(max(8.0, 1.0 + len(categories) * (0.35 + 0.22 * len(methods))), 5.0))
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        xs = [c + (i - (len(methods) - 1) / 2) * width for c in range(len(categories))]
        bars = ax.bar(xs, [speedup[c, method] for c in categories], width, label=method)
        overall = [f"{speedup[c, method]:.2f}" if c == OVERALL else "" for c in categories]
        ax.bar_label(bars, overall, fontsize="x-small", padding=2)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="ar (plain decoding) = 1.0")
    ax.set_xticks(range(len(categories)), [category_label(c) for c in categories], rotation=30, ha="right")
    ax.set_ylim(0, 1.25 * max([1.0, *speedup.values()]))  # headroom for the legend
    ax.set_ylabel("speedup over ar (x)")
    ax.set_title("Speedup over plain decoding by Spec-Bench category, batch 1")
    ax.legend(fontsize="small", ncols=min(4, len(methods) + 1))
    ax.grid(axis="y", alpha=0.3)
    return _png(fig)


def throughput_plot(prompts: Sequence[PromptResult], batches: Sequence[BatchResult], settings: dict) -> bytes:
    fig = Figure(figsize=(7.5, 5.0))
    ax = fig.add_subplot()
    sizes = set()
    for method in settings["methods"]:
        points = [(b.batch_size, b.tokens_per_second) for b in batches if b.method == method]
        if prompts:
            points.insert(0, (1, total_throughput(prompts, method)))
        if not points:
            continue
        sizes.update(size for size, _ in points)
        label = (
            method
            if len(points) > 1 or method not in settings["batch_1_only"]
            else f"{method} (batch 1 only)"
        )
        ax.plot(*zip(*points, strict=True), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(sizes), [str(s) for s in sorted(sizes)])
    ax.minorticks_off()
    ax.set_xlabel("batch size")
    ax.set_ylabel("throughput (new tokens/s, whole run)")
    ax.set_title("Throughput against batch size (mixed-category batches)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return _png(fig)


def accept_length_plot(prompts: Sequence[PromptResult], settings: dict) -> bytes | None:
    """Per speculative method, the share of steps emitting 1, 2, ... tokens (None: no such method)."""
    methods = [m for m in settings["methods"] if m in settings.get("speculative", [])]
    if not methods:
        return None
    lengths = {m: [r.accept_lengths for r in prompts if r.method == m] for m in methods}
    longest = max((max(steps, default=1) for m in methods for steps in lengths[m]), default=1)
    columns = min(3, len(methods))
    rows = -(-len(methods) // columns)
    fig = Figure(figsize=(4.2 * columns, 3.2 * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False, sharey=True)
    for ax, method in zip(axes.flat, methods, strict=False):
        counts = Counter(n for steps in lengths[method] for n in steps)
        steps = sum(counts.values()) or 1
        ax.bar(range(1, longest + 1), [100 * counts[n] / steps for n in range(1, longest + 1)])
        ax.set_title(f"{method}: mean {pooled_mean_accepted(lengths[method]):.2f} tokens/step")
        ax.set_xticks(range(1, longest + 1, max(1, longest // 8)))
        ax.set_xlabel("tokens emitted in one step (bonus included)")
        ax.set_ylabel("share of steps (%)")
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(methods) :]:
        ax.set_visible(False)
    fig.suptitle("Accepted length per verification step, batch 1")
    return _png(fig)


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return buffer.getvalue()
