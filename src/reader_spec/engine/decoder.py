"""The engine's own forward for the decoder families users run, on the model's own modules.

transformers' forward is general: per call it builds masks and rotary tables, dispatches through
hooks, attention interfaces and cache objects, and multiplies each projection separately through
``F.linear``. A verification pass needs none of that generality. :class:`FastDecoder` runs the same
arithmetic on the same modules (norms, activations, rotary embedding and ``apply_rotary_pos_emb``
come from the model's own code, so family quirks stay the family's) with what the engine needs:
fused and packed projections (:mod:`reader_spec.engine.weights`), rotary tables computed once, cache
rows written in place, packed attention over the batch's rows, and logits only where asked.

Llama and Mistral, Qwen2 and Qwen3 (per-head query/key norms), and Phi-3 (already fused projections)
share one layer shape; any other architecture runs through transformers (``ModelRunner``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from reader_spec.engine.attention import PackedLayout, additive, packed
from reader_spec.engine.kv_cache import RaggedKVCache
from reader_spec.engine.weights import PackedLinear, pack_linears

FAST_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
"""``model_type`` values the fast decoder runs; the rest use transformers' forward."""

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""Rotary embeddings that depend on the position only, so one table serves every pass."""


def supports(model: PreTrainedModel) -> bool:
    config = model.config
    return (
        config.model_type in FAST_FAMILIES
        and type(model).__name__.endswith("ForCausalLM")
        and not getattr(config, "is_encoder_decoder", False)
    )


@dataclass
class _Layer:
    input_norm: nn.Module
    qkv: PackedLinear
    heads: int
    query_norm: nn.Module | None
    key_norm: nn.Module | None
    output: PackedLinear
    post_attention_norm: nn.Module
    gate_up: PackedLinear
    down: PackedLinear
    activation: nn.Module
    attention: nn.Module
    sliding: bool


class FastDecoder:
    """Packs ``model``'s weights in place (its own forward keeps working) and runs packed passes."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        core = model.model
        attention0 = core.layers[0].self_attn
        self.apply_rotary = sys.modules[type(attention0).__module__].apply_rotary_pos_emb
        self.head_dim = attention0.head_dim
        self.scaling = attention0.scaling
        self.rotary = core.rotary_emb
        self.rotary_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self.norm = core.norm
        self.embed = core.embed_tokens
        tied = model.lm_head.weight is core.embed_tokens.weight
        self.lm_head, _ = pack_linears([model.lm_head])
        model.lm_head = self.lm_head
        if tied:
            core.embed_tokens = self.embed = _TiedEmbedding(self.lm_head)
        layer_types = getattr(model.config, "layer_types", None)
        window = getattr(model.config, "sliding_window", None)
        slides = [bool(window) and (layer_types is None or kind == "sliding_attention")
                  for kind in layer_types or [None] * len(core.layers)]  # fmt: skip
        self.layers = [self._pack_layer(layer, s) for layer, s in zip(core.layers, slides, strict=True)]
        self.attend = packed(_attention)

    def _pack_layer(self, layer: nn.Module, sliding: bool) -> _Layer:
        attention, mlp = layer.self_attn, layer.mlp
        if hasattr(attention, "qkv_proj"):  # Phi-3: query, key and value are already one matrix
            config = attention.config
            heads = config.num_attention_heads * self.head_dim
            kv_heads = config.num_key_value_heads * self.head_dim
            qkv, _ = pack_linears([attention.qkv_proj], parts=(heads, kv_heads, kv_heads))
            attention.qkv_proj = qkv
        else:
            qkv, views = pack_linears([attention.q_proj, attention.k_proj, attention.v_proj])
            attention.q_proj, attention.k_proj, attention.v_proj = views
        attention.o_proj, _ = pack_linears([attention.o_proj])
        if hasattr(mlp, "gate_up_proj"):  # Phi-3: gate and up are one matrix too
            half = mlp.gate_up_proj.weight.shape[0] // 2
            gate_up, _ = pack_linears([mlp.gate_up_proj], parts=(half, half))
            mlp.gate_up_proj = gate_up
        else:
            gate_up, (mlp.gate_proj, mlp.up_proj) = pack_linears([mlp.gate_proj, mlp.up_proj])
        mlp.down_proj, _ = pack_linears([mlp.down_proj])
        heads = qkv.parts[0][1] // self.head_dim
        return _Layer(
            input_norm=layer.input_layernorm,
            qkv=qkv,
            heads=heads,
            query_norm=getattr(attention, "q_norm", None),
            key_norm=getattr(attention, "k_norm", None),
            output=attention.o_proj,
            post_attention_norm=layer.post_attention_layernorm,
            gate_up=gate_up,
            down=mlp.down_proj,
            activation=getattr(mlp, "act_fn", None) or mlp.activation_fn,
            attention=attention,
            sliding=sliding,
        )

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        masks: dict[str, torch.Tensor],
        cache: RaggedKVCache,
        layout: PackedLayout | None,
        keep: torch.Tensor | None,
    ) -> torch.Tensor:
        """Logits ``[tokens kept, vocab]`` of a packed pass; ``keep`` indexes the tokens (None: all)."""
        hidden = self.embed(input_ids)
        masks = additive(masks, hidden.dtype)
        cos, sin = self._rotary(hidden, positions)
        tokens = input_ids.shape[0]
        for index, layer in enumerate(self.layers):
            mask = masks["sliding_attention" if layer.sliding else "full_attention"]
            qkv = layer.qkv(_rms_norm(layer.input_norm, hidden))
            query_key = self._rotate(_query_key(layer, qkv, tokens, self.head_dim), cos, sin)
            value = layer.qkv.split(qkv)[2].view(tokens, -1, self.head_dim)
            keys, values = cache.layers[index].write(query_key[:, layer.heads :], value)
            query = query_key[None, :, : layer.heads].transpose(1, 2)
            if layout is None:
                attended, _ = _attention(layer.attention, query, keys, values, mask, scaling=self.scaling)
            else:
                attended, _ = self.attend(
                    layer.attention, query, keys, values, mask, scaling=self.scaling, packed_layout=layout
                )
            hidden = hidden + layer.output(attended.reshape(tokens, -1))
            gate, up = layer.gate_up.split(layer.gate_up(_rms_norm(layer.post_attention_norm, hidden)))
            hidden = hidden + layer.down(layer.activation(gate) * up)
        if keep is not None:
            hidden = hidden[keep]
        return self.lm_head(_rms_norm(self.norm, hidden))

    def _rotate(self, query_key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of queries and keys together (``[tokens, heads, head_dim]``), with the
        model's own formula; a partial rotation (Phi-3 variants) goes through the model's function."""
        cos, sin = cos[0, :, None], sin[0, :, None]
        if cos.shape[-1] != query_key.shape[-1]:
            rotated, _ = self.apply_rotary(query_key, query_key[:, :0], cos, sin, unsqueeze_dim=1)
            return rotated
        half = query_key.shape[-1] // 2
        return query_key * cos + torch.cat((-query_key[..., half:], query_key[..., :half]), dim=-1) * sin

    def _rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if getattr(self.rotary, "rope_type", "default") not in STATIC_ROPE_TYPES:
            return self.rotary(hidden, positions[None])
        needed = int(positions.max()) + 1
        if self.rotary_table is None or self.rotary_table[0].shape[1] < needed:
            size = max(needed, 2 * (0 if self.rotary_table is None else self.rotary_table[0].shape[1]), 1024)
            self.rotary_table = self.rotary(hidden, torch.arange(size, device=hidden.device)[None])
        cos, sin = self.rotary_table
        return cos[:, positions], sin[:, positions]


def _query_key(layer: _Layer, qkv: torch.Tensor, tokens: int, head_dim: int) -> torch.Tensor:
    """Queries and keys as one ``[tokens, heads + kv_heads, head_dim]`` block (a view where they lie
    side by side; normed per head where the family does)."""
    (query_start, query_size), (key_start, key_size), _ = layer.qkv.parts
    if layer.query_norm is None and key_start == query_start + query_size:
        return qkv[:, query_start : key_start + key_size].view(tokens, -1, head_dim)
    query = qkv[:, query_start : query_start + query_size].view(tokens, -1, head_dim)
    key = qkv[:, key_start : key_start + key_size].view(tokens, -1, head_dim)
    if layer.query_norm is not None:
        query, key = _rms_norm(layer.query_norm, query), _rms_norm(layer.key_norm, key)
    return torch.cat((query, key), dim=1)


def _rms_norm(norm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The family's RMSNorm (``weight * x / rms(x)``) as PyTorch's fused kernel."""
    return nn.functional.rms_norm(hidden, norm.weight.shape, norm.weight, norm.variance_epsilon)


class _TiedEmbedding(nn.Module):
    """The input embedding read from the packed output layer it is tied to (one copy of the table)."""

    def __init__(self, lm_head: PackedLinear):
        super().__init__()
        self.lm_head = [lm_head]  # a list: not registered twice as a submodule

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head[0].rows_of(tokens)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.lm_head[0].plain_weight()


def _attention(module, query, key, value, mask, scaling: float, **kwargs):
    """``query`` (``[rows, heads, width, dim]``) on cache rows, grouped key/value heads read in place;
    ``mask`` is additive. Returns ``[rows, width, heads, dim]``."""
    output = nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )
    return output.transpose(1, 2), None
