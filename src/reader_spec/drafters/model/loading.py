"""Which draft model drafts: a compressed copy of the target (``self``) or any model with its tokenizer."""

from __future__ import annotations

import copy
from dataclasses import replace

from reader_spec.engine.decoder import supports
from reader_spec.engine.runner import pack_weights
from reader_spec.loading import LoadedModel, ModelLoadError, load_model

SELF = "self"
SELF_WEIGHTS = "int4"
"""The self-draft's weight format. Measured on the default model (``docs/model-drafter.md``): int8
weights per output channel make float32's greedy choice 96.6% of the time at a quarter of the bytes;
4-bit weights (70%) and the target's first layers with its output head (5-32%) draft far worse."""


def load_draft_model(spec: str, target: LoadedModel) -> LoadedModel:
    """``self``: the target's weights in int8, a copy (the target is left as it is); otherwise a hub
    id, directory or GGUF file as for the target. Either must share the target's tokenizer:
    another one is refused with a one-line :class:`ModelLoadError`."""
    if spec == SELF:
        return self_draft(target)
    draft = load_model(spec, dtype=target.model.dtype, device=target.model.device)
    if draft.fingerprint != target.fingerprint:
        raise ModelLoadError(
            f"the draft model {draft.name} has another tokenizer than the target {target.name}: "
            "a draft model must share the target's tokenizer"
        )
    return draft


def self_draft(target: LoadedModel, weights: str = SELF_WEIGHTS) -> LoadedModel:
    """A copy of the target whose matrices are stored in ``weights`` (the fast runner's packing)."""
    if not supports(target.model):
        raise ModelLoadError(
            f"--draft-model self needs the fast runner, which does not run {type(target.model).__name__}; "
            "give a draft model instead (a smaller model with the same tokenizer)"
        )
    packed = getattr(target.model, "_reader_fast_decoder", None)
    if packed is not None and packed.weights == weights:
        raise ModelLoadError(
            f"--draft-model self is the target's weights in {weights}, and the target runs in {weights} "
            "already: give a smaller draft model with the same tokenizer"
        )
    model = copy.deepcopy(target.model)
    pack_weights(model, weights)
    return replace(target, model=model, name=f"{target.name} ({weights} self-draft)")
