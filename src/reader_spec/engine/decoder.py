"""The engine's own forward for the decoder families users run, on the model's own modules.

transformers' forward is general: per call it builds masks and rotary tables, dispatches through
hooks, attention interfaces and cache objects, and multiplies each projection separately through
``F.linear``. A verification pass needs none of that generality. :class:`FastDecoder` runs the same
arithmetic on the same modules (activations, Gemma's norms, the rotary embedding, partial rotations
and soft-capped attention come from the model's own code, so family quirks stay the family's; the
Llama-style RMSNorm, one formula in every family that has it, is the engine's own) with what the
engine needs: fused and packed projections (:mod:`reader_spec.engine.weights`), rotary tables
computed once, cache rows written in place, packed attention over the batch's rows, and logits only
where asked. On a CPU in float32 the operators between the products (residual add with RMSNorm, SiLU
gating, rotary embedding with the cache write, attention of passes of up to :data:`NATIVE_ROWS`
tokens) are compiled ops (:mod:`reader_spec.engine.kernels`): each matrix product evicts PyTorch's
code from the caches, so a chain of small operators costs far more there than alone. Layers of the
Llama shape (RMSNorm, SiLU, whole-head rotary, no soft-capping: Llama, Mistral, Qwen2, Qwen3) then run
whole, one compiled call each (``DecoderLayer``), with the same ops and the same results.

Llama and Mistral, Qwen2 and Qwen3 (per-head query/key norms), Phi-3 (already fused projections) and
Gemma 2 and 3 (norms around attention and MLP, scaled embeddings, soft-capping, a rotary table per
layer type) share one layer shape with per-family switches; any other architecture runs through
transformers (``ModelRunner``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import SiLUActivation

from reader_spec.engine import kernels
from reader_spec.engine.attention import PackedLayout, additive, in_place_sdpa, model_eager_attention, packed
from reader_spec.engine.greedy_head import GreedyHead, tree_rows
from reader_spec.engine.host import longs
from reader_spec.engine.kernel_choice import ROW_BUCKETS, kernel_rows, row_bucket
from reader_spec.engine.kv_cache import RaggedKVCache, RaggedLayer
from reader_spec.engine.layers import (
    PackedLayer,
    layer_kinds,
    native_layer,
    native_stack,
    pack_layer,
    stack_kinds,
)
from reader_spec.engine.memory import PageArena
from reader_spec.engine.rotary import RotaryTables, Rotation
from reader_spec.engine.timing import best_times
from reader_spec.engine.tree import DraftTree
from reader_spec.engine.weights import PackedLinear, pack_linears, packed_bytes, time_together

FAST_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
"""``model_type`` values the fast decoder runs; the rest use transformers' forward."""

NATIVE_ROWS = 64
"""Passes of up to this many tokens (plain steps, trees, batches) always run the compiled attention
and whole compiled layers. Larger ones (a prompt's chunks) run them where the compiled attention timed
faster than PyTorch's kernel for a prompt of that size (:func:`compiled_attention_wins`): PyTorch's
shares hundreds of rows better between cores on some CPUs, not on others (``docs/runner.md``, "On an
AMD EPYC host")."""


def supports(model: PreTrainedModel) -> bool:
    """Whether the fast decoder runs this model (a causal LM of a family it knows)."""
    config = model.config
    return (
        config.model_type in FAST_FAMILIES
        and type(model).__name__.endswith("ForCausalLM")
        and not getattr(config, "is_encoder_decoder", False)
    )


@dataclass
class _Plan:
    """Where each token of a pass goes, for the compiled attention: its cache row and position, its
    tree and place in it, and each layer kind's visibility (``[trees, width, kv_length]``)."""

    token_row: torch.Tensor
    position: torch.Tensor
    token_tree: torch.Tensor
    token_offset: torch.Tensor
    visible: dict[str, torch.Tensor]


class FastDecoder:
    """Packs ``model``'s weights in place (its own forward keeps working) and runs packed passes.

    ``weight_format``: the storage format of every packed matrix (``WEIGHT_FORMATS`` of
    :mod:`reader_spec.engine.weights`; ``int4`` for the self-draft). ``model`` may have been packed
    before (a copy of a packed model, packed again in another format).
    """

    def __init__(self, model: PreTrainedModel, weight_format: str = "float32"):
        self.model = model
        self.weight_format = weight_format
        core = model.model
        attention0 = core.layers[0].self_attn
        self.head_dim = attention0.head_dim
        self.scaling = attention0.scaling
        self.rotary = RotaryTables(core.rotary_emb)
        self.final_softcap = getattr(model.config, "final_logit_softcapping", None)
        self.norm = core.norm
        self.embed = core.embed_tokens
        if isinstance(core.embed_tokens, _TiedEmbedding):  # packed before: tied to the old output layer
            tied, scale = True, core.embed_tokens.scale
        else:
            tied = model.lm_head.weight is core.embed_tokens.weight
            scale = getattr(core.embed_tokens, "embed_scale", None)
        linears = [m for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear))]
        self.arena = (
            PageArena(sum(packed_bytes(m, weight_format) for m in linears)) if _on_cpu(model) else None
        )
        """Where the packed matrices live (:mod:`reader_spec.engine.memory`)."""
        self.lm_head, _ = pack_linears([model.lm_head], weight_format=weight_format, arena=self.arena)
        model.lm_head = self.lm_head
        if tied:
            core.embed_tokens = self.embed = _TiedEmbedding(self.lm_head, scale)
        self.layers = [
            pack_layer(layer, kind, self.head_dim, weight_format, self.arena)
            for layer, kind in zip(core.layers, layer_kinds(model.config), strict=True)
        ]
        self.kv_heads = self.layers[0].qkv.parts[1][1] // self.head_dim
        self.kinds = stack_kinds(self.layers)
        """The layers' attention kinds, in the compiled stack's order."""
        time_together([*(linear for layer in self.layers for linear in layer.linears), self.lm_head])
        self.attend = packed(self._attention)
        self.fused = _on_cpu(model) and kernels.available()
        """Whether the small operators between the products run as the compiled ops of
        :mod:`reader_spec.engine.kernels` (``layer_ops.cpp``)."""
        self.native = self.fused and self.rotary.whole_heads(self.head_dim)
        """Whether layers of the Llama shape run whole as compiled calls (``decoder_layer.cpp``)."""
        if self.native:
            for layer in self.layers:
                layer.native = native_layer(layer)
        self.stack = native_stack(self.layers, self.norm)
        """Every layer as one compiled call (``DecoderStack``), where each has one; else None."""
        self._kernels_by_tokens: dict[int, list[int]] = {}
        # Soft-capping can map distinct logits to one float and change which is first among equals.
        exact_argmax = self.final_softcap is None and GreedyHead.applies(self.lm_head)
        self.greedy_head = GreedyHead(self.lm_head) if exact_argmax else None
        """Greedy tokens without the whole float32 output layer (:mod:`reader_spec.engine.greedy_head`)."""

    def __getstate__(self) -> dict:
        """A copy (a draft model's) builds its compiled stack over its own copied layers."""
        return {name: value for name, value in self.__dict__.items() if name != "stack"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.stack = native_stack(self.layers, self.norm)

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        masks: dict[str, torch.Tensor],
        cache: RaggedKVCache,
        widths: list[int],
        layout: PackedLayout | None,
        keep: torch.Tensor | None,
    ) -> torch.Tensor:
        """The final (normed) hidden states ``[tokens kept, hidden]`` of a packed pass (``widths[i]``
        tokens of tree ``i``); ``keep`` indexes the tokens (None: all). :meth:`logits` or
        :meth:`greedy_tokens` then runs the output layer."""
        hidden = self.embed(input_ids)
        rotary = {kind: self.rotary(hidden, positions, kind) for kind in self.kinds}
        tokens = input_ids.shape[0]
        plan = self._plan(cache, widths, masks, hidden) if self.attends_compiled(tokens) else None
        if plan is None:
            masks = additive(masks, hidden.dtype)
        if plan is not None and self.native and self.stack is not None and self._native_runs(rotary):
            normed = self._compiled_layers(hidden, rotary, cache, plan, tokens)
            return normed if keep is None else normed[keep]
        hidden, residual = self._layers(hidden, rotary, cache, plan, masks, layout, tokens)
        if keep is not None:
            hidden, residual = hidden[keep], residual[keep]
        return self._add_norm(hidden, residual, self.norm)[1]

    def _compiled_layers(
        self,
        hidden: torch.Tensor,
        rotary: dict[str, Rotation],
        cache: RaggedKVCache,
        plan: _Plan,
        tokens: int,
    ) -> torch.Tensor:
        """Every layer and the final norm in one compiled call (``hidden``, the residual stream, added
        to in place): the final hidden states of every token."""
        return self.stack.forward(
            hidden,
            [rotary[kind].cos for kind in self.kinds],
            [rotary[kind].sin for kind in self.kinds],
            [layer_cache.keys for layer_cache in cache.layers],
            [layer_cache.values for layer_cache in cache.layers],
            plan.position,
            [plan.visible[kind] for kind in self.kinds],
            plan.token_tree,
            plan.token_offset,
            plan.token_row,
            self._stack_kernels(tokens),
        )

    def _stack_kernels(self, tokens: int) -> list[int]:
        """Every layer's kernel choices at ``tokens`` rows, as the compiled stack takes them (built once
        per row count: every layer's lookups would otherwise run on every pass)."""
        kernels = self._kernels_by_tokens.get(tokens)
        if kernels is None:
            kernels = [kernel for layer in self.layers for kernel in layer.kernels_at(tokens)]
            self._kernels_by_tokens[tokens] = kernels
        return kernels

    def _layers(
        self,
        hidden: torch.Tensor,
        rotary: dict[str, Rotation],
        cache: RaggedKVCache,
        plan: _Plan | None,
        masks: dict[str, torch.Tensor],
        layout: PackedLayout | None,
        tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers op by op (the same ops as the compiled ones where ``plan`` is given): the residual
        stream (``hidden``, added to in place where the ops are compiled) and the last layer's MLP
        output, which the final norm adds."""
        residual = None  # what the previous block adds to ``hidden``, added together with the next norm
        for index, layer in enumerate(self.layers):
            layer_cache = cache.layers[index]
            hidden, normed = self._add_norm(hidden, residual, layer.input_norm)
            qkv = layer.qkv(normed)
            query_key = self._query_key(layer, qkv, tokens)
            value_start, value_size = layer.qkv.parts[2]
            value = qkv[:, value_start : value_start + value_size].view(tokens, -1, self.head_dim)
            query = self._rotate_and_store(layer_cache, query_key, value, layer.heads, rotary[layer.kind])
            if plan is not None:
                attended = torch.ops.reader_spec.attention(
                    query.contiguous(),
                    layer_cache.keys,
                    layer_cache.values,
                    plan.visible[layer.kind],
                    plan.token_tree,
                    plan.token_offset,
                    plan.token_row,
                    self.scaling,
                    layer.softcap or 0.0,
                ).view(tokens, -1)
            else:
                attended = self._attend(layer, query, *layer_cache.attended(), masks, layout)
            attended = layer.output(attended)
            if layer.attention_output_norm is not None:
                attended = layer.attention_output_norm(attended)
            hidden, normed = self._add_norm(hidden, attended, layer.mlp_input_norm)
            mlp = layer.down(self._gated(layer.activation, *layer.gate_up.split(layer.gate_up(normed))))
            residual = mlp if layer.mlp_output_norm is None else layer.mlp_output_norm(mlp)
        return hidden, residual

    def _plan(
        self, cache: RaggedKVCache, widths: list[int], masks: dict[str, torch.Tensor], hidden: torch.Tensor
    ) -> _Plan:
        """The compiled attention's view of a pass; the cache's buffers allocated if need be."""
        for layer_cache in cache.layers:
            if layer_cache.keys is None:
                empty = hidden.new_empty(0, self.kv_heads, self.head_dim)
                layer_cache.destination(empty, empty)
        _, token_row, position, _ = cache.window()
        token_tree = longs([tree for tree, width in enumerate(widths) for _ in range(width)])
        token_offset = longs([offset for width in widths for offset in range(width)])
        visible = {kind: mask[:, 0].contiguous() for kind, mask in masks.items()}
        return _Plan(token_row, position, token_tree, token_offset, visible)

    def choose_kernels(self, max_rows: int) -> None:
        """Make the kernel choices timed per row count or bucket (each matrix shape's product, the
        greedy head, the attention beyond whole layers) now, for passes of up to ``max_rows`` tokens
        (:func:`~reader_spec.engine.kernel_choice.kernel_rows`). Each is timed
        when a pass first needs it, which in a running engine would add its timing to that step
        (docs/model-drafter.md, "the bench's drafters on the target's cache"): a warm-up calls this, so
        that no timed step pays for it, nor the first method of a benchmark for those after it."""
        for rows in kernel_rows(max_rows):
            self.lm_head.kernel_at(rows)
            for layer in self.layers:
                layer.kernels_at(rows)
        largest = row_bucket(max_rows) or ROW_BUCKETS[-1]
        for rows in (b for b in ROW_BUCKETS if b <= largest):
            if self.greedy_head is not None:
                self.greedy_head.wins(rows)
            if self.fused:
                self._runs_compiled(rows)

    def attends_compiled(self, tokens: int) -> bool:
        """Whether a pass of ``tokens`` tokens runs the compiled attention, which reads the batch's
        rows itself (no :class:`PackedLayout`)."""
        return self.fused and self._runs_compiled(tokens)

    def _runs_compiled(self, tokens: int) -> bool:
        """Whether a pass of ``tokens`` tokens runs the compiled attention (and whole layers)."""
        if tokens <= NATIVE_ROWS:
            return True
        return compiled_attention_wins(self.layers[0].heads, self.kv_heads, self.head_dim, tokens)

    def _native_runs(self, rotary: dict[str, Rotation]) -> bool:
        """Whether this pass's layers can run whole: the rotary embedding turns whole heads."""
        return all(rotation.whole(self.head_dim) for rotation in rotary.values())

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The output layer: ``[rows, vocab]`` logits of final hidden states."""
        logits = self.lm_head(normed)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def greedy_tokens(self, normed: torch.Tensor, trees: Sequence[DraftTree] | None = None) -> torch.Tensor:
        """``logits(normed).argmax(-1)``, through the :class:`GreedyHead` where there is one (which,
        given the rows' ``trees``, leaves the rows greedy acceptance cannot reach ``UNNEEDED``)."""
        if self.greedy_head is not None:
            return self.greedy_head(normed, None if trees is None else tree_rows(trees))
        return self.logits(normed).argmax(-1)

    def _add_norm(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden + residual`` and its norm. Llama's RMSNorm (``weight * x / rms(x)``, one formula in
        every family that has it) runs as one compiled op that adds in place, or as PyTorch's fused
        kernel; other norms (Gemma's ``(1 + weight)``) as the model's own module."""
        epsilon = getattr(norm, "variance_epsilon", None)
        if epsilon is not None and self.fused:
            normed = torch.ops.reader_spec.add_rms_norm(hidden, residual, norm.weight, epsilon)
            return hidden, normed
        if residual is not None:
            hidden = hidden + residual
        return hidden, _norm(norm, hidden)

    def _gated(self, activation: nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``activation(gate) * up``, as one compiled op for SiLU."""
        if self.fused and isinstance(activation, (nn.SiLU, SiLUActivation)):
            return torch.ops.reader_spec.silu_mul(gate, up)
        return activation(gate) * up

    def _query_key(self, layer: PackedLayer, qkv: torch.Tensor, tokens: int) -> torch.Tensor:
        """Queries and keys as one ``[tokens, heads + kv_heads, head_dim]`` block (a view where they lie
        side by side; normed per head where the family does)."""
        (query_start, query_size), (key_start, key_size), _ = layer.qkv.parts
        if layer.query_norm is None and key_start == query_start + query_size:
            return qkv[:, query_start : key_start + key_size].view(tokens, -1, self.head_dim)
        query = qkv[:, query_start : query_start + query_size].reshape(-1, self.head_dim)
        key = qkv[:, key_start : key_start + key_size].reshape(-1, self.head_dim)
        if layer.query_norm is not None:
            query, key = self._head_norm(layer.query_norm, query), self._head_norm(layer.key_norm, key)
        return torch.cat((query.view(tokens, -1, self.head_dim), key.view(tokens, -1, self.head_dim)), dim=1)

    def _head_norm(self, norm: nn.Module, heads: torch.Tensor) -> torch.Tensor:
        """A per-head norm of ``[rows, head_dim]``: the compiled RMSNorm where the layers run compiled
        (the arithmetic of ``DecoderLayer``), else the family's."""
        return self._add_norm(heads.contiguous(), None, norm)[1]

    def _rotate_and_store(
        self,
        layer_cache: RaggedLayer,
        query_key: torch.Tensor,
        value: torch.Tensor,
        heads: int,
        rotation: Rotation,
    ) -> torch.Tensor:
        """Rotated queries ``[tokens, heads, head_dim]``, the rotated keys and the values stored in the
        cache. One compiled op where the whole head rotates, else PyTorch's ops and the cache's own
        write."""
        if self.fused and rotation.whole(self.head_dim):
            rows, positions = layer_cache.destination(query_key[:, heads:], value)
            return torch.ops.reader_spec.rotary_store(
                query_key,
                value,
                rotation.cos,
                rotation.sin,
                layer_cache.keys,
                layer_cache.values,
                rows,
                positions,
                heads,
            )
        query_key = rotation.rotate(query_key)
        layer_cache.write(query_key[:, heads:], value)
        return query_key[:, :heads]

    def _attend(
        self,
        layer: PackedLayer,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        masks: dict[str, torch.Tensor],
        layout: PackedLayout | None,
    ) -> torch.Tensor:
        """Attention through PyTorch's kernel or the family's eager code (``[tokens, heads x dim]``),
        packed into groups of rows where the pass holds several."""
        query = query[None].transpose(1, 2)
        options = {"scaling": self.scaling, "softcap": layer.softcap}
        mask = masks[layer.kind]
        if layout is None:
            attended, _ = self._attention(layer.attention, query, keys, values, mask, **options)
        else:
            attended, _ = self.attend(
                layer.attention, query, keys, values, mask, packed_layout=layout, **options
            )
        return attended.reshape(query.shape[2], -1)

    def _attention(self, module, query, key, value, mask, scaling: float, softcap: float | None, **kwargs):
        """``query`` (``[rows, heads, width, dim]``) on cache rows, grouped key/value heads read in
        place; ``mask`` is additive. Returns ``[rows, width, heads, dim]``. Soft-capped scores (Gemma 2)
        go through the family's eager attention."""
        if softcap is not None:
            return model_eager_attention(module, query, key, value, mask, scaling=scaling, softcap=softcap)
        return in_place_sdpa(query, key, value, mask, scaling), None


_ATTENTION_CHOICES: dict[tuple[int, int, int, int], bool] = {}


def compiled_attention_wins(heads: int, kv_heads: int, head_dim: int, tokens: int) -> bool:
    """Whether the compiled attention beats PyTorch's kernel on a prompt of ``tokens`` tokens, for this
    head layout (timed once per process and row bucket, when a pass first needs it; beyond the last
    bucket, PyTorch's)."""
    bucket = row_bucket(tokens)
    if bucket is None:
        return False
    key = (heads, kv_heads, head_dim, bucket)
    if key not in _ATTENTION_CHOICES:
        _ATTENTION_CHOICES[key] = _time_attention(heads, kv_heads, head_dim, bucket)
    return _ATTENTION_CHOICES[key]


def _time_attention(heads: int, kv_heads: int, head_dim: int, tokens: int) -> bool:
    """Both kernels on one causal prompt, as each path calls them (inputs from a private generator:
    the first pass of a process must not move the caller's random state). The compiled attention is
    CPU code: the inputs are made on the CPU whatever torch's default device is."""
    cpu = torch.device("cpu")
    generator = torch.Generator(cpu).manual_seed(0)
    query = torch.randn(tokens, heads, head_dim, generator=generator, device=cpu)
    keys, values = torch.randn(2, 1, kv_heads, tokens, head_dim, generator=generator, device=cpu)
    causal = torch.ones(1, tokens, tokens, dtype=torch.bool, device=cpu).tril_()
    zeros, offsets = torch.zeros(tokens, dtype=torch.long, device=cpu), torch.arange(tokens, device=cpu)
    mask = additive({"causal": causal[:, None]}, query.dtype)["causal"]
    scaling = head_dim**-0.5

    def compiled() -> None:
        torch.ops.reader_spec.attention(query, keys, values, causal, zeros, offsets, zeros, scaling, 0.0)

    def pytorch() -> None:  # as FastDecoder._attention calls it: shared key/value heads read in place
        nn.functional.scaled_dot_product_attention(
            query.transpose(0, 1)[None],
            keys,
            values,
            attn_mask=mask,
            scale=scaling,
            enable_gqa=kv_heads != heads,
        )

    with torch.inference_mode():
        compiled_time, pytorch_time = best_times([compiled, pytorch], rounds=3)
    return compiled_time <= pytorch_time


def _on_cpu(model: PreTrainedModel) -> bool:
    """Where the blocked layout and the compiled kernels run: a CPU, in float32."""
    return model.device.type == "cpu" and model.dtype == torch.float32


def _norm(norm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm (``weight * x / rms(x)``, with ``variance_epsilon``) as PyTorch's fused kernel;
    other norms (Gemma's ``(1 + weight)``) as the model's own module."""
    epsilon = getattr(norm, "variance_epsilon", None)
    if epsilon is None:
        return norm(hidden)
    return nn.functional.rms_norm(hidden, norm.weight.shape, norm.weight, epsilon)


class _TiedEmbedding(nn.Module):
    """The input embedding read from the packed output layer it is tied to (one copy of the table)."""

    def __init__(self, lm_head: PackedLinear, scale: torch.Tensor | None):
        super().__init__()
        self.lm_head = [lm_head]  # a list: not registered twice as a submodule
        self.scale = scale
        """Gemma multiplies embeddings by ``sqrt(hidden size)``, in the weights' dtype."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.lm_head[0].rows_of(tokens)
        return rows if self.scale is None else rows * self.scale.to(rows.dtype)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.lm_head[0].plain_weight()
