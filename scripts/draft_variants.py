"""Which compressed copy of the target drafts best: greedy agreement with the target, and pass cost.

For Spec-Bench prompts (one per category by default), the target's greedy continuation is computed
once; each variant then reads prompt + continuation in one forward (teacher forcing), and the share
of positions where its argmax equals the target's token is its agreement: the acceptance rate of a
draft chain's next token under greedy verification. Variants are simulated in float32 (weights,
and for the integer variants each linear layer's inputs, rounded to the format and back), so agreement
measures the format, not a kernel; the last rows are the packed models themselves (their kernels
included): ``--draft-model self`` as it is packed, and int8 per output row. Then the engine's own
passes are timed at batch 1: the target packed in float32 and the ``self`` draft.

    .venv/bin/python scripts/draft_variants.py [--prompts 13] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import copy

import torch

from reader_spec.bench.spec_bench import load_questions, per_category
from reader_spec.budget.probe import time_interleaved
from reader_spec.drafters.model import self_draft
from reader_spec.drafters.model.loading import SELF_WEIGHTS
from reader_spec.engine.runner import ModelRunner
from reader_spec.engine.tree import DraftTree
from reader_spec.loading import load_model
from reader_spec.prompts import encode_prompt


def rounded(model, bits: int, group: int | None):
    """A copy whose linear and embedding weights are rounded to ``bits`` symmetric integers per output
    row (``group``: per group of that many inputs instead)."""
    copied = copy.deepcopy(model)
    top = 2 ** (bits - 1) - 1
    for module in copied.modules():
        if isinstance(module, torch.nn.Linear | torch.nn.Embedding):
            weight = module.weight.data
            rows, columns = weight.shape
            size = columns if group is None else group
            grouped = weight.reshape(rows, columns // size, size)
            scale = grouped.abs().amax(-1, keepdim=True) / top
            module.weight.data = ((grouped / scale).round().clamp(-top - 1, top) * scale).reshape(
                rows, columns
            )
    return copied


def integer_inputs(model, levels: int, wide: bool = False):
    """The int8 copy whose linear layers also round their inputs to ``levels`` int8 levels per row
    (each level quantizes what the ones before left): what integer products (VNNI) would compute.
    ``wide``: one 16-bit level instead, as many steps as int32 sums of K products with the weights
    (offset to unsigned, at most 255) allow: what AVX2's integer product computes."""
    copied = rounded(model, 8, None)

    def quantize(module, args):
        x = args[0]
        top = min(32767, 2**31 // (255 * x.shape[-1])) if wide else 127
        approx = torch.zeros_like(x)
        for _ in range(levels):
            rest = x - approx
            scale = (rest.abs().amax(-1, keepdim=True) / top).clamp_min(torch.finfo(x.dtype).tiny)
            approx = approx + (rest / scale).round().clamp(-top, top) * scale
        return (approx, *args[1:])

    for module in copied.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(quantize)
    return copied


def first_layers(model, keep: int):
    """The first ``keep`` decoder layers with the target's final norm and output head."""
    copied = copy.deepcopy(model)
    copied.model.layers = copied.model.layers[:keep]
    copied.config.num_hidden_layers = keep
    if getattr(copied.config, "layer_types", None):
        copied.config.layer_types = copied.config.layer_types[:keep]
    return copied


@torch.inference_mode()
def agreement(model, sequences: list[tuple[int, torch.Tensor]]) -> float:
    hits = total = 0
    for prompt_length, ids in sequences:
        predicted = model(ids[None]).logits[0, prompt_length - 1 : -1].argmax(-1)
        hits += int((predicted == ids[prompt_length:]).sum())
        total += len(ids) - prompt_length
    return hits / total


def pass_milliseconds(model, widths: list[int], context: int = 256) -> dict[int, float]:
    runner = ModelRunner(model, 1, context + max(widths) + 1, "fast")
    runner.prefill(0, list(range(100, 100 + context)))
    calls = {
        width: (lambda w=width: runner.verify([DraftTree([5] * w, list(range(-1, w - 1)))], [0]))
        for width in widths
    }
    return {w: s * 1e3 for w, s in time_interleaved(calls).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=13)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    loaded = load_model()
    target = loaded.model
    questions = per_category(load_questions(), 1)[: args.prompts]
    sequences = []
    with torch.inference_mode():
        for question in questions:
            prompt = encode_prompt(loaded.tokenizer, question.messages)
            out = target.generate(torch.tensor([prompt]), max_new_tokens=args.new_tokens, do_sample=False)
            sequences.append((len(prompt), out[0]))
    positions = sum(len(ids) - n for n, ids in sequences)
    print(f"greedy agreement with the float32 target over {positions} positions of {len(sequences)} prompts")
    variants = {
        "int8 per output channel": lambda: rounded(target, 8, None),
        "int8 weights, inputs in one int8 level per row": lambda: integer_inputs(target, 1),
        "int8 weights, inputs in two int8 levels per row": lambda: integer_inputs(target, 2),
        "int8 weights, inputs in one 16-bit level per row": lambda: integer_inputs(target, 1, wide=True),
        "int4, groups of 32": lambda: rounded(target, 4, 32),
        "int4, groups of 64": lambda: rounded(target, 4, 64),
        **{
            f"first {k} of {len(target.model.layers)} layers": (lambda k=k: first_layers(target, k))
            for k in (8, 16, 24)
        },
        f"packed as --draft-model self ({SELF_WEIGHTS}: GGUF's groups)": lambda: self_draft(loaded).model,
        "packed in int8 per output row": lambda: self_draft(loaded, "int8").model,
    }
    print("| variant | agreement |\n|---|---:|")
    for name, build in variants.items():
        print(f"| {name} | {agreement(build(), sequences):.1%} |")
    widths = [1, 4, 8, 16]
    draft = self_draft(loaded).model
    packed_target = copy.deepcopy(target)
    times = {
        "target, float32": pass_milliseconds(packed_target, widths),
        f"self draft, {SELF_WEIGHTS}": pass_milliseconds(draft, widths),
    }
    print("\nms per pass at batch 1, 256 tokens of context, by tokens in the pass")
    print("| model | " + " | ".join(map(str, widths)) + " |\n|---|" + "---:|" * len(widths))
    for name, row in times.items():
        print(f"| {name} | " + " | ".join(f"{row[w]:.1f}" for w in widths) + " |")


if __name__ == "__main__":
    main()
