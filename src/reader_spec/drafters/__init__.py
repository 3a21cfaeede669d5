"""Drafters: cheap proposers of continuations for the target model to verify."""

from reader_spec.drafters.base import Drafter
from reader_spec.drafters.history import ResponseHistory
from reader_spec.drafters.pld import PromptLookupDrafter
from reader_spec.drafters.reader import ReaderDrafter
from reader_spec.drafters.suffix import SuffixDecodingDrafter

__all__ = ["Drafter", "PromptLookupDrafter", "ReaderDrafter", "ResponseHistory", "SuffixDecodingDrafter"]
