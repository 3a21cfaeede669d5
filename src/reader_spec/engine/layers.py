"""A decoder layer as the fast decoder runs it: its packed matrices, its family's modules, and its
compiled form.

Packing fuses the projections that read one input (query/key/value, gate/up) and stores every matrix
as :mod:`reader_spec.engine.weights` decides; the family's norms, activation and attention module are
kept as they are, so that family quirks stay the family's. Layers of the Llama shape (RMSNorm, SiLU,
whole-head rotary, no soft-capping: Llama, Mistral, Qwen2, Qwen3) also get a compiled form
(``DecoderLayer`` of :mod:`reader_spec.engine.kernels`), and a model whose every layer has one runs
them all in one compiled call (``DecoderStack``).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import SiLUActivation

from reader_spec.engine.memory import PageArena
from reader_spec.engine.weights import PackedLinear, pack_linears


@dataclass
class PackedLayer:
    """One decoder layer's packed matrices and family modules (:func:`pack_layer`)."""

    input_norm: nn.Module
    qkv: PackedLinear
    heads: int
    query_norm: nn.Module | None
    key_norm: nn.Module | None
    output: PackedLinear
    attention_output_norm: nn.Module | None
    """Gemma: a norm on the attention's output before the residual."""
    mlp_input_norm: nn.Module
    mlp_output_norm: nn.Module | None
    gate_up: PackedLinear
    down: PackedLinear
    activation: nn.Module
    attention: nn.Module
    kind: str
    """``full_attention`` or ``sliding_attention``: which mask (and, for Gemma 3, rotary table)."""
    softcap: float | None
    native: torch.ScriptObject | None = None
    """The whole layer as one compiled call (``DecoderLayer`` of :mod:`.kernels`), where it has the
    Llama shape and runs on a CPU in float32."""

    kernels_by_rows: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    """For each of :attr:`linears`, which kernel multiplies that many rows (a :class:`Kernel`'s number,
    as the compiled layer takes it)."""

    @property
    def linears(self) -> tuple[PackedLinear, ...]:
        return self.qkv, self.output, self.gate_up, self.down

    def kernels_at(self, rows: int) -> list[int]:
        chosen = self.kernels_by_rows.get(rows)
        if chosen is None:
            chosen = self.kernels_by_rows[rows] = [int(linear.kernel_at(rows)) for linear in self.linears]
        return chosen

    def __deepcopy__(self, memo: dict) -> PackedLayer:
        """A copy over the copied modules, its compiled layer built again (those cannot be copied)."""
        fields = {
            f.name: copy.deepcopy(getattr(self, f.name), memo)
            for f in dataclasses.fields(self)
            if f.name != "native"
        }
        copied = PackedLayer(**fields)
        if self.native is not None:
            copied.native = native_layer(copied)
        return copied


def pack_layer(
    layer: nn.Module, kind: str, head_dim: int, weight_format: str, arena: PageArena | None
) -> PackedLayer:
    """Pack a decoder layer's projections in place (``weight_format``: the storage format, matrices in
    ``arena`` where given) and gather what a pass runs: fused query/key/value and gate/up matrices,
    the family's norms, activation and attention module."""
    attention, mlp = layer.self_attn, layer.mlp
    if hasattr(attention, "qkv_proj"):  # Phi-3: query, key and value are already one matrix
        config = attention.config
        heads = config.num_attention_heads * head_dim
        kv_heads = config.num_key_value_heads * head_dim
        qkv, _ = pack_linears(
            [attention.qkv_proj],
            parts=(heads, kv_heads, kv_heads),
            weight_format=weight_format,
            arena=arena,
        )
        attention.qkv_proj = qkv
    else:
        qkv, views = pack_linears(
            [attention.q_proj, attention.k_proj, attention.v_proj], weight_format=weight_format, arena=arena
        )
        attention.q_proj, attention.k_proj, attention.v_proj = views
    attention.o_proj, _ = pack_linears([attention.o_proj], weight_format=weight_format, arena=arena)
    if hasattr(mlp, "gate_up_proj"):  # Phi-3: gate and up are one matrix too
        half = mlp.gate_up_proj.out_features // 2  # nn.Linear's or, packed before, PackedLinear's
        gate_up, _ = pack_linears(
            [mlp.gate_up_proj], parts=(half, half), weight_format=weight_format, arena=arena
        )
        mlp.gate_up_proj = gate_up
    else:
        gate_up, (mlp.gate_proj, mlp.up_proj) = pack_linears(
            [mlp.gate_proj, mlp.up_proj], weight_format=weight_format, arena=arena
        )
    mlp.down_proj, _ = pack_linears([mlp.down_proj], weight_format=weight_format, arena=arena)
    gemma = hasattr(layer, "pre_feedforward_layernorm")
    return PackedLayer(
        input_norm=layer.input_layernorm,
        qkv=qkv,
        heads=qkv.parts[0][1] // head_dim,
        query_norm=getattr(attention, "q_norm", None),
        key_norm=getattr(attention, "k_norm", None),
        output=attention.o_proj,
        attention_output_norm=layer.post_attention_layernorm if gemma else None,
        mlp_input_norm=layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm,
        mlp_output_norm=layer.post_feedforward_layernorm if gemma else None,
        gate_up=gate_up,
        down=mlp.down_proj,
        activation=getattr(mlp, "act_fn", None) or mlp.activation_fn,
        attention=attention,
        kind=kind,
        softcap=getattr(attention, "attn_logit_softcapping", None),
    )


def native_layer(layer: PackedLayer) -> torch.ScriptObject | None:
    """The layer as one compiled ``DecoderLayer`` where it has the Llama shape (RMSNorms of one epsilon,
    SiLU, no norms after attention or MLP, queries and keys side by side, no soft-capping); else None."""
    norms = [layer.input_norm, layer.mlp_input_norm]
    if layer.query_norm is not None:
        norms += [layer.query_norm, layer.key_norm]
    epsilons = {getattr(norm, "variance_epsilon", None) for norm in norms}
    (query_start, query_size), (key_start, key_size), (value_start, _) = layer.qkv.parts
    (_, intermediate), (up_start, _) = layer.gate_up.parts
    llama_shaped = (
        len(epsilons) == 1
        and None not in epsilons
        and layer.attention_output_norm is None
        and layer.mlp_output_norm is None
        and isinstance(layer.activation, (nn.SiLU, SiLUActivation))
        and layer.softcap is None
        and query_start == 0
        and key_start == query_size
        and all(linear.blocked for linear in layer.linears)
    )
    if not llama_shaped:
        return None
    head_dim = query_size // layer.heads
    classes = torch.classes.reader_spec
    return classes.DecoderLayer(
        layer.input_norm.weight,
        None if layer.query_norm is None else layer.query_norm.weight,
        None if layer.key_norm is None else layer.key_norm.weight,
        layer.mlp_input_norm.weight,
        epsilons.pop(),
        *(classes.Linear(m.weight, m.scales, m.bias, m.in_features, m.out_features) for m in layer.linears),
        layer.heads,
        key_size // head_dim,
        head_dim,
        value_start,
        up_start,
        intermediate,
        layer.attention.scaling,
    )


def stack_kinds(layers: list[PackedLayer]) -> list[str]:
    """The layers' attention kinds in the order a ``DecoderStack`` numbers them."""
    return sorted({layer.kind for layer in layers})


def native_stack(layers: list[PackedLayer], final_norm: nn.Module) -> torch.ScriptObject | None:
    """All layers and the final norm as one compiled ``DecoderStack`` where every layer has a compiled
    form and the norm is Llama's RMSNorm (as the layers' are); else None."""
    epsilon = getattr(final_norm, "variance_epsilon", None)
    if not layers or any(layer.native is None for layer in layers) or epsilon is None:
        return None
    kinds = stack_kinds(layers)
    stack = torch.classes.reader_spec.DecoderStack()
    for layer in layers:
        stack.add(layer.native, kinds.index(layer.kind))
    stack.set_final_norm(final_norm.weight, epsilon)
    return stack


def layer_kinds(config: PretrainedConfig) -> list[str]:
    """Each layer's attention kind: its ``layer_types`` entry, or sliding everywhere where a window is
    set without them (Mistral)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return list(layer_types[: config.num_hidden_layers])
    kind = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
    return [kind] * config.num_hidden_layers
