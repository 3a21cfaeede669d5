"""Every named drafter, built the same way wherever a name is given (``reader bench``, replay)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from reader_spec.drafters.base import Drafter
from reader_spec.drafters.pld import DEFAULT_NUM_TOKENS, PromptLookupDrafter
from reader_spec.drafters.reader import ReaderDrafter
from reader_spec.drafters.suffix import SuffixDecodingDrafter

if TYPE_CHECKING:
    from reader_spec.drafters.retrieval.datastore import Datastore


@dataclass(frozen=True)
class DrafterSpec:
    """How a named drafter is built, and how the engine sizes its trees."""

    build: Callable[[Datastore | None], Drafter]
    """Builds a fresh drafter (with nothing learned); drafters that read a corpus get the datastore."""
    adaptive: bool = True
    """Tree size chosen each step from measured costs; False: the proposal is verified whole, as the
    peers' authors run them."""
    budget: int | None = None
    """Most draft tokens per step where the method fixes it (prompt lookup's chain); None: the run's."""


DRAFTERS: dict[str, DrafterSpec] = {
    "pld": DrafterSpec(lambda datastore: PromptLookupDrafter(), adaptive=False, budget=DEFAULT_NUM_TOKENS),
    "suffix": DrafterSpec(lambda datastore: SuffixDecodingDrafter(), adaptive=False),
    "reader-context": DrafterSpec(lambda datastore: ReaderDrafter(history_tokens=0)),
    "reader": DrafterSpec(lambda datastore: ReaderDrafter(datastore=datastore)),
}
