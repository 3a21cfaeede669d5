"""The rotary embedding of a pass, from the model's own rotary module, with its tables computed once.

transformers computes cos and sin for every forward; a position's values never change for the rotary
types that depend on the position only, so the fast decoder reads them from a table that grows by
doubling, computed by the family's own module (its scaling rules stay the family's).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""Rotary embeddings that depend on the position only, so one table serves every pass."""

INITIAL_TABLE = 1024
"""Positions in a table when first computed (then doubled as a pass needs more)."""


@dataclass
class Rotation:
    """The rotary embedding of a pass: cos and sin at its positions, ``[tokens, rotated dims]``."""

    cos: torch.Tensor
    sin: torch.Tensor

    def whole(self, head_dim: int) -> bool:
        """Whether it turns whole heads (else the first dims only: Phi-3 variants, partial factors)."""
        return self.cos.shape[-1] == head_dim

    @functools.cached_property
    def _per_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin broadcast over heads, sin's first half negated: ``rotate_half`` folded into it,
        once per pass rather than per layer."""
        half = self.sin.shape[-1] // 2
        signed = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)
        return self.cos[:, None], signed[:, None]

    def rotate(self, heads: torch.Tensor) -> torch.Tensor:
        """``x cos + rotate_half(x) sin`` of ``[tokens, heads, head_dim]``, the rotated dims first: the
        families' formula, bit for bit (``rotate_half(x) sin`` = ``roll(x) x signed sin``), in four
        kernels instead of seven."""
        cos, signed_sin = self._per_head
        dims = cos.shape[-1]
        turned = heads[..., :dims] if dims != heads.shape[-1] else heads
        rotated = turned * cos + turned.roll(dims // 2, dims=-1) * signed_sin
        if turned is heads:
            return rotated
        return torch.cat((rotated, heads[..., dims:]), dim=-1)


class RotaryTables:
    """A model's rotary module read through tables (one per layer kind where the family keeps one per
    kind: Gemma 3); rotary types that depend on more than the position are computed per pass."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.by_kind = "layer_type" in inspect.signature(module.forward).parameters
        self.tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def whole_heads(self, head_dim: int) -> bool:
        """Whether the embedding turns whole heads, as the compiled layers do (a partial factor, in
        some Phi-3 variants, turns the first dims only)."""
        inv_freq = getattr(self.module, "inv_freq", None)
        return inv_freq is None or 2 * inv_freq.shape[-1] == head_dim

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, kind: str) -> Rotation:
        """cos and sin at ``positions`` for layers of ``kind`` (``hidden`` gives the dtype and device)."""
        extra = (kind,) if self.by_kind else ()
        rope_type = getattr(self.module, "rope_type", "default")
        if isinstance(rope_type, dict):  # one per layer type (Gemma 3)
            rope_type = rope_type.get(kind, "default")
        if rope_type not in STATIC_ROPE_TYPES:
            cos, sin = self.module(hidden, positions[None], *extra)
            return Rotation(cos[0], sin[0])
        needed = int(positions.max()) + 1
        table = self.tables.get(kind)
        if table is None or table[0].shape[1] < needed:
            size = max(needed, 2 * (0 if table is None else table[0].shape[1]), INITIAL_TABLE)
            positions_table = torch.arange(size, device=hidden.device)[None]
            table = self.tables[kind] = self.module(hidden, positions_table, *extra)
        cos, sin = table
        return Rotation(cos[0, positions], sin[0, positions])
