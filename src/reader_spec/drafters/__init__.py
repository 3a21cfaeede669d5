"""Drafters: cheap proposers of continuations for the target model to verify."""

from reader_spec.drafters.base import Drafter
from reader_spec.drafters.context import ContextDrafter
from reader_spec.drafters.pld import PromptLookupDrafter
from reader_spec.drafters.suffix import SuffixDecodingDrafter

__all__ = ["ContextDrafter", "Drafter", "PromptLookupDrafter", "SuffixDecodingDrafter"]
