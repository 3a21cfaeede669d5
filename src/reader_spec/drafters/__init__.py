"""Drafters: cheap proposers of continuations for the target model to verify."""

from reader_spec.drafters.base import Drafter, feed_back, propose_all
from reader_spec.drafters.fusion import FusedDrafter
from reader_spec.drafters.model import ModelDrafter, load_draft_model
from reader_spec.drafters.pld import PromptLookupDrafter
from reader_spec.drafters.reader import ReaderDrafter
from reader_spec.drafters.registry import DRAFTERS, DrafterSpec
from reader_spec.drafters.retrieval.history import ResponseHistory
from reader_spec.drafters.suffix import SuffixDecodingDrafter

__all__ = [
    "DRAFTERS",
    "Drafter",
    "DrafterSpec",
    "FusedDrafter",
    "ModelDrafter",
    "PromptLookupDrafter",
    "ReaderDrafter",
    "ResponseHistory",
    "SuffixDecodingDrafter",
    "feed_back",
    "load_draft_model",
    "propose_all",
]
