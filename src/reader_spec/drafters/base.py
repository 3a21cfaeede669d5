"""The interface every drafter implements, so the engine loop never changes when drafters do."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol, runtime_checkable

from reader_spec.engine.tree import Proposal


@runtime_checkable
class Drafter(Protocol):
    """Proposes continuations of each request's text.

    A request's text is its prompt plus every token emitted so far; the last token of that text is
    the root of the next draft tree. The engine calls ``begin`` once, then alternates ``propose``,
    ``observe`` and ``extend``, and calls ``end`` when the request finishes. A drafter that runs a
    model may also define ``share_cache(runner, row_of)``: the engine offers it the target's runner
    (whose KV cache holds every request's text up to its root) and each request's row there, for
    every new runner and whenever the drafter is replaced.
    """

    def begin(self, request: Hashable, prompt: Sequence[int]) -> None:
        """Start tracking a request whose text so far is ``prompt``."""

    def extend(self, request: Hashable, tokens: Sequence[int]) -> None:
        """Append tokens the target model emitted (accepted drafts plus the bonus token)."""

    def propose(self, request: Hashable, max_nodes: int) -> Proposal:
        """At most ``max_nodes`` nodes continuing the request's text, best first."""

    def observe(self, request: Hashable, proposal: Proposal, accepted: Sequence[int]) -> None:
        """Feedback after verification of ``proposal``: ``accepted`` are the kept nodes' indices, root first.

        Budgets trust the drafter's path probabilities, so drafters use this to keep them calibrated.
        """

    def end(self, request: Hashable) -> None:
        """Forget a finished request."""


def propose_all(
    drafter: Drafter,
    requests: Sequence[Hashable],
    max_nodes: int,
    verify_seconds: Sequence[float] | None = None,
) -> list[Proposal]:
    """Every request's proposal for one step.

    Drafters that draft a batch together (a draft model runs one pass per level for all sequences)
    define ``propose_batch(requests, max_nodes, verify_seconds)``, where ``verify_seconds[n]`` is
    what verifying ``n`` draft tokens over the whole batch costs this step (None: not priced), so
    that they can weigh their own passes against it; the others propose one request at a time.
    A drafter whose class sets ``prices_own_drafting = True`` decides by itself whether its drafting
    pays; the engine asks the others for proposals only while drafting has been worth its time
    (``budget.realized.DraftingGate``).
    """
    batched = getattr(drafter, "propose_batch", None)
    if batched is not None:
        return batched(requests, max_nodes, verify_seconds)
    return [drafter.propose(request, max_nodes) for request in requests]


def feed_back(
    drafter: Drafter, request: Hashable, proposal: Proposal, path: Sequence[int], emitted: Sequence[int]
) -> None:
    """Tell a drafter how verification went: the accepted tree ``path`` (tree nodes, root first, as
    ``DraftTree.walk`` returns it) of ``proposal``, then the tokens the request emitted."""
    drafter.observe(request, proposal, [node - 1 for node in path[1:]])
    drafter.extend(request, emitted)
