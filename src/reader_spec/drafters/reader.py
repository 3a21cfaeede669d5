"""READER's drafter: one draft tree from the request's own text, earlier responses and a corpus.

Each source finds the longest suffix of the request's text it holds and counts what followed its
occurrences; the sources' continuations are merged into one tree whose node probabilities are those
counts calibrated online per source, with match length and agreement between sources as evidence
(``retrieval/calibration.py``); the best nodes by path probability fill the budget the engine
gives. Any source can be switched off; with only the request's own text it is the short-term half of
READER (like prompt lookup, but a weighted tree).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from reader_spec.drafters.calibration import RAW_BOUNDS, verified_trials
from reader_spec.drafters.retrieval import native
from reader_spec.drafters.retrieval.calibration import (
    AGREEMENT_LEVELS,
    MATCH_BOUNDS,
    match_contexts,
    source_calibrator,
)
from reader_spec.drafters.retrieval.datastore import Datastore
from reader_spec.drafters.retrieval.history import DEFAULT_MAX_TOKENS, SEPARATOR, ResponseHistory
from reader_spec.drafters.retrieval.ngram_index import AnyNgramIndex, CompiledNgramIndex, Match, ngram_index
from reader_spec.drafters.retrieval.tries import Estimate, SourceMatch, draft_tree
from reader_spec.engine.tree import EMPTY_PROPOSAL, Proposal

REUSED_INDEXES = 4
"""Indexes of ended requests kept for the next ones: a request whose prompt begins with an ended
request's whole text (the next turn of a conversation, which re-sends it) starts from a copy of that
index and indexes only what is new: on agent traces, indexing each turn's whole context from scratch
dominated the drafter's time."""

_SOURCE_ORDER = ("context", "context-half", "history", "history-half", "datastore")
"""The sources in the order their matches join a tree (which decides ties): the compiled core's too."""


class ContinuationSource(Protocol):
    """A long-term source: earlier responses, or a corpus datastore."""

    def lookup(
        self, text: Sequence[int], max_occurrences: int, max_depth: int
    ) -> tuple[int, Sequence[tuple[Sequence[int], float]]]:
        """Length of the longest suffix of ``text`` found, and weighted continuations of its occurrences."""


@dataclass(frozen=True)
class DatastoreSource:
    """A corpus datastore as a continuation source: its longest match of up to ``max_suffix`` tokens."""

    datastore: Datastore
    max_suffix: int = 32

    def lookup(
        self, text: Sequence[int], max_occurrences: int, max_depth: int
    ) -> tuple[int, Sequence[tuple[Sequence[int], float]]]:
        return self.lookup_batch([text], max_occurrences, max_depth)[0]

    def lookup_batch(
        self, texts: Sequence[Sequence[int]], max_occurrences: int, max_depth: int
    ) -> list[tuple[int, Sequence[tuple[Sequence[int], float]]]]:
        found = self.datastore.lookup_batch(texts, self.max_suffix, max_occurrences, max_depth)
        return [(one.match_length, one.continuations) for one in found]


@dataclass(frozen=True)
class _Pending:
    """What ``observe`` needs about a request's last proposal: the estimate behind each node."""

    proposal: Proposal
    estimates: tuple[Estimate, ...]


@dataclass
class _Request:
    _index: AnyNgramIndex
    prompt_length: int
    unindexed: list[int] = field(default_factory=list)
    """Tokens emitted since the request was last drafted for: indexed when it next is (the engine's
    drafting gate skips most steps where drafts do not pay, and appending a step's tokens at a time
    cost more than all else a skipped step asks of the drafter)."""
    pending: _Pending | None = None
    extension: _Pending | None = None
    """The last :meth:`ReaderDrafter.propose_extensions` proposal, learned from apart."""

    @property
    def index(self) -> AnyNgramIndex:
        """The request's whole text, indexed."""
        if self.unindexed:
            self._index.append(self.unindexed)
            self.unindexed = []
        return self._index


class ReaderDrafter:
    """Drafts from the request's text (``context``), earlier responses (``history``) and a corpus
    (``datastore``); implements ``Drafter``.

    Every source contributes its longest match (at least ``min_match`` tokens, and at most
    ``max_ngram`` for the request's own text), and each source's calibrator turns its counts into
    probabilities.
    A long match may have occurred only once or twice, and its continuations then miss what the text
    usually does next: with ``half_matches`` the request's text and the history also contribute the
    match of half that length (``context-half``, ``history-half``, calibrated on their own), whose
    occurrences are more numerous. Up to ``max_occurrences`` newest occurrences per source give
    continuations of up to ``max_depth`` tokens. Calibration is shared by all requests, since it
    describes the model and the data rather than one request. ``history_tokens=0`` turns the history
    off; responses join it when their request ends. ``datastore`` is an opened ``Datastore`` (open it
    with the model's tokenizer fingerprint, so a mismatched one fails early) or any other source.
    """

    def __init__(
        self,
        *,
        context: bool = True,
        history_tokens: int = DEFAULT_MAX_TOKENS,
        datastore: Datastore | ContinuationSource | None = None,
        max_ngram: int = 12,
        min_match: int = 1,
        max_depth: int = 16,
        max_occurrences: int = 64,
        max_breadth: int | None = None,
        half_matches: bool = True,
    ) -> None:
        if not 1 <= min_match <= max_ngram or max_depth < 1 or max_occurrences < 1:
            raise ValueError("need 1 <= min_match <= max_ngram, max_depth >= 1 and max_occurrences >= 1")
        if max_breadth is not None and max_breadth < 1:
            raise ValueError("max_breadth must be at least 1 (1 drafts a chain)")
        if history_tokens < 0:
            raise ValueError("history_tokens must be >= 0 (0 turns the history off)")
        self.use_context = context
        self.history = ResponseHistory(history_tokens, max_ngram) if history_tokens else None
        self.datastore = DatastoreSource(datastore) if isinstance(datastore, Datastore) else datastore
        self.max_ngram = max_ngram
        self.min_match = min_match
        self.max_depth = max_depth
        self.max_occurrences = max_occurrences
        self.max_breadth = max_breadth
        self.half_matches = half_matches
        self.calibrators = {name: source_calibrator() for name in self.source_names}
        self._requests: dict[Hashable, _Request] = {}
        self._ended: deque[AnyNgramIndex] = deque(maxlen=REUSED_INDEXES)

    @property
    def settings(self) -> dict[str, object]:
        return {
            "sources": "+".join(name for name in self.source_names if not name.endswith("-half")),
            "history_tokens": self.history.max_tokens if self.history is not None else 0,
            "max_ngram": self.max_ngram,
            "min_match": self.min_match,
            "max_depth": self.max_depth,
            "max_occurrences": self.max_occurrences,
            "max_breadth": self.max_breadth,
            "half_matches": self.half_matches,
        }

    @property
    def source_names(self) -> tuple[str, ...]:
        names = ("context",) if self.use_context else ()
        names += ("history",) if self.history is not None else ()
        if self.half_matches:
            names += tuple(f"{name}-half" for name in names)
        return names + (("datastore",) if self.datastore is not None else ())

    def begin(self, request: Hashable, prompt: Sequence[int]) -> None:
        earlier = next((index for index in reversed(self._ended) if index.starts(prompt)), None)
        index = ngram_index(self.max_ngram) if earlier is None else earlier.copy()
        index.append(prompt[len(index) :])
        self._requests[request] = _Request(index, len(prompt))

    def extend(self, request: Hashable, tokens: Sequence[int]) -> None:
        self._requests[request].unindexed.extend(tokens)

    def propose(self, request: Hashable, max_nodes: int) -> Proposal:
        return self.propose_batch([request], max_nodes)[0]

    def propose_batch(
        self, requests: Sequence[Hashable], max_nodes: int, verify_seconds: Sequence[float] | None = None
    ) -> list[Proposal]:
        """Every request's proposal for one step, the datastore searched for the whole batch in one
        call (in parallel in the compiled core). Retrieval needs no pricing: ``verify_seconds`` is
        accepted for the batched-drafter interface and not used."""
        states = [self._requests[request] for request in requests]
        drafted = self._draft(states, max_nodes, [()] * len(states))
        for state, (_, pending) in zip(states, drafted, strict=True):
            state.pending, state.extension = pending, None
        return [proposal for proposal, _ in drafted]

    def propose_extensions(
        self, requests: Sequence[Hashable], paths: Sequence[Sequence[int]], max_nodes: int
    ) -> list[Proposal]:
        """Each request's proposal as if its text went on with ``paths[i]`` (a draft model's likeliest
        path): what the sources hold after it, for the path's end (READER grows a draft model's tree
        with retrieval's branches). Learned from apart (:meth:`observe_extension`), with the same
        calibration: a node is tried only where the whole path was accepted."""
        states = [self._requests[request] for request in requests]
        drafted = self._draft(states, max_nodes, paths)
        for state, (_, pending) in zip(states, drafted, strict=True):
            state.extension = pending
        return [proposal for proposal, _ in drafted]

    def _draft(
        self, states: Sequence[_Request], max_nodes: int, after: Sequence[Sequence[int]]
    ) -> list[tuple[Proposal, _Pending | None]]:
        """Each request's tree from its text followed by ``after[i]``, the datastore searched for the
        whole batch in one call; the whole batch in one call of the compiled core where it is built."""
        if max_nodes <= 0:
            return [(EMPTY_PROPOSAL, None)] * len(states)
        depth = min(self.max_depth, max_nodes)  # a node at depth d needs d nodes of budget
        stored: list = [None] * len(states)
        if self.datastore is not None:
            texts = [_text(state, extra) for state, extra in zip(states, after, strict=True)]
            stored = _lookup_all(self.datastore, texts, self.max_occurrences, depth)
        core = native.core()
        indexes = [s.index for s in states] + ([self.history.index] if self.history is not None else [])
        if core is not None and all(isinstance(index, CompiledNgramIndex) for index in indexes):
            drafted = self._draft_compiled(core, states, max_nodes, after, stored)
        else:
            drafted = []
            for state, extra, found in zip(states, after, stored, strict=True):
                matches = [
                    m
                    for m in self._source_matches(state.index, _text(state, extra), bool(extra), depth, found)
                    if m.match_length >= self.min_match
                ]
                drafted.append(draft_tree(matches, max_nodes, self.max_breadth))
        return [
            (proposal, _Pending(proposal, estimates) if proposal else None) for proposal, estimates in drafted
        ]

    def _draft_compiled(
        self,
        core,
        states: Sequence[_Request],
        max_nodes: int,
        after: Sequence[Sequence[int]],
        stored: Sequence[tuple[int, Sequence[tuple[Sequence[int], float]]] | None],
    ) -> list[tuple[Proposal, tuple[Estimate, ...]]]:
        """:meth:`_source_matches` and ``draft_tree`` for the whole batch in the compiled core: the
        same trees, the continuations read from the tables there instead of carried through Python."""
        tables = tuple(
            self.calibrators[name].table() if name in self.calibrators else None for name in _SOURCE_ORDER
        )
        settings = (
            max_nodes,
            self.max_depth,
            self.max_occurrences,
            self.min_match,
            self.max_breadth or 0,
            self.use_context,
            self.half_matches,
            SEPARATOR,
        )
        requests = [
            (state.index.table, tuple(extra), found)
            for state, extra, found in zip(states, after, stored, strict=True)
        ]
        drafted = core.draft_batch(
            requests,
            None if self.history is None else self.history.index.table,
            _SOURCE_ORDER,
            tables,
            settings,
            RAW_BOUNDS,
            AGREEMENT_LEVELS,
            MATCH_BOUNDS,
        )
        return [
            (Proposal(tokens, parents, probs, labels), estimates) if tokens else (EMPTY_PROPOSAL, ())
            for tokens, parents, probs, labels, estimates in drafted
        ]

    def _source_matches(
        self,
        index: AnyNgramIndex,
        text: Sequence[int],
        extended: bool,
        depth: int,
        stored: tuple[int, Sequence[tuple[Sequence[int], float]]] | None,
    ) -> list[SourceMatch]:
        """Each source's match for ``text``: the request's indexed text, or (``extended``) it followed
        by drafted tokens the index does not hold, matched as a query; the history; and the
        datastore's (looked up for the batch beforehand: ``stored``)."""
        matches = []
        if self.use_context:
            match = index.longest_match(text[-self.max_ngram :] if extended else None)
            matches.append(self._context_match("context", index, match, depth))
            if self.half_matches and match.length >= 2:
                length = match.length // 2
                half = index.longest_match(text[-length:]) if extended else index.suffix_match(length)
                matches.append(self._context_match("context-half", index, half, depth))
        if self.history is not None:
            length, continuations = self.history.lookup(text, self.max_occurrences, depth)
            matches.append(self._match("history", length, continuations, depth))
            if self.half_matches and length >= 2:
                half = self.history.lookup(text[len(text) - length // 2 :], self.max_occurrences, depth)
                matches.append(self._match("history-half", *half, depth))
        if stored is not None:
            matches.append(self._match("datastore", *stored, depth))
        return matches

    def _context_match(self, name: str, index: AnyNgramIndex, match: Match, depth: int) -> SourceMatch:
        continuations = index.continuations(match, self.max_occurrences, depth)
        return self._match(name, match.length, continuations, depth)

    def _match(self, name: str, length: int, continuations, depth: int) -> SourceMatch:
        table = self.calibrators[name].table()
        return SourceMatch(name, length, continuations, match_contexts(length, depth), table)

    def observe(self, request: Hashable, proposal: Proposal, accepted: Sequence[int]) -> None:
        """Learn from a verification of (a prefix of) the request's last proposal: each tested node is
        a trial for the source whose estimate labelled it (a source that agrees with another on likely
        tokens would otherwise be credited with the other's acceptances).

        ``accepted`` are the indices of the accepted proposal nodes, root first. Feedback on anything
        else (another drafter's nodes, a stale proposal) cannot be attributed to a match and is ignored.
        """
        state = self._requests[request]
        pending, state.pending = state.pending, None
        self._learn(pending, proposal, accepted)

    def observe_extension(self, request: Hashable, proposal: Proposal, accepted: Sequence[int]) -> None:
        """:meth:`observe` for the last :meth:`propose_extensions` proposal, called only where its
        path was accepted whole (its first nodes were then tested as a proposal's are)."""
        state = self._requests[request]
        pending, state.extension = state.extension, None
        self._learn(pending, proposal, accepted)

    def _learn(self, pending: _Pending | None, proposal: Proposal, accepted: Sequence[int]) -> None:
        drafted = pending.proposal if pending is not None else None
        for node, hit in verified_trials(drafted, proposal, accepted):
            context, raw = pending.estimates[node]
            self.calibrators[proposal.sources[node]].update(raw, hit, context)

    def end(self, request: Hashable) -> None:
        state = self._requests.pop(request, None)
        if state is None:
            return
        if self.history is not None:
            self.history.add(state.index.tokens[state.prompt_length :])
        if len(state.index) > 1:
            self._ended.append(state.index)


def _text(state: _Request, extra: Sequence[int]) -> Sequence[int]:
    """A request's text followed by drafted tokens (the indexed text itself where there are none)."""
    return [*state.index.tokens, *extra] if extra else state.index.tokens


def _lookup_all(
    source: ContinuationSource, texts: Sequence[Sequence[int]], max_occurrences: int, max_depth: int
) -> list[tuple[int, Sequence[tuple[Sequence[int], float]]]]:
    """A source's lookups for a batch: in one call where it has ``lookup_batch`` (a datastore)."""
    batched = getattr(source, "lookup_batch", None)
    if batched is not None:
        return batched(texts, max_occurrences, max_depth)
    return [source.lookup(text, max_occurrences, max_depth) for text in texts]
