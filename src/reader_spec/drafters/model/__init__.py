"""Drafting with a model: a small causal LM sharing the target's tokenizer, or a compressed copy
of the target."""

from reader_spec.drafters.model.drafter import MODEL_SOURCE, ModelDrafter
from reader_spec.drafters.model.loading import SELF, load_draft_model, self_draft

__all__ = ["MODEL_SOURCE", "SELF", "ModelDrafter", "load_draft_model", "self_draft"]
