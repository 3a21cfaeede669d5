"""A draft model's tree, grown EAGLE-2's way for a whole batch at once on the engine's runner.

Each step starts with one batched pass that feeds the draft model what every request emitted since
its last step (its cache keeps exactly the requests' text, so a step's catch-up is one or a few
tokens) and gives the distribution after the root. The tree then grows level by level: each level
expands, per sequence, the frontier nodes of highest path probability in one batched pass (a node
sees its request's text and its own ancestors among the levels cached before it), and each expanded
node gets its likeliest children. After the last level every node generated is ranked by path
probability and the best fill the proposal; the levels' cache entries are dropped (the next
catch-up writes the accepted tokens as text).

Path probabilities are products of the draft model's next-token probabilities, each mapped through
an online calibration against real acceptances (a draft model's confidence is not the target's
agreement), learned apart for a node's likeliest child and its other children: under greedy
verification the likeliest child is accepted whenever the two models' argmaxes agree, whatever its
probability, and the others almost never (docs/architecture.md, "The model drafter and its fusion
with retrieval"). Growing a level costs a draft pass: with the verification costs the engine gives,
a level runs only when its expected accepted tokens per second beat the step's without it, and a
fused drafter can skip the draft model for a step where retrieval alone already pays best.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from reader_spec.drafters.calibration import ProbabilityCalibrator, verified_trials
from reader_spec.drafters.model.loading import check_same_tokenizer
from reader_spec.drafters.model.pricing import LevelPricing, PassTimer
from reader_spec.engine.runner import ModelRunner, synchronizer, text_config
from reader_spec.engine.tree import EMPTY_PROPOSAL, Proposal
from reader_spec.loading import LoadedModel

MODEL_SOURCE = "model"
"""The source label of the draft model's nodes."""

EXPLORE_EVERY = 8
MAX_VETOES = 256
"""Most steps :meth:`ModelDrafter.may_pay` refuses in a row (it backs off from ``EXPLORE_EVERY``)."""
PROMPT_WINDOW = 256
"""Most prompt tokens the draft model reads (the last ones). Reading a prompt costs the draft model
about what it costs the target (prefill is compute-bound, int8 or not), which at batch 8 doubled
prefill (docs/model-drafter.md, "Batches"); retrieval covers copying from further back."""
CATCH_UP_LIMIT = 32
"""Most tokens one request's catch-up feeds the draft model. After a longer gap (steps a fused drafter
ran without the draft model) it re-reads only the last ones: feeding every emitted token costs the
draft model about what verifying it cost the target, which at batch 8 made trying the draft model
now and then cost more than it could return."""
PREFILL_SPREAD = 32
"""Steps a request's draft prefill is spread over when deciding to start drafting for it."""
PRIOR_TRIALS = 2.0
"""Trials a calibration bucket's prior weighs (the retrieval sources' weigh ``PRIOR_STRENGTH`` of
``drafters/retrieval/calibration.py``): the draft model's probability is a poor prior for greedy
acceptance of a likeliest child (accepted far more often than it says), and with priors of 8 trials
the buckets learned so slowly where the draft model rarely ran that it went on skipping steps it
would have won (docs/model-drafter.md, "integer products, the target's cache, calibration by
rank")."""
RUNS_BEFORE_PRICING = 3
"""Runs of the draft model before its typical tree and timed levels may say it does not pay: the
first level of a new drafter can take many times the usual, and one such estimate
(docs/model-drafter.md, "the bench's drafters on the target's cache") vetoed the draft model in a
fused drafter for good, since only running it corrects it (a median of three drops it)."""
RECENT_TREES = 16
"""Sequences' trees the typical tree is averaged over (``_worth_running``)."""
INITIAL_ROWS = 4
INITIAL_CAPACITY = 256


LIKELIEST, OTHER = 0, 1
"""Calibration contexts: a node that is its parent's likeliest child, and any other."""


def _rank_context(rank: int) -> int:
    return LIKELIEST if rank == 0 else OTHER


@dataclass
class _Tree:
    """One sequence's tree while it grows: node 0 is the root (the request's last token)."""

    tokens: list[int] = field(default_factory=lambda: [-1])
    parents: list[int] = field(default_factory=lambda: [-1])
    depths: list[int] = field(default_factory=lambda: [0])
    probs: list[float] = field(default_factory=lambda: [1.0])
    """Calibrated path probabilities."""
    raw: list[tuple[float, int]] = field(default_factory=lambda: [(1.0, LIKELIEST)])
    """The draft model's own probability of each node given its parent and whether it is the parent's
    likeliest child (what calibration buckets: :func:`_rank_context`)."""
    frontier: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    """Nodes whose keys and values sit in the cache after the text, in the order written."""

    def add_children(
        self, parent: int, probs: torch.Tensor, tokens: torch.Tensor, calibrate: ProbabilityCalibrator
    ) -> None:
        """``probs`` and ``tokens`` in decreasing probability (``topk``'s order)."""
        for rank, (q, token) in enumerate(zip(probs.tolist(), tokens.tolist(), strict=True)):
            context = _rank_context(rank)
            self.tokens.append(token)
            self.parents.append(parent)
            self.depths.append(self.depths[parent] + 1)
            self.raw.append((q, context))
            self.probs.append(self.probs[parent] * calibrate(q, context))
            self.frontier.append(len(self.tokens) - 1)

    def proposal(self, max_nodes: int) -> tuple[Proposal, tuple[tuple[float, int], ...]]:
        """The ``max_nodes`` likeliest nodes, parents first, and their raw probabilities and contexts."""
        ranked = sorted(range(1, len(self.tokens)), key=lambda n: (-self.probs[n], self.depths[n], n))
        kept = ranked[:max_nodes]
        index = {node: i for i, node in enumerate(kept)}
        proposal = Proposal(
            tuple(self.tokens[n] for n in kept),
            tuple(index[self.parents[n]] if self.parents[n] else -1 for n in kept),
            tuple(self.probs[n] for n in kept),
            (MODEL_SOURCE,) * len(kept),
        )
        return proposal, tuple(self.raw[n] for n in kept)


@dataclass
class _Request:
    row: int
    text: list[int]
    cached: int = 0
    """Tokens of ``text`` read by the draft model (``text[start:cached]`` is in its cache)."""
    start: int = 0
    """Where the draft model's view of the text begins (``prompt_window`` cuts long prompts)."""
    pending: tuple[Proposal, tuple[tuple[float, int], ...]] | None = None


class ModelDrafter:
    """Drafts with a causal LM sharing the target's tokenizer; implements ``Drafter`` and drafts a
    batch in one call (``propose_batch``).

    Per level, up to ``expand`` frontier nodes of highest path probability of each sequence get their
    ``branching`` likeliest children, for up to ``max_depth`` levels; with a cache of its own it reads
    the last ``prompt_window`` tokens of each prompt and everything after, sharing the target's
    (:meth:`share_cache`) it reads everything the target has. With verification costs
    (``propose_batch``'s ``verify_seconds``), a level expands the nodes whose pass pays most and
    levels stop when none would.

    By default a level expands one node with two children: a draft pass costs a large share of a
    target pass on a CPU, and a node other than its parent's likeliest child is rarely accepted under
    greedy verification, so wider trees (EAGLE-2's four by four) cost more than they returned
    (docs/model-drafter.md, "the bench's drafters on the target's cache").
    """

    prices_own_drafting = True
    """It decides each step whether its passes pay (``base.propose_all``), so the engine does not."""

    def __init__(
        self,
        draft: LoadedModel,
        *,
        branching: int = 2,
        expand: int = 1,
        max_depth: int = 8,
        prompt_window: int = PROMPT_WINDOW,
        runner: str = "auto",
        share_target_cache: bool = True,
    ) -> None:
        if min(branching, expand, max_depth, prompt_window) < 1:
            raise ValueError("branching, expand, max_depth and prompt_window must be at least 1")
        self.draft = draft
        self.branching = branching
        self.expand = expand
        self.max_depth = max_depth
        self.prompt_window = prompt_window
        self.runner_kind = runner
        self.share_target_cache = share_target_cache
        self.calibrate = ProbabilityCalibrator(contexts=2, prior_strength=PRIOR_TRIALS, shift_priors=True)
        self.pass_seconds = PassTimer()
        self._skipped = 0
        """Steps since the draft model last ran: every ``EXPLORE_EVERY``-th runs it regardless, so that
        estimates learned in other conditions (a warm-up, another kind of text) are refreshed."""
        self._prefill_per_token: float | None = None
        self._expanded: float | None = None
        """Nodes a level after the first expands per sequence, as recently grown (None: none grown)."""
        self._recent: deque[tuple[Proposal, tuple[tuple[float, int], ...]]] = deque(maxlen=RECENT_TREES)
        """What running the draft model recently gave, each sequence's proposal with its raw
        probabilities: priced again with the calibration as it is now (one learned from a few trees
        no longer prices the draft model's trees by what it thought of them before they were tried).
        The first pass is priced as the whole tree it leads to."""
        self._levels = 0
        """Levels the draft model's last run grew."""
        self._runs = 0
        self._vetoes, self._veto_limit = 0, EXPLORE_EVERY
        """Steps :meth:`may_pay` refused in a row, and how many it refuses before letting one through."""
        self.root_distributions: dict[Hashable, torch.Tensor] = {}
        """The draft model's next-token probabilities at each request's root, from its last step
        (RASD prunes retrieval branches with them)."""
        self._runner: ModelRunner | None = None
        self._row_of: Callable[[Hashable], int] | None = None
        """Where it shares the target's cache (:meth:`share_cache`): a request's row there."""
        self._free_rows: list[int] = []
        self._requests: dict[Hashable, _Request] = {}
        self._synchronize = synchronizer(draft.model.device)

    def check_target(self, target: LoadedModel) -> None:
        check_same_tokenizer(self.draft, target)

    # --- requests ----------------------------------------------------------------------------------
    def share_cache(self, runner: ModelRunner, row_of: Callable[[Hashable], int]) -> bool:
        """Read and write the target's KV cache (``runner``'s; ``row_of`` gives a request's row in it)
        instead of a cache of its own, where the draft model has the target's configuration (the
        self-draft: the same layers and shapes, other weights). The target's cache holds each
        request's text up to its root, so the draft model prefills nothing and catches up on nothing:
        a step writes its root and its levels past the committed length, where the target's
        verification writes next. A draft model with exactly the target's configuration is taken for a
        copy of it (``share_target_cache=False`` keeps a cache of its own anyway). Returns whether it
        shares (asked again for every new runner)."""
        own = self._ensure_runner()
        shares = (
            self.share_target_cache
            and own.decoder is not None
            and runner.decoder is not None
            and own.device == runner.device
            and own.dtype == runner.dtype
            and _architecture(self.draft.model.config) == _architecture(runner.model.config)
        )
        if shares and self._requests:
            raise RuntimeError("share_cache: requests are running on the draft model's own cache")
        self._row_of = row_of if shares else None
        if shares:
            own.cache = runner.cache
        return shares

    def begin(self, request: Hashable, prompt: Sequence[int]) -> None:
        if self._row_of is not None:  # its row is the target's, looked up when it is first drafted
            self._requests[request] = _Request(-1, list(prompt), cached=len(prompt) - 1)
            return
        runner = self._ensure_runner()
        if not self._free_rows:
            rows = runner.cache.num_rows
            runner.cache.add_rows(2 * rows)
            self._free_rows = list(range(rows, 2 * rows))
        self._requests[request] = _Request(self._free_rows.pop(0), list(prompt))

    def extend(self, request: Hashable, tokens: Sequence[int]) -> None:
        self._requests[request].text.extend(tokens)

    def end(self, request: Hashable) -> None:
        state = self._requests.pop(request, None)
        self.root_distributions.pop(request, None)
        if state is not None and self._row_of is None:
            self._free_rows.append(state.row)
            self._free_rows.sort()

    def observe(self, request: Hashable, proposal: Proposal, accepted: Sequence[int]) -> None:
        """Calibrate on every model node whose parent was accepted: it was tested, and hit if accepted."""
        state = self._requests[request]
        pending, state.pending = state.pending, None
        drafted, raw = pending if pending is not None else (None, [])
        for node, hit in verified_trials(drafted, proposal, accepted):
            if proposal.sources[node] == MODEL_SOURCE:
                q, context = raw[node]
                self.calibrate.update(q, hit, context)

    # --- drafting ----------------------------------------------------------------------------------
    def propose(self, request: Hashable, max_nodes: int) -> Proposal:
        return self.propose_batch([request], max_nodes)[0]

    def propose_batch(
        self,
        requests: Sequence[Hashable],
        max_nodes: int,
        verify_seconds: Sequence[float] | None = None,
        alongside: Sequence[Proposal] | None = None,
        first_level: bool | None = None,
    ) -> list[Proposal]:
        """Each request's tree, at most ``max_nodes`` nodes, from one pass per level for the batch.

        ``verify_seconds[n]`` prices a verification of ``n`` draft tokens over the whole batch (None:
        grow every level); ``alongside`` are other drafters' proposals for the same step (a fused
        drafter's retrieval), which the draft model must improve on to be run at all;
        ``first_level`` decides that instead (True: run), for a caller that learns it otherwise.
        """
        for request in requests:
            self._requests[request].pending = None
        if max_nodes <= 0 or not requests:
            return [EMPTY_PROPOSAL] * len(requests)
        pricing = LevelPricing(verify_seconds, len(requests), alongside)
        self._skipped += 1
        if first_level is None:
            first_level = self._skipped >= EXPLORE_EVERY or self._worth_running(requests, alongside, pricing)
        if not first_level:
            return [EMPTY_PROPOSAL] * len(requests)
        self._skipped = 0
        self._runs += 1
        if self._row_of is not None:
            for request in requests:
                state = self._requests[request]
                state.row = self._row_of(request)
                state.cached = len(state.text) - 1  # the target's cache: everything but the root
        order = sorted(range(len(requests)), key=lambda i: self._requests[requests[i]].row)
        states = [self._requests[requests[i]] for i in order]
        trees = self._first_level(states, [requests[i] for i in order], pricing)
        levels, expanded = 1, 0
        for _ in range(1, min(self.max_depth, max_nodes)):
            candidates = [(tree.probs[n], b, n) for b, tree in enumerate(trees) for n in self._frontier(tree)]
            if not candidates:
                break
            pricing.add_nodes([tree.probs[n] for tree in trees for n in tree.frontier])
            ratio = self._child_ratio(trees)
            candidates.sort(key=lambda c: -c[0])
            count = pricing.best_count([p * ratio for p, _, _ in candidates], self.pass_seconds)
            if count == 0:
                break
            chosen: list[list[int]] = [[] for _ in trees]
            for _, b, node in candidates[:count]:
                chosen[b].append(node)
            self._grow(states, trees, chosen, pricing)
            levels, expanded = levels + 1, expanded + count
        for state in states:
            if self._row_of is not None:  # the root too: the target verifies it next, in its own place
                state.cached -= 1
            self._runner.cache.lengths[state.row] = state.cached - state.start  # drop the levels' entries
        proposals: list[Proposal] = [EMPTY_PROPOSAL] * len(requests)
        for i, state, tree in zip(order, states, trees, strict=True):
            state.pending = tree.proposal(max_nodes)
            proposals[i] = state.pending[0]
        self._remember(states, levels, expanded / (levels - 1) / len(requests) if levels > 1 else None)
        return proposals

    def _remember(self, states: list[_Request], levels: int, expanded: float | None) -> None:
        """Keep what this run gave for pricing the next (``expanded``: nodes a later level expanded
        per sequence, None where there was none)."""
        self._recent.extend(state.pending for state in states if state.pending is not None)
        if expanded is not None:
            self._expanded = expanded if self._expanded is None else (self._expanded + expanded) / 2
        self._levels = levels

    def _typical_probs(self) -> list[float]:
        """Path probabilities by rank, averaged over the recent trees, from today's calibration."""
        totals: list[float] = []
        for proposal, raw in self._recent:
            path: list[float] = []
            for parent, (q, context) in zip(proposal.parents, raw, strict=True):
                path.append(self.calibrate(q, context) * (path[parent] if parent >= 0 else 1.0))
            path.sort(reverse=True)
            totals += [0.0] * (len(path) - len(totals))
            for rank, prob in enumerate(path):
                totals[rank] += prob
        return [total / len(self._recent) for total in totals]

    def may_pay(
        self,
        requests: Sequence[Hashable],
        verify_seconds: Sequence[float] | None,
        alongside: Sequence[Proposal] | None,
    ) -> bool:
        """Whether running the draft model this step could raise its rate, by the tree it typically
        grows, its timed passes and the verification costs (a fused drafter that learns from outcomes
        asks this first, to rarely even try the draft model where it cannot pay).

        Not never: the typical tree and the timed levels are only corrected by running the draft
        model, so a veto held for good would keep an early estimate for good (a first tree priced
        before any acceptance was seen vetoed nearly every later step; docs/model-drafter.md, "the
        bench's drafters on the target's cache"). After ``EXPLORE_EVERY`` vetoes in a row one step
        is let through, then after twice as many, up to ``MAX_VETOES``; a step the price lets
        through resets the count."""
        if self._worth_running(requests, alongside, LevelPricing(verify_seconds, len(requests), alongside)):
            self._vetoes, self._veto_limit = 0, EXPLORE_EVERY
            return True
        self._vetoes += 1
        if self._vetoes < self._veto_limit:
            return False
        self._vetoes, self._veto_limit = 0, min(2 * self._veto_limit, MAX_VETOES)
        return True

    def _worth_running(
        self, requests: Sequence[Hashable], alongside: Sequence[Proposal] | None, pricing: LevelPricing
    ) -> bool:
        """Whether the step's best rate is higher with the tree the draft model typically grows, cut
        at the depth that pays best, than with the other drafters' proposals alone.

        The typical tree is cut at every depth up to the levels last grown (its likeliest nodes, as
        many as that many levels give a sequence): the last run's depth is not the only one that can
        pay (a deep tree grown where every node was accepted, then skipped for many steps where a
        shallower one would have paid). Both trees mostly propose the same continuation where both
        are right, so each sequence is priced with the likelier of the two (by expected accepted
        tokens, the sum of its path probabilities), not their union. Prompts the draft model has not
        read yet add their prefill, spread over ``PREFILL_SPREAD`` steps.
        """
        if self._runs < RUNS_BEFORE_PRICING:
            return True
        probs = self._typical_probs()
        # The first pass is priced at one token per sequence: tokens left to catch up on are paid for
        # whenever the draft model runs next, so they must not argue for skipping it again.
        expanded = self._expanded or self.expand
        first = self.pass_seconds(len(requests))
        later = self.pass_seconds(max(1, round(expanded * len(requests))))
        unread = sum(
            min(len(s.text), self.prompt_window)
            for s in map(self._requests.__getitem__, requests)
            if not s.cached
        )
        if first is None or later is None or (unread and self._prefill_per_token is None):
            return True
        prefill = unread * (self._prefill_per_token or 0.0) / PREFILL_SPREAD
        for levels in range(1, max(self._levels, 1) + 1):
            cut = probs[: round(self.branching * (1 + (levels - 1) * expanded))]
            nodes: list[float] = []
            for proposal in alongside or [None] * len(requests):
                own = list(proposal.probs) if proposal is not None else []
                nodes += cut if sum(cut) > sum(own) else own
            if pricing.better(nodes, first + (levels - 1) * later + prefill):
                return True
        return False

    def _child_ratio(self, trees: list[_Tree]) -> float:
        """Calibrated probability mass a node's children carry, relative to the node (last level's)."""
        mass = parents = 0.0
        for tree in trees:
            mass += sum(tree.probs[node] for node in tree.frontier)
            parents += sum(tree.probs[parent] for parent in {tree.parents[node] for node in tree.frontier})
        return mass / parents if parents else 0.0

    def _first_level(
        self, states: list[_Request], requests: list[Hashable], pricing: LevelPricing
    ) -> list[_Tree]:
        """Catch every sequence's cache up with its text (one pass; a new request's prompt is
        prefilled first) and give the root its children."""
        runner = self._runner
        for state in states:
            if state.cached and len(state.text) - 1 - state.cached > CATCH_UP_LIMIT:
                state.start = state.cached = len(state.text) - 1 - CATCH_UP_LIMIT  # the row starts afresh
            if state.cached == 0 and len(state.text) > 1:
                state.start = max(0, len(state.text) - 1 - self.prompt_window)
                started = time.perf_counter()
                runner.prefill(state.row, state.text[state.start : -1])
                self._synchronize()
                per_token = (time.perf_counter() - started) / (len(state.text) - 1 - state.start)
                if self._prefill_per_token is None or per_token < self._prefill_per_token:
                    self._prefill_per_token = per_token
                state.cached = len(state.text) - 1
            runner.cache.lengths[state.row] = state.cached - state.start
            runner.cache.reserve(len(state.text) - state.start + self.max_depth * self.expand + 1)
        started = time.perf_counter()
        tokens = [state.text[state.cached :] for state in states]
        # Positions count from the start of the draft model's view: rotary attention depends only
        # on distances, so a prompt cut by the window reads as if it began there.
        positions = [
            torch.arange(state.cached, len(state.text), device="cpu") - state.start for state in states
        ]
        masks = [torch.ones(len(t), len(t), dtype=torch.bool, device="cpu").tril_() for t in tokens]
        logits = runner.extend([s.row for s in states], tokens, positions, masks, last_only=True)
        trees = []
        for state, request, row_logits in zip(states, requests, logits, strict=True):
            state.cached = len(state.text)
            runner.cache.lengths[state.row] = state.cached - state.start
            distribution = torch.softmax(row_logits[-1].float(), dim=-1)
            self.root_distributions[request] = distribution
            tree = _Tree()
            probs, tokens_ = distribution.topk(self.branching)
            tree.add_children(0, probs, tokens_, self.calibrate)
            trees.append(tree)
        self._timed(started, sum(map(len, tokens)), pricing)
        return trees

    def _frontier(self, tree: _Tree) -> list[int]:
        """The newest level's ``expand`` nodes of highest path probability."""
        return heapq.nlargest(self.expand, tree.frontier, key=lambda n: tree.probs[n])

    def _grow(
        self, states: list[_Request], trees: list[_Tree], chosen: list[list[int]], pricing: LevelPricing
    ) -> None:
        """One pass over the chosen nodes of every sequence; each gets its children."""
        started = time.perf_counter()
        runner = self._runner
        live = [b for b, nodes in enumerate(chosen) if nodes]
        tokens, positions, masks = [], [], []
        for b in live:
            tree, nodes, state = trees[b], chosen[b], states[b]
            written = tree.cached + nodes
            column = {node: i for i, node in enumerate(written)}
            mask = torch.zeros(len(nodes), len(written), dtype=torch.bool, device="cpu")
            for i, node in enumerate(nodes):
                ancestor = node
                while ancestor > 0:
                    mask[i, column[ancestor]] = True
                    ancestor = tree.parents[ancestor]
            tokens.append([tree.tokens[n] for n in nodes])
            positions.append(
                torch.tensor([state.cached - 1 - state.start + tree.depths[n] for n in nodes], device="cpu")
            )
            masks.append(mask)
        rows = [states[b].row for b in live]
        logits = runner.extend(rows, tokens, positions, masks)
        for b, row_logits in zip(live, logits, strict=True):
            tree, nodes = trees[b], chosen[b]
            runner.cache.lengths[states[b].row] += len(nodes)
            tree.cached += nodes
            tree.frontier = []
            probs, children = torch.softmax(row_logits.float(), dim=-1).topk(self.branching, dim=-1)
            for node, node_probs, node_children in zip(nodes, probs, children, strict=True):
                tree.add_children(node, node_probs, node_children, self.calibrate)
        for b in range(len(trees)):
            if not chosen[b]:
                trees[b].frontier = []
        self._timed(started, sum(map(len, tokens)), pricing)

    def _timed(self, started: float, tokens: int, pricing: LevelPricing) -> None:
        """A level of ``tokens`` that began at ``started`` is done: its cost is learned and spent."""
        self._synchronize()
        seconds = time.perf_counter() - started
        self.pass_seconds.record(tokens, seconds)
        pricing.spent += seconds

    def _ensure_runner(self) -> ModelRunner:
        if self._runner is None:
            self._runner = ModelRunner(self.draft.model, INITIAL_ROWS, INITIAL_CAPACITY, self.runner_kind)
            self._free_rows = list(range(INITIAL_ROWS))
        return self._runner


ARCHITECTURE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "sliding_window",
    "layer_types",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
)
"""What a model's configuration must share with the target's for its KV cache to be interchangeable
(not metadata such as ``architectures``, nor run-time settings such as the attention implementation)."""


def _architecture(config) -> tuple:
    config = text_config(config)
    return tuple(repr(getattr(config, name, None)) for name in ARCHITECTURE_FIELDS)
