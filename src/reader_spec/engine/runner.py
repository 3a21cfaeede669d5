"""Runs the target model on ragged batches of draft trees: the engine's fast decoder or transformers'.

Every pass is built the same way whichever forward runs it: the trees packed into one row of tokens
(a pass costs what its total tokens cost, however unequal the trees), explicit position ids (context
length plus depth), a boolean visibility mask per tree (each new token sees its row's committed
context and its own ancestors; one per layer type where sliding-window layers differ), the
:class:`PackedLayout` that tells the attention which tokens belong to which cache row, and the
:class:`RaggedKVCache`. The fast decoder (:mod:`reader_spec.engine.decoder`) takes these directly;
transformers' forward gets additive 4D masks and the cache as a ``Cache`` object.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import itertools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import PretrainedConfig, PreTrainedModel

from reader_spec.engine import kernels
from reader_spec.engine.attention import (
    HeadShape,
    PackedLayout,
    additive,
    attention_call_cost,
    pack,
    use_packed_attention,
    visibility,
)
from reader_spec.engine.decoder import FAST_FAMILIES, FastDecoder, supports
from reader_spec.engine.host import longs
from reader_spec.engine.kv_cache import RaggedKVCache
from reader_spec.engine.layers import layer_kinds
from reader_spec.engine.tree import DraftTree
from reader_spec.engine.weights import WEIGHT_FORMATS

PREFILL_CHUNK = 512
"""Prompt tokens per prefill forward: bounds the mask and activation memory of long prompts."""

NO_LOGITS = torch.empty(0, dtype=torch.long, device="cpu")
"""Token index that skips the output layer (prefill needs only the cache)."""

RUNNERS = ("auto", "fast", "transformers")

log = logging.getLogger(__name__)


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language model's config (a multimodal config holds it as its text config)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def max_context_of(config: PretrainedConfig) -> int | None:
    """The most positions the model was trained on (None where its config does not say)."""
    positions = getattr(text_config(config), "max_position_embeddings", None)
    return int(positions) if positions else None


def synchronizer(device: torch.device) -> Callable[[], None]:
    """A function that waits for the device's queued work, so that wall clocks time it (no-op on CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def forward_sources() -> list[Path]:
    """The Python files every pass runs: this module and the engine modules it imports, directly or
    through each other (found from their import statements, so that a new module cannot be missed)."""
    engine = Path(__file__).parent
    found: set[Path] = set()
    waiting = [Path(__file__)]
    while waiting:
        source = waiting.pop()
        if source in found:
            continue
        found.add(source)
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "reader_spec.engine":
                names = [alias.name for alias in node.names]  # `from reader_spec.engine import kernels`
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("reader_spec.engine."):
                names = [node.module.split(".")[2]]
            else:
                continue
            for name in names:
                module = engine / f"{name}.py"
                waiting.append(module if module.is_file() else engine / name / "__init__.py")
    return sorted(found)


@functools.cache
def forward_fingerprint() -> str:
    """A digest of the code every pass runs (:func:`forward_sources` and the compiled kernels): cost
    curves timed with other code are timed again."""
    digest = hashlib.sha256()
    for source in [*forward_sources(), *kernels.SOURCES, *kernels.HEADERS]:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def device_description(device: torch.device) -> str:
    """The device a model runs on, with the accelerator's name: keys measured costs and labels results."""
    if device.type == "cuda":
        return f"{device}: {torch.cuda.get_device_name(device)}"
    return str(device)


def sliding_window_of(config: PretrainedConfig) -> int | None:
    """The sliding window size if any layer of this model uses local attention (:func:`layer_kinds`)."""
    config = text_config(config)
    window = getattr(config, "sliding_window", None)
    return int(window) if window and "sliding_attention" in layer_kinds(config) else None


class ModelRunner:
    """Owns the model and its ragged KV cache; turns prompts and trees into logits.

    ``runner`` picks the forward: ``"fast"`` the engine's own decoder (:mod:`reader_spec.engine.decoder`,
    which packs the model's weights in place), ``"transformers"`` the model's own forward,
    ``"auto"`` the fast one where the architecture is supported. On the transformers path the model's
    attention is switched to its packed version (:func:`use_packed_attention`); models whose attention
    cannot run packed passes (neither ``sdpa`` nor ``eager``) verify one sequence per forward: still
    exact, but a batch then costs one pass per sequence; that is said once.
    """

    def __init__(self, model: PreTrainedModel, num_rows: int, capacity: int, runner: str = "auto"):
        self.model = model
        self.device = model.device
        self.dtype = model.dtype
        self.sliding_window = sliding_window_of(model.config)
        self.decoder = fast_decoder(model, runner)
        self.packed = self.decoder is not None or use_packed_attention(model)
        if not self.packed and num_rows > 1:
            _warn_once(model)
        num_layers = text_config(model.config).num_hidden_layers
        self.cache = RaggedKVCache(num_layers, num_rows, capacity, self.device)

    @functools.cached_property
    def attention_call_cost(self) -> int:
        """One more attention call's cost in query-key pairs, measured for this model's heads
        (:func:`attention_call_cost`)."""
        config = text_config(self.model.config)
        heads = config.num_attention_heads
        shape = HeadShape(
            heads,
            getattr(config, "num_key_value_heads", None) or heads,
            getattr(config, "head_dim", None) or config.hidden_size // heads,
        )
        return attention_call_cost(shape, self.dtype, self.device, synchronizer(self.device))

    @property
    def name(self) -> str:
        """Which forward runs: ``fast`` or ``transformers``."""
        return "fast" if self.decoder is not None else "transformers"

    @torch.inference_mode()
    def verify(
        self, trees: Sequence[DraftTree], rows: Sequence[int], argmax: Sequence[bool] | None = None
    ) -> list[torch.Tensor]:
        """One forward over one tree per cache row (``rows`` ascending, ``trees[i]`` in ``rows[i]``);
        returns each tree's logits ``[nodes, vocab]``, or where ``argmax[i]``, the model's argmax token
        at each node (``[nodes]``, long): all greedy decoding needs, and cheaper to find
        (:mod:`reader_spec.engine.greedy_head`).

        Everything is written past each row's committed length; the caller then commits the
        accepted nodes with ``cache.commit_rows``.
        """
        argmax = list(argmax) if argmax is not None else [False] * len(trees)
        if len(trees) > 1 and not self.packed:
            return [
                self._verify([tree], [row], [flag])[0]
                for tree, row, flag in zip(trees, rows, argmax, strict=True)
            ]
        return self._verify(trees, list(rows), argmax)

    def _verify(self, trees: Sequence[DraftTree], rows: list[int], argmax: list[bool]) -> list[torch.Tensor]:
        lengths = self.cache.lengths_of(rows).tolist()
        tokens = [tree.tokens for tree in trees]
        flat = [length + depth for length, tree in zip(lengths, trees, strict=True) for depth in tree.depths]
        positions = longs(flat)
        masks = [t.ancestor_mask() for t in trees]
        return self.extend(rows, tokens, positions, masks, argmax=argmax, trees=trees)

    @torch.inference_mode()
    def extend(
        self,
        rows: list[int],
        tokens: Sequence[Sequence[int]],
        positions: torch.Tensor | Sequence[torch.Tensor],
        local_masks: Sequence[torch.Tensor],
        last_only: bool = False,
        argmax: Sequence[bool] | None = None,
        trees: Sequence[DraftTree] | None = None,
    ) -> list[torch.Tensor]:
        """One packed pass of new tokens per cache row (``rows`` ascending), written past each row's
        committed length; returns each row's logits (its last token's only with ``last_only``), or
        its argmax tokens where ``argmax[i]``. Given the ``trees`` the tokens are, an argmax row's
        token below a rejected draft may be left ``UNNEEDED`` (:class:`GreedyHead`).

        ``positions``: each row's position ids, or all rows' back to back. ``local_masks[i]`` is ``[new,
        earlier + new]``: what each new token sees among the row's last ``earlier`` committed tokens and
        the new ones (:func:`visibility`); everything before is context.
        """
        widths = [len(t) for t in tokens]
        input_ids = longs([token for row_tokens in tokens for token in row_tokens])
        keep = torch.tensor(list(itertools.accumulate(widths)), device="cpu") - 1 if last_only else None
        flat_positions = positions if isinstance(positions, torch.Tensor) else torch.cat(list(positions))
        states = self._forward(rows, input_ids, flat_positions, local_masks, keep)
        kept = [1] * len(rows) if last_only else widths
        argmax = list(argmax) if argmax is not None else [False] * len(rows)
        return self._outputs(states, kept, argmax, None if last_only else trees)

    def _outputs(
        self, states: torch.Tensor, kept: list[int], argmax: list[bool], trees: Sequence[DraftTree] | None
    ) -> list[torch.Tensor]:
        """Each row's logits, or its argmax tokens where ``argmax``: ``states`` are the fast decoder's
        final hidden states (its output layer runs here, once for each kind of row) or transformers'
        logits."""
        outputs: dict[int, torch.Tensor] = {}
        parts = None
        for flag in (False, True):
            chosen = [i for i, wanted in enumerate(argmax) if wanted == flag]
            if not chosen:
                continue
            if len(chosen) == len(kept):  # rows of one kind, the usual case: no split (each op costs
                rows = states  # tens of microseconds in a pass, after its weights have swept the caches)
            else:
                parts = parts or states.split(kept)
                rows = torch.cat([parts[i] for i in chosen])
            if not flag:
                results = self.decoder.logits(rows).float() if self.decoder is not None else rows
            elif self.decoder is not None:
                chosen_trees = None if trees is None else [trees[i] for i in chosen]
                results = self.decoder.greedy_tokens(rows, chosen_trees)
            else:
                results = rows.argmax(-1)
            if flag:  # tokens go to the host, where acceptance walks them: one copy for all rows
                results = results.cpu()
            pieces = [results] if len(chosen) == 1 else results.split([kept[i] for i in chosen])
            outputs.update(zip(chosen, pieces, strict=True))
        return [outputs[i] for i in range(len(kept))]

    def allocate_cache(self) -> None:
        """Allocate the cache's buffers now rather than in the first pass that writes them (they take
        their shapes from a pass's keys and values): one token prefilled in row 0, then forgotten.
        Only a cache no pass has written is touched, so no row's entries are lost."""
        if not self.cache.allocated:
            self.prefill(0, [0])
            self.cache.lengths[0] = 0

    @torch.inference_mode()
    def prefill(
        self,
        row: int,
        tokens: Sequence[int],
        reused: int = 0,
        on_logits: Callable[[int, torch.Tensor], None] | None = None,
    ) -> None:
        """Fill a cache row with a prompt, in chunks, past its first ``reused`` tokens (which the row
        already holds: a prefix an earlier request left there). The engine prefills all but the last
        prompt token, which is the root of the first verified tree, and needs no logits, unless a
        request asks for its prompt's log-probabilities: then ``on_logits(start, logits)`` gets each
        chunk's logits, ``[chunk tokens, vocab]``, a chunk at a time."""
        if not 0 <= reused <= min(len(tokens), int(self.cache.capacity)):
            raise ValueError(f"cannot reuse {reused} tokens of a {len(tokens)}-token prefill")
        self.cache.lengths[row] = reused
        keep = None if on_logits is not None else NO_LOGITS
        for start in range(reused, len(tokens), PREFILL_CHUNK):
            chunk = torch.tensor(tokens[start : start + PREFILL_CHUNK], device="cpu")
            n = chunk.shape[0]
            causal = torch.ones(n, n, dtype=torch.bool, device="cpu").tril_()
            states = self._forward([row], chunk, start + torch.arange(n, device="cpu"), [causal], keep)
            self.cache.lengths[row] = start + n
            if on_logits is not None:
                on_logits(start, self._outputs(states, [n], [False], None)[0])

    def _forward(
        self, rows: list[int], input_ids, positions, local_masks, keep: torch.Tensor | None
    ) -> torch.Tensor:
        """Run packed tokens (``[total]``) whose cache row ``rows[i]`` owns ``len(local_masks[i])``;
        returns, for the tokens ``keep`` indexes (None: all), the fast decoder's final hidden states or
        transformers' logits (:meth:`_outputs` takes either)."""
        widths = [local.shape[0] for local in local_masks]
        lengths = torch.from_numpy(self.cache.lengths_of(rows))
        kv_length = self.cache.set_window(rows, widths)
        padded_positions = None
        if self.sliding_window is not None:  # only a window needs the tokens' positions
            columns = torch.arange(max(widths), device="cpu")
            padded_positions = lengths[:, None] + columns
            padded_positions[columns[None] < torch.tensor(widths, device="cpu")[:, None]] = positions
        masks = visibility(lengths, local_masks, kv_length, self.sliding_window, padded_positions)
        layout = None
        if len(widths) > 1 and (self.decoder is None or not self.decoder.attends_compiled(len(input_ids))):
            layout = pack(widths, lengths.tolist(), rows, self.attention_call_cost, self.device)
        device = self.device
        if self.decoder is not None:
            masks = {name: m.to(device) for name, m in masks.items()}
            keep = None if keep is None else keep.to(device)
            return self.decoder(
                input_ids.to(device), positions.to(device), masks, self.cache, widths, layout, keep
            )
        masks = {name: m.to(device) for name, m in additive(masks, self.dtype).items()}
        try:
            out = self.model(
                input_ids=input_ids[None].to(device),
                position_ids=positions[None].to(device),
                attention_mask=_for_transformers(masks, self.model.config),
                cache=self.cache,
                use_cache=True,
                logits_to_keep=0 if keep is None else keep.to(device),
                **({} if layout is None else {"packed_layout": layout}),
            )
        except RuntimeError as error:
            _check_layout_used(self.model, layout, error)
            raise
        _check_layout_used(self.model, layout)
        return out.logits[0].float()


def _for_transformers(masks: dict[str, torch.Tensor], config) -> torch.Tensor | dict[str, torch.Tensor]:
    """The mask argument a model's forward takes: a mapping per layer type where layers differ."""
    if len(masks) == 1:
        return masks["full_attention"]
    if getattr(text_config(config), "layer_types", None) is None:
        return masks["sliding_attention"]  # a window on every layer (Mistral)
    return masks


_ANNOUNCED: set[tuple[str, str]] = set()


def fast_decoder(model: PreTrainedModel, runner: str) -> FastDecoder | None:
    """The model's fast decoder (built once per model), or None for its transformers forward.

    Which forward runs is said once per model class on stderr.
    """
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    decoder = getattr(model, "_reader_fast_decoder", None)
    if decoder is None and runner != "transformers":
        if supports(model):
            decoder = FastDecoder(model)
            model._reader_fast_decoder = decoder
        elif runner == "fast":
            raise ValueError(
                f"the fast runner does not support {type(model).__name__} (model_type "
                f"{model.config.model_type!r}); it runs {', '.join(FAST_FAMILIES)}: use --runner transformers"
            )
    chosen = decoder if runner != "transformers" else None
    name = "fast" if chosen is not None else "transformers"
    if (type(model).__name__, name) not in _ANNOUNCED:
        _ANNOUNCED.add((type(model).__name__, name))
        log.info("%s runs on the %s runner", type(model).__name__, name)
    return chosen


def pack_weights(model: PreTrainedModel, weight_format: str) -> FastDecoder:
    """Stores ``model``'s matrices in the format ``weight_format`` (:data:`WEIGHT_FORMATS`) now, in place:
    every runner built on it later, the fast one and transformers' forward alike, multiplies by them.

    Outputs are then those of the model in that format; speculation is exact against its plain decoding.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}")
    if not supports(model):
        raise ValueError(
            f"{weight_format} weights are packed by the fast runner, which does not run "
            f"{type(model).__name__} (model_type {model.config.model_type!r}); "
            f"it runs {', '.join(FAST_FAMILIES)}"
        )
    decoder = getattr(model, "_reader_fast_decoder", None)
    if decoder is None or decoder.weight_format != weight_format:
        decoder = model._reader_fast_decoder = FastDecoder(model, weight_format=weight_format)
    return decoder


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
