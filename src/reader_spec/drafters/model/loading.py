"""Which draft model drafts: a compressed copy of the target (``self``) or any model with its tokenizer."""

from __future__ import annotations

import copy
from dataclasses import replace

from reader_spec.engine.decoder import supports
from reader_spec.engine.runner import pack_weights
from reader_spec.loading import LoadedModel, ModelLoadError, load_model

SELF = "self"
SELF_WEIGHTS = "int4"
"""The self-draft's weight format: GGUF's per-group formats (:data:`~reader_spec.engine.weights.
WEIGHT_FORMATS`), 4 bits where they store a matrix as closely as 8 bits, 8 bits elsewhere. The default
model, a Q4_1 file with a Q8_0 output layer, gets its own weights back exactly: the draft differs from
the float32 target only by rounding each input row to int16, and made float32's greedy choice at
every position measured, where int8 per output row did not; on weights trained in float, symmetric
4 bits and the target's first layers agree far less often (``docs/model-drafter.md``, "Which
self-draft")."""


def load_draft_model(spec: str, target: LoadedModel) -> LoadedModel:
    """``self``: the target's weights in 4 or 8 bits (:data:`SELF_WEIGHTS`), a copy (the target is left
    as it is); otherwise a hub id, directory or GGUF file as for the target. Either must share the
    target's tokenizer: another one is refused with a one-line :class:`ModelLoadError`."""
    if spec == SELF:
        return self_draft(target)
    draft = load_model(spec, dtype=target.model.dtype, device=target.model.device)
    check_same_tokenizer(draft, target)
    return draft


def check_same_tokenizer(draft: LoadedModel, target: LoadedModel) -> None:
    """Refuse a draft model whose tokenizer is not the target's: its drafts would mean other text."""
    if draft.fingerprint != target.fingerprint:
        raise ModelLoadError(
            f"the draft model {draft.name} has another tokenizer than the target {target.name}: "
            "a draft model must share the target's tokenizer"
        )


def self_draft(target: LoadedModel, weight_format: str = SELF_WEIGHTS) -> LoadedModel:
    """A copy of the target whose matrices are stored in ``weight_format`` (the fast runner's packing)."""
    if not supports(target.model):
        raise ModelLoadError(
            f"--draft-model self needs the fast runner, which does not run {type(target.model).__name__}; "
            "give a draft model instead (a smaller model with the same tokenizer)"
        )
    packed = getattr(target.model, "_reader_fast_decoder", None)
    if packed is not None and packed.weight_format != "float32":  # the copy could only be as slow again
        raise ModelLoadError(
            "--draft-model self is a compressed copy of the target, and the target runs in "
            f"{packed.weight_format} already: give a smaller draft model with the same tokenizer"
        )
    model = copy.deepcopy(target.model)
    pack_weights(model, weight_format)
    return replace(target, model=model, name=f"{target.name} ({weight_format} self-draft)")
