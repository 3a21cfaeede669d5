"""reader-spec: lossless speculative decoding with retrieval drafts and tree verification."""

from reader_spec.config import GenerationConfig
from reader_spec.drafters import (
    Drafter,
    FusedDrafter,
    ModelDrafter,
    PromptLookupDrafter,
    ReaderDrafter,
    SuffixDecodingDrafter,
    load_draft_model,
)
from reader_spec.drafters.retrieval.datastore import Datastore, DatastoreError
from reader_spec.engine.loop import Engine, Output, RequestStats
from reader_spec.engine.runner import pack_weights
from reader_spec.engine.tree import DraftTree, Proposal
from reader_spec.loading import LoadedModel, ModelLoadError, load_model

__all__ = [
    "Datastore",
    "DatastoreError",
    "DraftTree",
    "Drafter",
    "Engine",
    "FusedDrafter",
    "GenerationConfig",
    "LoadedModel",
    "ModelDrafter",
    "ModelLoadError",
    "Output",
    "PromptLookupDrafter",
    "Proposal",
    "ReaderDrafter",
    "RequestStats",
    "SuffixDecodingDrafter",
    "load_draft_model",
    "load_model",
    "pack_weights",
]
