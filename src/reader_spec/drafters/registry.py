"""Every named drafter, built the same way wherever a name is given (``reader bench``, replay)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from reader_spec.drafters.base import Drafter
from reader_spec.drafters.fusion import FusedDrafter
from reader_spec.drafters.model import ModelDrafter
from reader_spec.drafters.pld import DEFAULT_NUM_TOKENS, PromptLookupDrafter
from reader_spec.drafters.reader import ReaderDrafter
from reader_spec.drafters.suffix import SuffixDecodingDrafter

if TYPE_CHECKING:
    from reader_spec.drafters.retrieval.datastore import Datastore
    from reader_spec.loading import LoadedModel

RASD_DEPTH = 6
RASD_WIDTH = 4
"""RASD drafts with EAGLE-2's dynamic tree at its published depth, every step: each level expands up
to ``RASD_WIDTH`` frontier nodes with as many children each (the model drafter's own default is
narrower, for this engine's costs)."""


@dataclass(frozen=True)
class DrafterSpec:
    """How a named drafter is built, and how the engine sizes its trees."""

    build: Callable[[Datastore | None, LoadedModel | None], Drafter]
    """Builds a fresh drafter (with nothing learned) from the run's datastore and draft model."""
    adaptive: bool = True
    """Tree size chosen each step from measured costs; False: the proposal is verified whole, as the
    peers' authors run them."""
    budget: int | None = None
    """Most draft tokens per step where the method fixes it (prompt lookup's chain); None: the run's."""
    needs_draft_model: bool = False


def _retrieval(datastore: Datastore | None) -> ReaderDrafter:
    return ReaderDrafter(datastore=datastore)


DRAFTERS: dict[str, DrafterSpec] = {
    "pld": DrafterSpec(
        lambda datastore, draft: PromptLookupDrafter(), adaptive=False, budget=DEFAULT_NUM_TOKENS
    ),
    "suffix": DrafterSpec(lambda datastore, draft: SuffixDecodingDrafter(), adaptive=False),
    "reader-context": DrafterSpec(lambda datastore, draft: ReaderDrafter(history_tokens=0)),
    "reader": DrafterSpec(lambda datastore, draft: _retrieval(datastore)),
    "model": DrafterSpec(lambda datastore, draft: ModelDrafter(draft), needs_draft_model=True),
    "reader-model": DrafterSpec(
        lambda datastore, draft: FusedDrafter(_retrieval(datastore), ModelDrafter(draft), "reader"),
        needs_draft_model=True,
    ),
    "rasd": DrafterSpec(
        lambda datastore, draft: FusedDrafter(
            _retrieval(datastore),
            ModelDrafter(draft, branching=RASD_WIDTH, expand=RASD_WIDTH, max_depth=RASD_DEPTH),
            "rasd",
        ),
        needs_draft_model=True,
    ),
}
