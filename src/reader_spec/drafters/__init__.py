"""Drafters: cheap proposers of continuations for the target model to verify."""

from reader_spec.drafters.base import Drafter

__all__ = ["Drafter"]
