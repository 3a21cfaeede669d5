"""Runs the target model's own forward on ragged batches of draft trees.

The model is called unchanged, with four things built here: the trees packed into one row of
tokens (a pass costs what its total tokens cost, however unequal the trees), explicit position ids
(context length plus depth), a 4D additive attention mask per tree (each new token sees its row's
committed context and its own ancestors) with the :class:`PackedLayout` that tells the attention
which tokens belong to which cache row, and the :class:`RaggedKVCache`. Models with sliding-window
layers (Gemma 2/3, Mistral-style configs) get one mask per layer type, which their forward accepts
as a mapping.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from reader_spec.engine.attention import PackedLayout, pack, use_packed_attention
from reader_spec.engine.kv_cache import RaggedKVCache
from reader_spec.engine.tree import DraftTree

PREFILL_CHUNK = 512
"""Prompt tokens per prefill forward: bounds the mask and activation memory of long prompts."""

NO_LOGITS = torch.empty(0, dtype=torch.long)
"""``logits_to_keep`` that skips the output layer (prefill needs only the cache)."""

log = logging.getLogger(__name__)


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def max_context_of(config) -> int | None:
    """The most positions the model was trained on (None where its config does not say)."""
    positions = getattr(text_config(config), "max_position_embeddings", None)
    return int(positions) if positions else None


def synchronizer(device: torch.device) -> Callable[[], None]:
    """A function that waits for the device's queued work, so that wall clocks time it (no-op on CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def sliding_window_of(config) -> int | None:
    """The sliding window size if any layer of this model uses local attention."""
    config = text_config(config)
    layer_types = getattr(config, "layer_types", None) or ()
    window = getattr(config, "sliding_window", None)
    if window and "sliding_attention" in layer_types:
        return int(window)
    return None


def attention_mask(
    lengths: torch.Tensor,
    local_masks: Sequence[torch.Tensor],
    positions: torch.Tensor,
    kv_length: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """Additive mask ``(batch, 1, width, kv_length)`` for new tokens written after each row's context.

    ``local_masks[b][i, j]`` says whether new token i of row b sees new token j; ``positions`` are
    the new tokens' position ids. Rows past a tree's own tokens are padding: an attention group that
    pads its trees to the widest computes them and discards the result.
    """
    batch, width = positions.shape
    allowed = torch.zeros(batch, width, kv_length, dtype=torch.bool)
    key_positions = torch.arange(kv_length).repeat(batch, 1)
    for b, local in enumerate(local_masks):
        start, n = int(lengths[b]), local.shape[0]
        allowed[b, :n, :start] = True
        allowed[b, :n, start : start + n] = local
        allowed[b, n:, 0] = True  # padding rows (discarded) see one key, so that no row is all -inf
        key_positions[b, start : start + n] = positions[b, :n]
    masks = {"full_attention": allowed}
    if sliding_window is not None:
        distance = positions[:, :, None] - key_positions[:, None, :]
        masks["sliding_attention"] = allowed & (distance < sliding_window)
    additive = {
        name: torch.zeros(m.shape, dtype=dtype).masked_fill_(~m, torch.finfo(dtype).min)[:, None]
        for name, m in masks.items()
    }
    return additive if sliding_window is not None else additive["full_attention"]


class ModelRunner:
    """Owns the model and its ragged KV cache; turns prompts and trees into logits.

    The runner switches the model's attention to its packed version (:func:`use_packed_attention`).
    Models whose attention cannot run packed passes (neither ``sdpa`` nor ``eager``) verify one
    sequence per forward: still exact, but a batch then costs one pass per sequence; that is said once.
    """

    def __init__(self, model: PreTrainedModel, num_rows: int, capacity: int):
        self.model = model
        self.device = model.device
        self.dtype = model.dtype
        self.sliding_window = sliding_window_of(model.config)
        self.packed = use_packed_attention(model)
        if not self.packed and num_rows > 1:
            _warn_once(model)
        num_layers = text_config(model.config).num_hidden_layers
        self.cache = RaggedKVCache(num_layers, num_rows, capacity, self.device)

    @torch.inference_mode()
    def verify(self, trees: Sequence[DraftTree], rows: Sequence[int]) -> list[torch.Tensor]:
        """One forward over one tree per cache row (``rows`` ascending, ``trees[i]`` in ``rows[i]``);
        returns each tree's logits.

        Everything is written past each row's committed length; the caller then commits the
        accepted nodes with ``cache.commit``.
        """
        if len(trees) > 1 and not self.packed:
            return [self._verify([tree], [row])[0] for tree, row in zip(trees, rows, strict=True)]
        return self._verify(trees, list(rows))

    def _verify(self, trees: Sequence[DraftTree], rows: list[int]) -> list[torch.Tensor]:
        lengths = self.cache.lengths[rows]
        input_ids = torch.tensor([[token for tree in trees for token in tree.tokens]])
        positions = torch.cat([lengths[b] + torch.tensor(tree.depths) for b, tree in enumerate(trees)])[None]
        logits = self._forward(rows, input_ids, positions, [t.ancestor_mask() for t in trees], keep=0)
        return list(logits[0].split([len(tree) for tree in trees]))

    @torch.inference_mode()
    def prefill(self, row: int, tokens: Sequence[int]) -> None:
        """Fill a cache row with a prompt, in chunks. No logits: the engine prefills all but the last
        prompt token, which is the root of the first verified tree."""
        self.cache.reset_row(row)
        for start in range(0, len(tokens), PREFILL_CHUNK):
            chunk = torch.tensor(tokens[start : start + PREFILL_CHUNK])[None]
            n = chunk.shape[1]
            causal = torch.ones(n, n, dtype=torch.bool).tril_()
            positions = start + torch.arange(n)[None]
            self._forward([row], chunk, positions, [causal], keep=NO_LOGITS)
            self.cache.lengths[row] = start + n

    def _forward(
        self, rows: list[int], input_ids, positions, local_masks, keep: int | torch.Tensor
    ) -> torch.Tensor:
        """Run packed tokens (``[1, total]``) whose cache row ``rows[i]`` owns ``len(local_masks[i])``.

        ``keep`` is transformers' ``logits_to_keep``: 0 for every token's logits, an empty index for none.
        """
        widths = [local.shape[0] for local in local_masks]
        lengths = self.cache.lengths[rows]
        kv_length = self.cache.set_window(rows, widths)
        padded_positions = lengths[:, None] + torch.arange(max(widths))
        for b, chunk in enumerate(positions[0].split(widths)):
            padded_positions[b, : len(chunk)] = chunk
        mask = attention_mask(
            lengths, local_masks, padded_positions, kv_length, self.dtype, self.sliding_window
        )
        if isinstance(mask, dict):
            mask = {name: m.to(self.device) for name, m in mask.items()}
        else:
            mask = mask.to(self.device)
        layout = pack(widths, lengths.tolist(), rows) if len(widths) > 1 else None
        extra = {} if layout is None else {"packed_layout": layout}
        try:
            out = self.model(
                input_ids=input_ids.to(self.device),
                position_ids=positions.to(self.device),
                attention_mask=mask,
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=keep.to(self.device) if isinstance(keep, torch.Tensor) else keep,
                **extra,
            )
        except RuntimeError as error:
            _check_layout_used(self.model, layout, error)
            raise
        _check_layout_used(self.model, layout)
        return out.logits.float()


_WARNED: set[str] = set()


def _warn_once(model: PreTrainedModel) -> None:
    name = type(model).__name__
    if name not in _WARNED:
        _WARNED.add(name)
        log.warning(
            "%s uses %r attention, which cannot verify several sequences in one pass: "
            "each sequence of a batch gets its own forward",
            name,
            model.config._attn_implementation,
        )


def _check_layout_used(
    model: PreTrainedModel, layout: PackedLayout | None, error: Exception | None = None
) -> None:
    """A model whose attention bypasses transformers' interface cannot run packed passes: say so."""
    if layout is not None and layout.calls == 0:
        raise RuntimeError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface, "
            "so it cannot verify several sequences in one pass; use batch size 1"
        ) from error
