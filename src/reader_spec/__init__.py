"""reader-spec: lossless speculative decoding with retrieval drafts and tree verification."""

from reader_spec.config import GenerationConfig
from reader_spec.drafters import ContextDrafter, Drafter, PromptLookupDrafter, SuffixDecodingDrafter
from reader_spec.engine import Engine, Output, RequestStats
from reader_spec.loading import LoadedModel, ModelLoadError, load_model
from reader_spec.tree import DraftTree, Proposal

__all__ = [
    "ContextDrafter",
    "DraftTree",
    "Drafter",
    "Engine",
    "GenerationConfig",
    "LoadedModel",
    "ModelLoadError",
    "Output",
    "PromptLookupDrafter",
    "Proposal",
    "RequestStats",
    "SuffixDecodingDrafter",
    "load_model",
]
