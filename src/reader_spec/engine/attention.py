"""Attention for packed verification passes, plugged into the models' own forward.

A verification pass packs every sequence's draft tree into one row of tokens (``[1, total]``), so
its matrix products cost what the batch's total tree tokens cost, not ``batch x widest tree``.
Attention is the one operation that must see the batch again: each sequence attends to its own row
of the KV cache. :func:`packed` wraps an attention function so that, when the runner passes a
:class:`PackedLayout`, it splits the query into groups of sequences in consecutive cache rows and
attends each group against those rows only (views, no cache copy), padding a group's trees to its
widest where that costs less than another attention call. The wrappers are registered with
transformers' ``AttentionInterface`` and chosen by :func:`use_packed_attention`, so no modeling code
changes.

The inner function for ``sdpa`` models also fixes a CPU cost: transformers' ``sdpa`` repeats every
key/value head for each query head it serves (``repeat_kv``) whenever more than one token is queried
under a mask, which copies the whole cache each layer (``docs/architecture.md``, "Packed attention").
PyTorch's kernel reads shared heads directly (``enable_gqa``). Everything else (one query token, no
mask, GPUs, position biases, soft-capping) goes to ``sdpa`` itself.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask

from reader_spec.engine.timing import best_times

PACKED_SDPA = "reader_packed_sdpa"
PACKED_EAGER = "reader_packed_eager"

AttentionFunction = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


MOST_CALL_COST = 1 << 24
"""The call cost where a call outweighs any pass's padding (more query-key pairs than a batch of 32
sequences with trees of 16 tokens over 32,000 tokens of context): every run of consecutive rows
then attends in one call."""

_CALL_COSTS: dict[tuple, int] = {}


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences in consecutive cache rows that attend as one batch, their trees padded to ``width``.

    ``first`` is the group's first tree in the pass, ``first_row`` its first cache row counted from the
    pass's first row. ``padding`` holds, for unequal trees, the (tree in group, offset) of each token;
    ``None`` when every tree of the group is ``width`` long and the tokens simply reshape.
    """

    first: int
    first_row: int
    count: int
    width: int
    kv_length: int
    tokens: int
    padding: tuple[torch.Tensor, torch.Tensor] | None


@dataclass
class PackedLayout:
    """Where a packed pass's tokens go: each group's trees back to back, groups in row order.

    ``calls`` counts the attention layers that honoured the layout.
    """

    groups: list[AttentionGroup]
    calls: int = 0


def pack(
    widths: list[int], lengths: list[int], rows: list[int], call_cost: int, device: torch.device | None = None
) -> PackedLayout:
    """Split the trees (in ascending cache ``rows``) into groups minimising ``calls x call_cost +
    query-key pairs``; a group's rows are consecutive, so that it attends over a view of the cache.

    A group of ``count`` trees attends as ``count x width x (longest context + width)`` pairs: its
    trees padded to the widest, its contexts to the longest (a masked key still costs its pair). A
    long prompt among short ones therefore gets its own call, as does a deep tree among lone roots.
    Exact dynamic programme over the trees; ``call_cost`` from :func:`attention_call_cost`. The
    padding indices are made on ``device`` once per pass: indices on the host would be copied to a
    GPU in every layer, each copy waiting for the layers queued before it.
    """
    best = [0.0] + [math.inf] * len(widths)  # best[i]: cheapest split of the first i trees
    split = [0] * (len(widths) + 1)  # split[i]: where the last group of that split starts
    for i in range(1, len(widths) + 1):
        width = longest = 0
        for j in range(i - 1, -1, -1):  # the last group is trees j..i-1
            if j < i - 1 and rows[j] + 1 != rows[j + 1]:
                break  # a free row between them: no view covers both
            width, longest = max(width, widths[j]), max(longest, lengths[j])
            cost = best[j] + call_cost + (i - j) * width * (longest + width)
            if cost <= best[i]:  # ties: the larger group, fewer calls
                best[i], split[i] = cost, j
    groups = []
    i = len(widths)
    while i:
        groups.append(_group(widths, lengths, split[i], i, rows[split[i]] - rows[0], device))
        i = split[i]
    return PackedLayout(groups[::-1])


def _group(
    widths: list[int],
    lengths: list[int],
    first: int,
    end: int,
    first_row: int,
    device: torch.device | None = None,
) -> AttentionGroup:
    own = widths[first:end]
    width = max(own)
    kv_length = max(lengths[first:end]) + width
    padding = None
    if min(own) != width:
        rows = torch.tensor([row for row, n in enumerate(own) for _ in range(n)], device=device)
        offsets = torch.tensor([offset for n in own for offset in range(n)], device=device)
        padding = (rows, offsets)
    return AttentionGroup(first, first_row, end - first, width, kv_length, sum(own), padding)


@dataclass(frozen=True)
class HeadShape:
    """A model's attention heads: query heads, key/value heads, and their width."""

    heads: int
    kv_heads: int
    head_dim: int


def attention_call_cost(
    shape: HeadShape, dtype: torch.dtype, device: torch.device, synchronize: Callable[[], None]
) -> int:
    """What one more attention call costs, in query-key pairs of this shape on this device, timed once
    per process: what :func:`pack` weighs padding against.

    On a CPU a call's fixed work is worth a few hundred pairs (``docs/architecture.md``, "Packed
    attention"). On a GPU a call is host work (slices, copies, kernel launches) while pairs are
    almost free: there the cost comes out as :data:`MOST_CALL_COST` and a batch attends in one call
    per run of consecutive rows.
    """
    key = (shape, dtype, str(device))
    if key not in _CALL_COSTS:
        _CALL_COSTS[key] = _time_call_cost(shape, dtype, device, synchronize)
    return _CALL_COSTS[key]


def _time_call_cost(
    shape: HeadShape, dtype: torch.dtype, device: torch.device, synchronize: Callable[[], None]
) -> int:
    """Eight one-token trees attend in one call and in eight over a short context, and in one call
    over a long one: the seven extra calls' time over the extra pairs' time per pair. Constant
    inputs, so that no random state moves."""
    trees, short, long, repeats = 8, 64, 1024, 4
    widths = [1] * trees
    query = torch.ones(1, shape.heads, trees, shape.head_dim, dtype=dtype, device=device)
    keys = torch.ones(trees, shape.kv_heads, long + 1, shape.head_dim, dtype=dtype, device=device)
    mask = torch.zeros(trees, 1, 1, long + 1, dtype=dtype, device=device)
    attend = packed(_plain_sdpa)
    layouts = [
        PackedLayout([_group(widths, [short] * trees, 0, trees, 0)]),
        PackedLayout([_group(widths, [short] * trees, i, i + 1, i) for i in range(trees)]),
        PackedLayout([_group(widths, [long] * trees, 0, trees, 0)]),
    ]

    def timed(layout: PackedLayout) -> Callable[[], None]:
        def run() -> None:
            for _ in range(repeats):
                attend(None, query, keys, keys, mask, packed_layout=layout)
            synchronize()

        return run

    with torch.inference_mode():
        one_call, eight_calls, long_context = best_times([timed(layout) for layout in layouts], rounds=7)
    per_call = (eight_calls - one_call) / (trees - 1)
    per_pair = (long_context - one_call) / (trees * (long - short))
    if per_pair <= 0 or per_call >= per_pair * MOST_CALL_COST:
        return MOST_CALL_COST
    return max(0, round(per_call / per_pair))


def in_place_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """PyTorch's kernel on ``[rows, heads, width, dim]`` queries, key/value heads shared by several
    query heads read in place (not copied per query head); returns ``[rows, width, heads, dim]``."""
    output = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        dropout_p=dropout,
        scale=scale,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return output.transpose(1, 2)


def _plain_sdpa(module, query, key, value, mask, **kwargs) -> tuple[torch.Tensor, None]:
    """PyTorch's kernel as the packed passes call it."""
    return in_place_sdpa(query, key, value, mask), None


def visibility(
    lengths: torch.Tensor,
    local_masks: Sequence[torch.Tensor],
    kv_length: int,
    sliding_window: int | None = None,
    positions: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Which keys each new token sees, ``(batch, 1, width, kv_length)`` booleans per layer type.

    New tokens are written after each row's context. ``local_masks[b]`` is ``[new, earlier + new]``:
    token i of row b sees what its row ``i`` marks among the row's last ``earlier`` cached tokens and
    its new tokens, and the whole context before those (``earlier`` is 0 for a verified tree; a draft
    model growing a tree level by level masks the levels it cached before). ``positions``, which only
    a ``sliding_window`` needs, are the new tokens' position ids, padded to the widest tree. Rows past
    a tree's own tokens are padding: an attention group that pads its trees computes them and
    discards the result; they see key 0, so no row is empty. Under a sliding window, masked earlier
    tokens count at their cache index (drafts only: verified trees have none).

    Built in numpy, on the host (the masks are host tensors): a pass's bookkeeping runs after its
    weights have swept the caches, where each PyTorch op costs many times a numpy one
    (docs/runner.md, "inside the compiled stack; a pass's Python").
    """
    width = max(local.shape[0] for local in local_masks)
    allowed = np.zeros((len(local_masks), width, kv_length), dtype=bool)
    for b, (length, local) in enumerate(zip(lengths.tolist(), local_masks, strict=True)):
        new, seen = local.shape
        first = length - (seen - new)  # the first key the local mask covers: all before it is context
        allowed[b, :new, :first] = True
        allowed[b, :new, first : first + seen] = local.numpy()
        allowed[b, new:, 0] = True  # padding rows see key 0 only, so that none is empty
    full = torch.from_numpy(allowed)
    masks = {"full_attention": full[:, None]}
    if sliding_window is not None:
        if positions is None:
            raise ValueError("a sliding window needs the new tokens' positions")
        keys = torch.arange(kv_length, device="cpu")
        new = keys[None] - lengths[:, None]  # key index relative to the new tokens
        is_new = (new >= 0) & (new < width)
        key_positions = torch.where(is_new, positions.gather(1, new.clamp(0, width - 1)), keys[None])
        distance = positions[:, :, None] - key_positions[:, None, :]
        masks["sliding_attention"] = (full & (distance < sliding_window))[:, None]
    return masks


def additive(masks: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Boolean masks as the additive float masks transformers' attention takes."""
    return {
        name: torch.zeros_like(m, dtype=dtype).masked_fill_(~m, torch.finfo(dtype).min)
        for name, m in masks.items()
    }


def packed(inner: AttentionFunction) -> AttentionFunction:
    """``inner`` made to honour a ``packed_layout`` keyword; without one it is called unchanged."""

    def attention(module, query, key, value, attention_mask, *args, packed_layout=None, **kwargs):
        if packed_layout is None:
            return inner(module, query, key, value, attention_mask, *args, **kwargs)
        packed_layout.calls += 1
        heads, dim = query.shape[1], query.shape[3]
        output = query.new_empty(query.shape[2], heads, value.shape[-1])
        start = 0
        for group in packed_layout.groups:
            end = start + group.tokens
            trees = slice(group.first, group.first + group.count)
            rows = slice(group.first_row, group.first_row + group.count)
            tokens = query[0, :, start:end]
            if group.padding is None:
                group_query = tokens.unflatten(1, (group.count, group.width)).transpose(0, 1)
            else:
                group_query = query.new_zeros(group.count, heads, group.width, dim)
                group_query[group.padding[0], :, group.padding[1]] = tokens.transpose(0, 1)
            group_mask = None
            if attention_mask is not None:
                group_mask = attention_mask[trees, :, : group.width, : group.kv_length]
            group_output, _ = inner(
                module,
                group_query,
                key[rows, :, : group.kv_length],
                value[rows, :, : group.kv_length],
                group_mask,
                *args,
                **kwargs,
            )
            if group.padding is None:
                output[start:end] = group_output.flatten(0, 1)
            else:
                output[start:end] = group_output[group.padding]
            start = end
        return output[None], None

    return attention


def grouped_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa``, but masked multi-token queries on CPU read grouped heads in place."""
    groups = getattr(module, "num_key_value_groups", 1)
    plain = (
        groups == 1
        or query.shape[2] == 1
        or attention_mask is None
        or query.device.type != "cpu"
        or any(kwargs.get(name) is not None for name in ("position_bias", "softcap", "s_aux", "sinks"))
    )
    if plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    return in_place_sdpa(query, key, value, attention_mask, scaling, dropout).contiguous(), None


def model_eager_attention(
    module: torch.nn.Module, *args, **kwargs
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The eager attention of the module's own modeling file (what ``eager`` would have run)."""
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(
            f"{type(module).__name__} has no eager_attention_forward to run packed passes with"
        )
    return eager(module, *args, **kwargs)


AttentionInterface.register(PACKED_SDPA, packed(grouped_sdpa_attention))
AttentionInterface.register(PACKED_EAGER, packed(model_eager_attention))
ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SDPA, sdpa_mask)
ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_EAGER, eager_mask)

_PACKED_VERSIONS = {"sdpa": PACKED_SDPA, "eager": PACKED_EAGER}


def use_packed_attention(model: PreTrainedModel) -> bool:
    """Switch an ``sdpa`` or ``eager`` model to its packed version (same results outside packed
    passes); returns whether the model can now run packed passes.

    Other implementations (flash attention, flex) are left alone; such models verify one sequence
    per pass (see :class:`reader_spec.engine.runner.ModelRunner`).
    """
    implementation = _PACKED_VERSIONS.get(model.config._attn_implementation)
    if implementation is not None:
        model.set_attn_implementation(implementation)
    return model.config._attn_implementation in _PACKED_VERSIONS.values()
