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

    build: Callable[[Datastore | None, LoadedModel | None, str], Drafter]
    """Builds a fresh drafter (with nothing learned) from the run's datastore, draft model and the
    forward its draft model runs (``auto``, ``fast`` or ``transformers``, as the target's)."""
    adaptive: bool = True
    """Tree size chosen each step from measured costs; False: the proposal is verified whole, as the
    peers' authors run them."""
    budget: int | None = None
    """Most draft tokens per step where the method fixes it (prompt lookup's chain); None: the run's."""
    needs_draft_model: bool = False


def _retrieval(datastore: Datastore | None) -> ReaderDrafter:
    return ReaderDrafter(datastore=datastore)


def rasd_model_drafter(draft: LoadedModel, runner: str = "auto") -> ModelDrafter:
    """The draft model as RASD runs it (see :data:`RASD_WIDTH`)."""
    return ModelDrafter(draft, branching=RASD_WIDTH, expand=RASD_WIDTH, max_depth=RASD_DEPTH, runner=runner)


DRAFTERS: dict[str, DrafterSpec] = {
    "pld": DrafterSpec(
        lambda datastore, draft, runner: PromptLookupDrafter(), adaptive=False, budget=DEFAULT_NUM_TOKENS
    ),
    "suffix": DrafterSpec(lambda datastore, draft, runner: SuffixDecodingDrafter(), adaptive=False),
    "reader-context": DrafterSpec(lambda datastore, draft, runner: ReaderDrafter(history_tokens=0)),
    "reader": DrafterSpec(lambda datastore, draft, runner: _retrieval(datastore)),
    "model": DrafterSpec(
        lambda datastore, draft, runner: ModelDrafter(draft, runner=runner), needs_draft_model=True
    ),
    "reader-model": DrafterSpec(
        lambda datastore, draft, runner: FusedDrafter(
            _retrieval(datastore), ModelDrafter(draft, runner=runner), "reader"
        ),
        needs_draft_model=True,
    ),
    "rasd": DrafterSpec(
        lambda datastore, draft, runner: FusedDrafter(
            _retrieval(datastore), rasd_model_drafter(draft, runner), "rasd"
        ),
        needs_draft_model=True,
    ),
}
