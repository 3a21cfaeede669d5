"""Drafters: cheap proposers of continuations for the target model to verify."""

from reader_spec.drafters.base import Drafter
from reader_spec.drafters.context import ContextDrafter

__all__ = ["ContextDrafter", "Drafter"]
