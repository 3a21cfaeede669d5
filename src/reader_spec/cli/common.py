"""Options and helpers the commands share."""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from reader_spec.config import SAMPLING_FIELDS
from reader_spec.drafters import Drafter, ReaderDrafter
from reader_spec.drafters.fusion import RASD_MIN_PROB, RASD_TOP_K, FusedDrafter
from reader_spec.drafters.model import SELF, ModelDrafter, load_draft_model
from reader_spec.drafters.registry import rasd_model_drafter
from reader_spec.drafters.retrieval.datastore import Datastore
from reader_spec.drafters.retrieval.history import DEFAULT_MAX_TOKENS
from reader_spec.engine.loop import DEFAULT_BUDGET, Engine
from reader_spec.engine.runner import RUNNERS, pack_weights
from reader_spec.loading import LoadedModel, load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_model_option(parser: argparse.ArgumentParser) -> None:
    """``--model`` and how it runs: ``--device``, ``--dtype``, ``--weights`` and ``--runner``."""
    parser.add_argument(
        "--model", help="hub id, local directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument(
        "--device",
        default="auto",
        help="where the model runs: cpu, cuda, cuda:N, ... (default auto: the first GPU if there is one)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="the weights' and activations' type (float32 default; a GPU runs bfloat16 faster)",
    )
    parser.add_argument(
        "--weights",
        choices=["int8", "int4"],
        help="int8: store the model's matrices in int8, one scale per output channel (a quarter of "
        "float32's bytes: plain decoding about 2.2x faster on a CPU); output is the int8 model's, "
        "which makes float32's greedy choice at about 97%% of tokens; int4: GGUF's formats per 32 "
        "inputs, 4 bits with a scale and minimum (Q4_1) where that is as close as 8 bits with a "
        "scale (Q8_0), those 8 bits elsewhere: a model from a GGUF file in these formats (the "
        "default model) gets its own weights back exactly; speculation stays exact against the "
        "packed model's plain decoding",
    )
    parser.add_argument(
        "--runner",
        choices=RUNNERS,
        default="auto",
        help="the model's forward: fast (the engine's decoder for Llama, Mistral, Qwen2/3, Phi-3, "
        "Gemma 2/3), transformers (the model's own), auto (fast where supported; default)",
    )


def add_prefix_reuse_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-prefix-reuse",
        action="store_true",
        help="prefill every prompt whole, even where a finished request left its beginning in the cache "
        "(the next turn of a chat, a shared system prompt): each output then depends on its request alone",
    )


def load_target(args: argparse.Namespace) -> LoadedModel:
    """The model ``--model``, ``--device``, ``--dtype`` and ``--weights`` describe."""
    loaded = load_model(args.model, dtype=DTYPES[args.dtype], device=resolve_device(args.device))
    if args.weights is not None:
        pack_weights(loaded.model, args.weights)
        loaded = replace(loaded, name=f"{loaded.name} ({args.weights})")
    return loaded


def resolve_device(name: str) -> torch.device:
    """``auto``: the first GPU where PyTorch sees one, else the CPU; a device that is not there fails
    in one line."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"--device: {error}") from None
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= available:
        raise ValueError(f"--device {name}: PyTorch sees no such GPU ({available} available)")
    return device


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "sampling", "exact sampling of the model's distribution; input lines may override each setting"
    )
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy decoding (default)")
    group.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    group.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top one")
    group.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="transformers' (prompt included)"
    )
    group.add_argument(
        "--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]: on tokens the output holds"
    )
    group.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="OpenAI's, in [-2, 2]: once for each time the output holds a token",
    )
    group.add_argument(
        "--logit-bias",
        type=_bias,
        action="append",
        default=[],
        metavar="TOKEN=BIAS",
        help="add BIAS in [-100, 100] to token id TOKEN's logit (-100 bans it; repeatable)",
    )
    group.add_argument("--seed", type=int, help="makes sampled output reproducible, whatever the drafter")


def _bias(value: str) -> tuple[int, float]:
    token, _, bias = value.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN=BIAS, e.g. 50256=-100, got {value!r}") from None


def sampling_settings(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in SAMPLING_FIELDS}


def names(value: str) -> list[str]:
    """``a,b`` as well as ``a b``: one command-line word may hold several names."""
    return [name for name in value.split(",") if name]


def draft_budget(text: str) -> int:
    """``--budget``'s type: checked as the command line is read, before any model loads."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (no drafts) or more, not {value}")
    return value


def add_budget_option(
    parser: argparse.ArgumentParser, help: str = f"most draft tokens per sequence and step ({DEFAULT_BUDGET})"
) -> None:
    parser.add_argument("--budget", type=draft_budget, default=DEFAULT_BUDGET, help=help)


def open_datastore(args: argparse.Namespace, loaded: LoadedModel) -> Datastore | None:
    """``--datastore``, checked against the target's tokenizer (opened before any draft model loads)."""
    return Datastore.open(args.datastore, fingerprint=loaded.fingerprint) if args.datastore else None


def add_drafting_options(parser: argparse.ArgumentParser) -> None:
    add_budget_option(parser)
    parser.add_argument(
        "--fixed-budget",
        action="store_true",
        help="always verify the whole budget instead of choosing the tree size from measured costs",
    )
    parser.add_argument(
        "--drafter",
        choices=["reader", "model", "rasd", "none"],
        default="reader",
        help="reader: retrieval drafts from the request, earlier responses and --datastore, with a "
        "--draft-model's tree where it pays (READER); model: the draft model alone; rasd: the draft model's "
        "tree with the retrieval branches it finds plausible (RASD); none: plain decoding",
    )
    parser.add_argument(
        "--draft-model",
        metavar="self|MODEL",
        help="a draft model sharing the target's tokenizer: self (the target's weights in 4 or 8 bits, no "
        "download; the default of --drafter model and rasd) or a hub id, directory or .gguf",
    )
    parser.add_argument("--datastore", metavar="DIR", help="corpus datastore built by `reader index build`")
    parser.add_argument("--no-history", action="store_true", help="do not draft from earlier responses")
    parser.add_argument(
        "--rasd-top-k",
        type=int,
        default=RASD_TOP_K,
        help=f"rasd: keep a retrieval branch if its first token is among the draft model's k likeliest "
        f"({RASD_TOP_K})",
    )
    parser.add_argument(
        "--rasd-min-prob",
        type=float,
        default=RASD_MIN_PROB,
        help=f"rasd: ... and has at least this draft probability ({RASD_MIN_PROB})",
    )


def build_engine(args: argparse.Namespace, loaded: LoadedModel, max_batch_size: int) -> Engine:
    """The engine the drafting options describe (a datastore of another tokenizer, or a draft model
    of another tokenizer, fails here)."""
    return Engine(
        loaded,
        build_drafter(args, loaded),
        budget=args.budget,
        adaptive_budget=not args.fixed_budget,
        max_batch_size=max_batch_size,
        runner=args.runner,
        reuse_prefixes=not args.no_prefix_reuse,
    )


def build_drafter(args: argparse.Namespace, loaded: LoadedModel) -> Drafter | None:
    if args.drafter == "none":
        if args.draft_model:
            raise ValueError("--draft-model needs a drafter: --drafter reader, model or rasd")
        return None
    if args.rasd_top_k < 1 or not 0.0 <= args.rasd_min_prob <= 1.0:
        raise ValueError("--rasd-top-k must be at least 1 and --rasd-min-prob in [0, 1]")
    datastore = open_datastore(args, loaded)
    draft_spec = args.draft_model or (SELF if args.drafter in ("model", "rasd") else None)
    model = None
    if draft_spec is not None:
        build = rasd_model_drafter if args.drafter == "rasd" else ModelDrafter
        model = build(load_draft_model(draft_spec, loaded), runner=args.runner)
    if args.drafter == "model":
        return model
    retrieval = ReaderDrafter(
        history_tokens=0 if args.no_history else DEFAULT_MAX_TOKENS, datastore=datastore
    )
    if model is None:
        return retrieval
    mode = "rasd" if args.drafter == "rasd" else "reader"
    return FusedDrafter(retrieval, model, mode, rasd_top_k=args.rasd_top_k, rasd_min_prob=args.rasd_min_prob)
