"""Measuring what verification passes cost on this machine, for the cost model to price steps with.

A curve's points are timed in interleaved rounds, keeping each point's fastest round: load from other
processes only ever adds time, comes in bursts on shared cores, and would otherwise bend the curve.
Passes are timed on the model's own greedy text, started from tokens of a private random generator,
so that calibrating never moves the caller's global random state.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from transformers import PreTrainedModel

from reader_spec.engine import kernels
from reader_spec.engine.kernel_choice import ROW_BUCKETS
from reader_spec.engine.layouts import BLOCK, PANEL, to_blocks
from reader_spec.engine.runner import ModelRunner, max_context_of, synchronizer, text_config
from reader_spec.engine.timing import best_times
from reader_spec.engine.tree import DraftTree
from reader_spec.engine.weights import PackedLinear

Key = TypeVar("Key", bound=Hashable)

PROBE_SEED = 0
PROBE_ROUNDS = 9
NATURAL_TOKENS = 64
"""Greedy tokens at the end of a probe's context, after its random start (see :func:`_probe_text`)."""


def probe_verify(
    model: PreTrainedModel, batch: int, drafted: Sequence[int], context: int, runner: str = "auto"
) -> dict[int, float]:
    """Seconds of a packed verification pass of ``batch`` chains holding each total of draft tokens
    (spread evenly), after ``context`` tokens in every row, on the given runner: greedy passes (what
    most requests run; a sampling pass also computes its rows' whole output layer)."""
    calls = verify_calls(model, batch, drafted, context, runner)
    return time_interleaved(calls, synchronize=synchronizer(model.device))


def verify_calls(
    model: PreTrainedModel, batch: int, drafted: Sequence[int], context: int, runner: str = "auto"
) -> dict[int, Callable[[], object]]:
    """The passes :func:`probe_verify` times, by total draft tokens, ready to run."""
    most = max(drafted)
    positions = max_context_of(model.config)
    if positions is not None:  # a model with few positions (GPT-2: 1,024) is probed at its longest
        context = max(1, min(context, positions - most // batch - 2))
    widest = most // batch + 2
    probe = ModelRunner(model, batch, context + widest, runner)
    tokens = _probe_text(probe, context, widest, text_config(model.config).vocab_size)
    for row in range(1, batch):
        probe.cache.copy_row(0, row)

    def chain(width: int) -> DraftTree:
        return DraftTree(tokens[context : context + width], list(range(-1, width - 1)))

    def verify(total: int) -> Callable[[], object]:
        trees = [chain(1 + total // batch + (row < total % batch)) for row in range(batch)]
        rows = list(range(batch))
        return lambda: probe.verify(trees, rows, [True] * batch)

    return {total: verify(total) for total in drafted}


def _probe_text(probe: ModelRunner, context: int, width: int, vocab: int) -> list[int]:
    """``context`` tokens in cache row 0 of ``probe`` and the ``width`` tokens after them: random
    tokens, then the model's own greedy text (its last ``NATURAL_TOKENS`` and everything after).

    The passes are timed on text the model would accept: on random tokens alone it is unsure of every
    next token, and the greedy head then computes tens of float32 column blocks a row where text needs
    a few, which priced wide passes above what they cost on text (docs/runner.md, "The probe's text").
    """
    generator = torch.Generator().manual_seed(PROBE_SEED)
    natural = min(NATURAL_TOKENS, context - 1)
    tokens = torch.randint(0, vocab, (context - natural,), generator=generator, device="cpu").tolist()
    probe.prefill(0, tokens[:-1])
    while len(tokens) < context + width:
        (token,) = probe.verify([DraftTree([tokens[-1]], [-1])], [0], [True])[0].tolist()
        probe.cache.commit(0, [0])
        tokens.append(token)
    probe.cache.lengths[0] = context
    return tokens


def time_interleaved(
    calls: dict[Key, Callable[[], object]],
    rounds: int = PROBE_ROUNDS,
    synchronize: Callable[[], None] = lambda: None,
) -> dict[Key, float]:
    """Each call's fastest round by key (:func:`~reader_spec.engine.timing.best_times`): a pass's own
    cost, which a median would not give where bursts of load cover half the rounds of one width
    (``docs/architecture.md``, "How it measures", has the case that bent a median-based probe)."""
    return dict(zip(calls, best_times(list(calls.values()), rounds, synchronize), strict=True))


@dataclass(frozen=True)
class Floor:
    """The least a pass can cost on this machine: reading every weight once, or multiplying it by
    every token, whichever takes longer."""

    weight_bytes: int
    parameters: int
    bytes_per_second: float
    """Measured: reading a buffer as large as the weights, by the fastest of a sum and the fast runner's
    one-row product with and without requests ahead (on some processors the product reads faster than
    the sum, whose rate would put the floor of a one-token pass above what the runner takes)."""
    flops_per_second: float
    """Measured: a large float matrix product, by the faster of PyTorch's and the fast runner's
    kernels (PyTorch's runs far below the compiled kernel's rate on some CPUs, which would flatter
    the curve; docs/runner.md, "On an AMD EPYC host"); for weights stored in integers, the model's
    own products at many rows (their multiply-adds are integer ones, at another rate than
    float32's)."""
    integer_products: bool = False
    """Whether ``flops_per_second`` counts integer operations (weights stored in int8 or int4)."""

    def seconds(self, tokens: int) -> float:
        return max(
            self.weight_bytes / self.bytes_per_second, 2 * self.parameters * tokens / self.flops_per_second
        )


def _parameter_bytes(model: PreTrainedModel) -> int:
    """Bytes the parameters occupy, each byte once: a packed model's projections are views of shared
    fused matrices, and its matrices lie in one arena larger than they are
    (:mod:`reader_spec.engine.memory`)."""
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in model.parameters())
    total, covered = 0, 0
    for start, end in spans:
        if end > covered:
            total += end - max(start, covered)
            covered = end
    return total


def _parameter_count(model: PreTrainedModel) -> int:
    """Multiply-adds of one token through every weight: a packed matrix counts its rows and columns
    whatever its storage (4 bits, padding rows), any other parameter its elements, a tied one once."""
    packed = [module for module in model.modules() if isinstance(module, PackedLinear)]
    stored = {id(p) for module in packed for p in module.parameters(recurse=False)}
    return sum(module.in_features * module.out_features for module in packed) + sum(
        p.numel() for p in model.parameters() if id(p) not in stored
    )


def floor_and_passes(
    model: PreTrainedModel,
    widths: Sequence[int],
    context: int,
    runner: str = "auto",
    rounds: int = PROBE_ROUNDS,
) -> tuple[Floor, dict[int, float]]:
    """This machine's floor and the seconds of batch 1's passes of ``widths`` draft tokens (as
    :func:`probe_verify`), timed in the same rounds.

    A shared host's speed moves within minutes (docs/runner.md, "weights in registers, the floor in the
    passes' rounds"): a floor measured before the passes would divide one minute's passes by another
    minute's floor. Taking both in the same rounds, each at its fastest, compares them at the same
    moments.
    """
    probe = FloorProbe(model)
    passes = verify_calls(model, 1, widths, context, runner)
    calls: dict[tuple[str, int], Callable[[], object]] = {
        ("floor", key): call for key, call in probe.calls.items()
    }
    calls |= {("pass", width): call for width, call in passes.items()}
    with torch.inference_mode():
        times = time_interleaved(calls, rounds, synchronizer(model.device))
    floor = probe.floor({key: seconds for (kind, key), seconds in times.items() if kind == "floor"})
    return floor, {width: times["pass", width] for width in passes}


class FloorProbe:
    """What :class:`Floor` is measured with: reads of a buffer as large as ``model``'s weights and
    large matrix products (``calls``), and the floor from their times (``floor``)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.weight_bytes = _parameter_bytes(model)
        self.parameters = _parameter_count(model)
        device, dtype = model.device, model.dtype
        buffer = torch.ones(self.weight_bytes // torch.finfo(dtype).bits * 8, dtype=dtype, device=device)
        size = 2048
        a = torch.ones(size, size, dtype=dtype, device=device)
        self.reads = {0: (buffer.sum, self.weight_bytes)}
        products = {1: (lambda: a @ a, 2 * size**3)}
        rows = ROW_BUCKETS[-1]
        if device.type == "cpu" and dtype == torch.float32 and kernels.available():
            compiled = torch.ops.reader_spec.blocked_linear
            # The buffer read as a one-row pass reads a matrix, either way (the product streams in
            # order and prefetches, a sum does not).
            blocks = buffer[: buffer.numel() // (size * BLOCK) * size * BLOCK].view(-1, size, PANEL)
            row = torch.ones(1, size, device="cpu")
            for key, ahead in ((2, False), (-2, True)):
                self.reads[key] = (
                    functools.partial(compiled, row, blocks, None, blocks.shape[0] * PANEL, ahead),
                    blocks.numel() * 4,
                )
            blocked, x = to_blocks(a, size), torch.ones(rows, size, device="cpu")
            products[3] = (lambda: compiled(x, blocked, None, size), 2 * rows * size**2)
        # Weights in integers: the rate of the model's own products, each kind of matrix alone (what a
        # pass runs, without the calls between them), not float32's.
        kinds = {
            (m.in_features, m.out_features, m.weight_format): m
            for m in model.modules()
            if isinstance(m, PackedLinear) and m.scales is not None
        }
        if kinds:
            products = {
                4 + i: (
                    functools.partial(m, torch.ones(rows, m.in_features, dtype=dtype, device=device)),
                    2 * rows * m.in_features * m.out_features,
                )
                for i, m in enumerate(kinds.values())
            }
        self.integer_products = bool(kinds)
        self.products = products
        self.calls = {key: call for key, (call, _) in (self.reads | self.products).items()}

    def floor(self, times: dict[int, float]) -> Floor:
        """The floor from the fastest time of each of ``calls``."""
        bandwidth = max(size / times[key] for key, (_, size) in self.reads.items())
        flops = max(work / times[key] for key, (_, work) in self.products.items())
        return Floor(self.weight_bytes, self.parameters, bandwidth, flops, self.integer_products)
