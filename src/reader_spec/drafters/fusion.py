"""A retrieval tree and a draft model's tree as one draft, fused the ways READER and RASD describe.

Both fusions merge trees by longest-prefix matching: a path both trees hold becomes one node, whose
probability is the higher of their calibrated estimates (each is calibrated on its own, so agreement
is not taken as independent evidence), labelled with that tree's source. Nodes are then ranked by
probability, parents first, and the engine's budget cuts the list.

- ``reader`` (READER): the draft model's tree grown with every retrieval branch: those from the root,
  and those the sources hold after the draft model's likeliest path, grafted at its end (a draft
  level costs a pass; a lookup after the path, nothing). The draft model runs only in steps where
  it pays beside the retrieval tree (a long, sure match may fill the tree alone). Whether it pays is
  learned from outcomes (:class:`StepChooser`): the tokens per second of steps drafted both ways, by
  how much the retrieval tree alone expects to be accepted.
- ``rasd`` (RASD): the draft model runs every step, its tree grown level by level as deep as the
  step's costs pay for (up to the drafter's ``max_depth``); a retrieval branch is kept only when the
  draft model finds its first token plausible (among its ``rasd_top_k`` likeliest, with probability
  at least ``rasd_min_prob``), then the trees are merged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from reader_spec.drafters.model.drafter import MODEL_SOURCE, ModelDrafter
from reader_spec.drafters.reader import ReaderDrafter
from reader_spec.engine.runner import ModelRunner
from reader_spec.engine.tree import EMPTY_PROPOSAL, Proposal
from reader_spec.loading import LoadedModel

FUSIONS = ("reader", "rasd")
RASD_TOP_K = 8
RASD_MIN_PROB = 0.0


def merge_proposals(proposals: Sequence[Proposal]) -> Proposal:
    """The union of the proposals' trees by token path, ranked by the best estimate of each path.

    Each proposal's path probabilities fall along its paths, so the maxima do too and ranking by
    them (depth breaking ties) keeps every parent before its children.
    """
    paths: dict[tuple[int, ...], tuple[float, str]] = {}
    for proposal in proposals:
        sources = proposal.sources or ("",) * len(proposal)
        for path, prob, source in zip(_paths(proposal), proposal.probs, sources, strict=True):
            if path not in paths or prob > paths[path][0]:
                paths[path] = (prob, source)
    if not paths:
        return EMPTY_PROPOSAL
    ranked = sorted(paths, key=lambda path: (-paths[path][0], len(path)))
    index = {path: i for i, path in enumerate(ranked)}
    return Proposal(
        tuple(path[-1] for path in ranked),
        tuple(index[path[:-1]] if len(path) > 1 else -1 for path in ranked),
        tuple(paths[path][0] for path in ranked),
        tuple(paths[path][1] for path in ranked),
    )


def likeliest_path(proposal: Proposal) -> list[int]:
    """The nodes from the root's likeliest child down, each the likeliest child of the one before."""
    best_child: dict[int, int] = {}
    for node, parent in enumerate(proposal.parents):  # best first: a parent's first child is its best
        best_child.setdefault(parent, node)
    path: list[int] = []
    node = best_child.get(-1)
    while node is not None:
        path.append(node)
        node = best_child.get(node)
    return path


def graft(proposal: Proposal, leaf: int, branches: Proposal) -> Proposal:
    """``proposal`` with ``branches`` hung below node ``leaf``, their path probabilities continuing
    the leaf's (node order: ``proposal``'s, then ``branches``')."""
    first = len(proposal)
    leaf_prob = proposal.probs[leaf] if leaf >= 0 else 1.0
    return Proposal(
        proposal.tokens + branches.tokens,
        proposal.parents + tuple(leaf if parent < 0 else first + parent for parent in branches.parents),
        proposal.probs + tuple(leaf_prob * prob for prob in branches.probs),
        (proposal.sources or (MODEL_SOURCE,) * first) + (branches.sources or ("",) * len(branches)),
    )


def prune_branches(proposal: Proposal, keep_first: set[int]) -> Proposal:
    """``proposal`` without the branches whose first token is not in ``keep_first``."""
    kept: list[int] = []
    index: dict[int, int] = {}
    for node, (token, parent) in enumerate(zip(proposal.tokens, proposal.parents, strict=True)):
        if (parent < 0 and token in keep_first) or parent in index:
            index[node] = len(kept)
            kept.append(node)
    return Proposal(
        tuple(proposal.tokens[n] for n in kept),
        tuple(index[proposal.parents[n]] if proposal.parents[n] >= 0 else -1 for n in kept),
        tuple(proposal.probs[n] for n in kept),
        tuple(proposal.sources[n] for n in kept) if proposal.sources else (),
    )


def sub_feedback(part: Proposal, fused: Proposal, accepted: Sequence[int]) -> tuple[Proposal, list[int]]:
    """What a fused verification says about one part: its longest prefix that was verified (every
    node of it in ``fused``) and the accepted nodes among it."""
    fused_paths = _paths(fused)
    position = {path: i for i, path in enumerate(fused_paths)}
    part_paths = _paths(part)
    verified = 0
    while verified < len(part) and part_paths[verified] in position:
        verified += 1
    accepted_paths = {fused_paths[node] for node in accepted}
    hits = [i for i in range(verified) if part_paths[i] in accepted_paths]
    return part.truncated(verified), hits


def _paths(proposal: Proposal) -> list[tuple[int, ...]]:
    """Each node's tokens from the root down (nodes come after their parents)."""
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(proposal.tokens, proposal.parents, strict=True):
        paths.append((*paths[parent], token) if parent >= 0 else (token,))
    return paths


EXPECTATION_BOUNDS = (0.25, 0.5, 1.0, 2.0, 4.0)
"""Buckets of the retrieval tree's expected accepted tokens per sequence, for :class:`StepChooser`."""


@dataclass
class StepTrial:
    """One step as a trial of an arm: its bucket, whether the draft model ran, when it started, the
    requests it drafted for and the tokens they emitted."""

    bucket: int
    with_model: bool
    started: float
    requests: frozenset[Hashable]
    emitted: int = 0


@dataclass
class StepChooser:
    """Learns whether running the draft model beside retrieval pays, from the steps themselves.

    Predicting a draft model's worth from its calibrated probabilities, timed passes and the cost
    model proved too optimistic (measured: the fused drafter ran the model in steps where retrieval
    alone was faster). So each step is one trial of an arm (retrieval alone, or with the draft model)
    in the bucket of the retrieval tree's expected accepted tokens; its outcome is the tokens the step
    emitted over its wall time, from this step's drafting to the next's (a step after which the batch
    changed, where a prefill may have run, is not counted). The arm with the better rate so far is
    chosen, each arm is tried ``min_trials`` times per bucket first, and then the other arm is tried
    again after ``explore_every`` steps of a bucket, so that a change in the text is noticed. While
    the preferred arm stays the same, that interval doubles after each such try, up to
    ``max_explore_every`` (a draft model that never pays, as at large batches on a CPU, is then rarely
    run); a change of preference resets it. Old trials fade (``decay``).
    """

    min_trials: int = 3
    explore_every: int = 10
    max_explore_every: int = 160
    decay: float = 0.97
    _rates: dict[tuple[int, bool], list[float]] = field(default_factory=dict)
    """(bucket, with model) -> [tokens, seconds, trials], decayed."""
    _trials: dict[tuple[int, bool], int] = field(default_factory=dict)
    """(bucket, with model) -> trials counted, not decayed: a decayed count would fall below
    ``min_trials`` again a few steps after each try and force the losing arm every ~9 steps."""
    _since: dict[int, int] = field(default_factory=dict)
    """Steps of each bucket since its last try of the other arm."""
    _interval: dict[int, tuple[bool, int]] = field(default_factory=dict)
    """Each bucket's preferred arm when last chosen, and the steps until the other is tried."""
    _step: StepTrial | None = None

    def choose(self, expected: float) -> tuple[int, bool]:
        bucket = sum(expected > bound for bound in EXPECTATION_BOUNDS)
        tried = {arm: self._trials.get((bucket, arm), 0) for arm in (False, True)}
        if min(tried.values()) < self.min_trials:
            return bucket, tried[True] <= tried[False]
        without, with_model = (self._rates[bucket, arm] for arm in (False, True))
        better = with_model[0] / with_model[1] > without[0] / without[1]
        preferred, interval = self._interval.get(bucket, (better, self.explore_every))
        if preferred != better:
            interval = self.explore_every
        since = self._since[bucket] = self._since.get(bucket, 0) + 1
        if since < interval:
            self._interval[bucket] = (better, interval)
            return bucket, better
        self._since[bucket] = 0
        self._interval[bucket] = (better, min(2 * interval, self.max_explore_every))
        return bucket, not better

    def record(self, emitted: int) -> None:
        """Tokens a sequence of the current step emitted."""
        if self._step is not None:
            self._step.emitted += emitted

    def start(self, step: StepTrial) -> None:
        """A new step begins: the last one is counted if the batch did not change in between."""
        last, self._step = self._step, step
        if last is None or not last.emitted or last.requests != step.requests:
            return
        seconds = step.started - last.started
        for key, stats in self._rates.items():
            if key[0] == last.bucket:
                stats[:] = [value * self.decay for value in stats]
        key = (last.bucket, last.with_model)
        self._trials[key] = self._trials.get(key, 0) + 1
        stats = self._rates.setdefault(key, [0.0, 0.0, 0.0])
        stats[0] += last.emitted
        stats[1] += seconds
        stats[2] += 1


class FusedDrafter:
    """A :class:`ReaderDrafter` and a :class:`ModelDrafter` as one ``Drafter`` (``mode``: ``reader``
    or ``rasd``, see the module)."""

    prices_own_drafting = True
    """It learns each step whether the draft model's passes pay (:class:`StepChooser`)."""

    def __init__(
        self,
        retrieval: ReaderDrafter,
        model: ModelDrafter,
        mode: str = "reader",
        *,
        rasd_top_k: int = RASD_TOP_K,
        rasd_min_prob: float = RASD_MIN_PROB,
        extend_paths: bool = True,
    ) -> None:
        if mode not in FUSIONS:
            raise ValueError(f"fusion must be one of {', '.join(FUSIONS)}, got {mode!r}")
        self.retrieval = retrieval
        self.model = model
        self.mode = mode
        self.rasd_top_k = rasd_top_k
        self.rasd_min_prob = rasd_min_prob
        self.extend_paths = extend_paths and mode == "reader"
        """Whether retrieval also drafts after the draft model's likeliest path (READER's fusion; RASD
        merges at the root only)."""
        self.chooser = StepChooser()
        self._parts: dict[Hashable, tuple[Proposal, Proposal, Proposal]] = {}
        self._extensions: dict[Hashable, tuple[tuple[int, ...], Proposal]] = {}
        """Each request's last extension: the draft model's path it follows, and retrieval's tree."""

    def check_target(self, target: LoadedModel) -> None:
        self.model.check_target(target)

    def share_cache(self, runner: ModelRunner, row_of: Callable[[Hashable], int]) -> bool:
        return self.model.share_cache(runner, row_of)

    def begin(self, request: Hashable, prompt: Sequence[int]) -> None:
        self.retrieval.begin(request, prompt)
        self.model.begin(request, prompt)

    def extend(self, request: Hashable, tokens: Sequence[int]) -> None:
        self.retrieval.extend(request, tokens)
        self.model.extend(request, tokens)

    def end(self, request: Hashable) -> None:
        self._parts.pop(request, None)
        self._extensions.pop(request, None)
        self.retrieval.end(request)
        self.model.end(request)

    def propose(self, request: Hashable, max_nodes: int) -> Proposal:
        return self.propose_batch([request], max_nodes)[0]

    def propose_batch(
        self, requests: Sequence[Hashable], max_nodes: int, verify_seconds: Sequence[float] | None = None
    ) -> list[Proposal]:
        started = time.perf_counter()
        retrieved = self.retrieval.propose_batch(requests, max_nodes)
        if self.mode == "reader":
            drafted = self._reader_model(requests, retrieved, max_nodes, verify_seconds, started)
            kept = retrieved
            grown = self._extend(requests, drafted, max_nodes) if self.extend_paths else drafted
        else:  # every step, each level only where it pays for its pass
            drafted = self.model.propose_batch(requests, max_nodes, verify_seconds, first_level=True)
            kept = [self._prune(request, p) for request, p in zip(requests, retrieved, strict=True)]
            grown = drafted
        fused = []
        for request, kept_part, retrieved_part, drafted_part, grown_part in zip(
            requests, kept, retrieved, drafted, grown, strict=True
        ):
            merged = merge_proposals([grown_part, kept_part]).truncated(max_nodes)
            self._parts[request] = (merged, retrieved_part, drafted_part)  # feedback: what each proposed
            fused.append(merged)
        return fused

    def _extend(
        self, requests: Sequence[Hashable], drafted: list[Proposal], max_nodes: int
    ) -> list[Proposal]:
        """The draft model's trees with retrieval's tree after each one's likeliest path grafted at
        its end."""
        for request in requests:
            self._extensions.pop(request, None)
        paths = [likeliest_path(proposal) for proposal in drafted]
        chosen = [i for i, path in enumerate(paths) if path]
        if not chosen:
            return drafted
        tokens = [tuple(drafted[i].tokens[node] for node in paths[i]) for i in chosen]
        found = self.retrieval.propose_extensions([requests[i] for i in chosen], tokens, max_nodes)
        grown = list(drafted)
        for i, path_tokens, branches in zip(chosen, tokens, found, strict=True):
            if branches:
                self._extensions[requests[i]] = (path_tokens, branches)
                grown[i] = graft(drafted[i], paths[i][-1], branches)
        return grown

    def _reader_model(
        self,
        requests: Sequence[Hashable],
        retrieved: list[Proposal],
        max_nodes: int,
        verify_seconds: Sequence[float] | None,
        started: float,
    ) -> list[Proposal]:
        """The draft model's trees where the chooser says the model pays this step (else none)."""
        if verify_seconds is None:  # not priced: always both
            return self.model.propose_batch(requests, max_nodes, alongside=retrieved, first_level=True)
        expected = sum(sum(p.probs) for p in retrieved) / len(requests)
        bucket, with_model = self.chooser.choose(expected)
        # The optimistic price vetoes: where even it says the draft model cannot pay (a large batch
        # on a CPU, say), trying it to learn would only cost.
        with_model = with_model and self.model.may_pay(requests, verify_seconds, retrieved)
        drafted = [EMPTY_PROPOSAL] * len(requests)
        if with_model:
            drafted = self.model.propose_batch(
                requests, max_nodes, verify_seconds, alongside=retrieved, first_level=True
            )
        self.chooser.start(StepTrial(bucket, with_model, started, frozenset(requests)))
        return drafted

    def _prune(self, request: Hashable, proposal: Proposal) -> Proposal:
        distribution = self.model.root_distributions.get(request)
        if distribution is None or not proposal:
            return proposal
        probs, tokens = distribution.topk(self.rasd_top_k)
        plausible = {
            t for t, p in zip(tokens.tolist(), probs.tolist(), strict=True) if p >= self.rasd_min_prob
        }
        return prune_branches(proposal, plausible)

    def observe(self, request: Hashable, proposal: Proposal, accepted: Sequence[int]) -> None:
        """Each part learns from the nodes of its own tree that were verified."""
        parts = self._parts.pop(request, None)
        extension = self._extensions.pop(request, None)
        if parts is None or proposal != parts[0].truncated(len(proposal)):
            return
        self.chooser.record(len(accepted) + 1)
        for drafter, part in ((self.retrieval, parts[1]), (self.model, parts[2])):
            verified, hits = sub_feedback(part, proposal, accepted)
            drafter.observe(request, verified, hits)
        if extension is not None:
            self._observe_extension(request, *extension, proposal, accepted)

    def _observe_extension(
        self,
        request: Hashable,
        path: tuple[int, ...],
        branches: Proposal,
        proposal: Proposal,
        accepted: Sequence[int],
    ) -> None:
        """Retrieval learns from its branches after the draft model's path where verification
        accepted the whole path (elsewhere they were never tested)."""
        chain = Proposal(path, tuple(range(-1, len(path) - 1)), (1.0,) * len(path))
        verified, hits = sub_feedback(graft(chain, len(path) - 1, branches), proposal, accepted)
        if len(path) - 1 in hits:
            tested = branches.truncated(len(verified) - len(path))
            tested_hits = [hit - len(path) for hit in hits if hit >= len(path)]
            self.retrieval.observe_extension(request, tested, tested_hits)
