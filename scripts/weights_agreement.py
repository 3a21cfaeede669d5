"""How often ``--weights int8`` (or ``int4``) writes what float32 writes: plain greedy decoding of
Spec-Bench prompts with the model's own weights and with a packed copy (``pack_weights``), compared
output by output.

Prints the share of identical outputs, the mean number of tokens before the first difference, and the
share of positions where the packed model, fed float32's output, makes float32's choice (teacher
forcing: what a speculative verifier of float32 would accept from such a draft).

    .venv/bin/python scripts/weights_agreement.py [--weights int8|int4] [--limit 3] [--max-new-tokens 128]
        [--categories coding,math]
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import replace

import torch

from reader_spec.bench.spec_bench import load_questions, per_category
from reader_spec.cli.common import names
from reader_spec.config import GenerationConfig
from reader_spec.engine.loop import Engine
from reader_spec.engine.runner import pack_weights
from reader_spec.loading import load_model
from reader_spec.prompts import encode_prompt


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@torch.inference_mode()
def teacher_forced_agreement(model, prompts: list[list[int]], outputs: list[list[int]]) -> float:
    hits = total = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt + output])
        choices = model(ids).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
        hits += sum(c == t for c, t in zip(choices, output, strict=True))
        total += len(output)
    return hits / total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--limit", type=int, default=3, help="questions per category (first turns)")
    parser.add_argument(
        "--categories", nargs="+", type=names, help="only these categories (spaces or commas between)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--weights", choices=("int8", "int4"), default="int8")
    args = parser.parse_args()

    loaded = load_model()
    packed = replace(loaded, model=copy.deepcopy(loaded.model))
    pack_weights(packed.model, args.weights)
    categories = [c for group in args.categories for c in group] if args.categories else None
    questions = per_category(load_questions(), args.limit, categories)
    prompts = [encode_prompt(loaded.tokenizer, q.messages) for q in questions]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    by_format = {
        name: [o.tokens for o in Engine(model).generate(prompts, config, batch_size=args.batch_size)]
        for name, model in (("float32", loaded), (args.weights, packed))
    }
    reference, quantized = by_format["float32"], by_format[args.weights]
    identical = sum(a == b for a, b in zip(reference, quantized, strict=True))
    prefixes = [common_prefix(a, b) for a, b in zip(reference, quantized, strict=True)]
    agreement = teacher_forced_agreement(packed.model, prompts, reference)
    print(f"{len(prompts)} prompts, {args.max_new_tokens} new tokens, greedy")
    print(f"identical outputs: {identical}/{len(prompts)} ({identical / len(prompts):.1%})")
    print(f"tokens before the first difference: mean {sum(prefixes) / len(prefixes):.1f}")
    print(f"{args.weights} makes float32's choice on float32's output: {agreement:.1%} of positions")


if __name__ == "__main__":
    main()
