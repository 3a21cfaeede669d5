"""The decoding loop: prefill, then draft -> verify -> accept, for a batch of requests at once.

Each step every active sequence gets a draft tree from the drafter, one forward pass verifies all
trees of the batch, each sequence accepts its own number of tokens plus the bonus token, and the
KV cache keeps exactly the accepted entries. A finished sequence frees its cache row at once and a
waiting request takes it. With no drafter (or a zero budget) this is plain autoregressive decoding:
the baseline every speedup is measured against.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch
from tqdm import tqdm

from reader_spec.budget.costs import CostModel, cost_cache_path, load_costs
from reader_spec.budget.planner import BudgetPlanner
from reader_spec.config import GenerationConfig
from reader_spec.drafters.base import Drafter, feed_back, propose_all
from reader_spec.engine.acceptance import rule_for
from reader_spec.engine.logprobs import TokenLogprob, token_logprobs
from reader_spec.engine.runner import (
    ModelRunner,
    device_description,
    forward_fingerprint,
    max_context_of,
    synchronizer,
)
from reader_spec.engine.scheduler import Admission, Request, Scheduler
from reader_spec.engine.sequence import DecodingSequence, Output, RequestStats
from reader_spec.engine.stopping import StopCriteria
from reader_spec.engine.tree import DraftTree, Proposal
from reader_spec.prompts import Prompt, PromptError, encode_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from reader_spec.loading import LoadedModel

DEFAULT_BUDGET = 16
"""Most draft tokens one sequence may verify per step (the engine's budget)."""

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Update:
    """What one step did for one request: the tokens it emitted, and its output once it finished."""

    key: int
    request_id: object
    new_tokens: list[int]
    output: Output | None = None
    new_logprobs: list[TokenLogprob] | None = None
    """The new tokens' log-probabilities, where the request asked for them."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """The prompt's, in the request's first update, where it asked for them."""


class Engine:
    """Batched speculative decoding with any drafter on a loaded model.

    Two ways to drive it: :meth:`generate` for a list of prompts, or, for a server, :meth:`add_request`
    at any time and :meth:`step` in a loop (a request joins the running batch at the next step and
    leaves it the step it finishes; :meth:`cancel` drops one at once). ``generate`` is that loop.

    With ``reuse_prefixes`` (the default) a request that begins with the text of a finished one (the
    next turn of a chat, a shared system prompt) prefills only what follows it, in the row that holds
    it (:class:`~reader_spec.engine.scheduler.Scheduler`). The reused keys and values are those the
    earlier request computed, equal to a fresh prefill's up to float rounding (passes of other widths
    may take other kernels), so an output can differ from a fresh engine's only at a near-tie; without
    it every output depends on its request alone.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        drafter: Drafter | None = None,
        *,
        budget: int = DEFAULT_BUDGET,
        adaptive_budget: bool = True,
        costs: CostModel | None = None,
        max_batch_size: int = 1,
        runner: str = "auto",
        reuse_prefixes: bool = True,
    ):
        if budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.scheduler = Scheduler(max_batch_size, reuse_prefixes)
        self._runner: ModelRunner | None = None
        self.budget = budget if drafter is not None else 0
        self.adaptive_budget = adaptive_budget
        self.planner = BudgetPlanner(self.budget, (lambda: self.costs) if adaptive_budget else None)
        self.drafter = drafter
        self.max_context = max_context_of(self.model.config)
        self._costs = costs
        self.runner_kind = runner
        self._keys = itertools.count()
        self._synchronize = synchronizer(self.model.device)

    @property
    def drafter(self) -> Drafter | None:
        return self._drafter

    @drafter.setter
    def drafter(self, drafter: Drafter | None) -> None:
        """Draft with ``drafter`` from the next request on (a benchmark starts each run with a fresh
        one); refused while requests run, whose state lives in the drafter they began with."""
        if self.scheduler.running:
            raise RuntimeError("the drafter cannot change while requests are running")
        check_target = getattr(drafter, "check_target", None)
        if check_target is not None:  # a draft model must share the target's tokenizer
            check_target(self.loaded)
        self._drafter = drafter
        self.planner.reset_gate(gated=not getattr(drafter, "prices_own_drafting", False))
        if self._runner is not None:
            self._offer_cache(self._runner)

    # --- public API ------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Prompt],
        config: GenerationConfig | Sequence[GenerationConfig] | None = None,
        *,
        batch_size: int = 1,
        ids: Sequence[object] | None = None,
        on_finish: Callable[[Output], None] | None = None,
    ) -> list[Output]:
        """Generate for every prompt; returns outputs in input order.

        A prompt is text, a list of chat messages (run through the chat template) or token ids.
        ``config`` is one setting for all requests or one per request (a greedy request and a
        sampled one may share a batch). Up to ``batch_size`` requests are decoded together; a
        finished request's cache row goes to the next waiting one. A prompt the model has no room
        for is refused before any work.
        """
        return run_to_end(
            self.generate_stepwise(prompts, config, batch_size=batch_size, ids=ids, on_finish=on_finish)
        )

    def generate_stepwise(
        self,
        prompts: Sequence[Prompt],
        config: GenerationConfig | Sequence[GenerationConfig] | None = None,
        *,
        batch_size: int = 1,
        ids: Sequence[object] | None = None,
        on_finish: Callable[[Output], None] | None = None,
    ) -> Generator[None, None, list[Output]]:
        """:meth:`generate` a piece at a time: yields after each request's prefill and each
        verification pass, and returns the outputs, so that a caller can take turns between engines
        (a benchmark times methods piece by piece, where a shared host's drift hits them alike)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(self.scheduler):
            raise RuntimeError(
                "generate needs an idle engine: requests added with add_request are unfinished"
            )
        encoded = [self.encode(p) for p in prompts]
        configs = _per_request(config, len(encoded))
        for request_config in configs:
            self.check_config(request_config)
        ids = list(range(len(encoded))) if ids is None else list(ids)
        if len(ids) != len(encoded):
            raise ValueError("ids and prompts must have the same length")
        self.scheduler.grow(batch_size)
        self.calibrate(self.scheduler.num_rows)
        position = {
            self.add_request(e, c, request_id): i
            for i, (e, c, request_id) in enumerate(zip(encoded, configs, ids, strict=True))
        }
        self._reserve_room(self._ensure_runner(), zip(encoded, configs, strict=True))
        results: dict[int, Output] = {}
        while len(self.scheduler):
            for update in (yield from self._step_in_pieces()):
                if update.output is not None:
                    results[position[update.key]] = update.output
                    if on_finish is not None:
                        on_finish(update.output)
            yield
        return [results[i] for i in range(len(results))]

    def add_request(
        self, prompt: Prompt, config: GenerationConfig | None = None, request_id: object = None
    ) -> int:
        """Queue a request; it starts at the next step with a free cache row. Returns its key.

        Raises ``PromptError`` for a prompt that cannot be decoded and ``ValueError`` for settings the
        model cannot honour (nothing is queued then).
        """
        tokens = self.encode(prompt)
        config = config or GenerationConfig()
        self.check_config(config)
        key = next(self._keys)
        self.scheduler.add(Request(key, key if request_id is None else request_id, tokens, config))
        return key

    def check_config(self, config: GenerationConfig) -> None:
        """Refuse (``ValueError``) settings this model cannot honour: a logit bias on a token outside
        its vocabulary."""
        vocab = len(self.tokenizer)
        outside = [token for token, _ in config.logit_bias if token >= vocab]
        if outside:
            raise ValueError(f"logit_bias names token {outside[0]}, outside the vocabulary (0..{vocab - 1})")

    def step(self) -> list[Update]:
        """Admit waiting requests into free rows, then one verification pass over the running batch."""
        return run_to_end(self._step_in_pieces())

    def _step_in_pieces(self) -> Generator[None, None, list[Update]]:
        """:meth:`step`, yielding after each admitted request's prefill (a step that admits a whole
        batch prefills for seconds)."""
        runner = self._ensure_runner()
        admitted = self.scheduler.admit()
        self._reserve_room(runner, ((a.request.tokens, a.request.config) for a in admitted))
        for admission in admitted:
            self.scheduler.start(self._admit(runner, admission))
            yield
        batch = self.scheduler.running
        if not batch:
            return []
        lengths = [len(seq.tokens) for seq in batch]
        self._step(runner, batch)
        updates = []
        for seq, before in zip(list(batch), lengths, strict=True):
            output = None
            if seq.finish_reason is not None:
                # The row holds the committed entries, the first tokens of the text (a stop may have
                # cut the text inside the last accepted path).
                held = min(int(runner.cache.lengths[seq.row]), len(seq.tokens))
                self.scheduler.finish(seq, seq.tokens[:held])
                output = self._retire(seq)
            new_logprobs = None
            if seq.top_logprobs is not None:
                new_logprobs = seq.logprobs[before - seq.prompt_length :]
            prompt_logprobs = seq.prompt_logprobs if before == seq.prompt_length else None
            updates.append(
                Update(seq.key, seq.request_id, seq.tokens[before:], output, new_logprobs, prompt_logprobs)
            )
        return updates

    def cancel(self, key: int) -> bool:
        """Drop a request (a client went away): a running one frees its cache row at once.

        Returns whether the request was still waiting or running.
        """
        dropped = self.scheduler.cancel(key)
        if isinstance(dropped, DecodingSequence) and self.drafter is not None:
            self.drafter.end(dropped.key)
        return dropped is not None

    def reserve(
        self, batch_size: int, prompts: Sequence[Prompt], config: GenerationConfig | None = None
    ) -> None:
        """Size the cache now for ``prompts`` decoded up to ``batch_size`` at a time with ``config``, so
        that no step pays for it: growing the cache to a batch of long requests allocates and copies
        every layer, for a second or more at batch 32 on a CPU (a server sizes it at start, a
        benchmark before timing)."""
        if len(self.scheduler):
            raise RuntimeError("the cache can only be sized while no request is unfinished")
        self.scheduler.grow(batch_size)
        config = config or GenerationConfig()
        runner = self._ensure_runner()
        self._reserve_room(runner, ((self.encode(p), config) for p in prompts))
        runner.allocate_cache()

    def forget_prefixes(self) -> None:
        """No later request reuses what earlier ones left in the cache (a benchmark's repeats start cold)."""
        self.scheduler.forget_prefixes()

    def calibrate(self, max_batch_size: int = 1, progress: bool = True) -> None:
        """Measure the verification costs the adaptive budget needs for batches up to ``max_batch_size``.

        Measured once per machine and model and cached on disk; a no-op when the curves are known or
        nothing uses them (no drafter, or a fixed budget). Said on stderr, with a bar, when it runs.
        """
        if not self._uses_costs:
            return
        costs = self.costs
        todo = costs.missing(max_batch_size)
        if not todo:
            return
        log.info(
            "measuring verification costs for batch sizes up to %d, once per machine and model "
            "(cached in %s)",
            max_batch_size,
            costs.path,
        )
        bar = tqdm(total=len(todo), desc="calibrating", unit="curve", disable=not progress, leave=False)
        with bar:
            costs.calibrate(max_batch_size, progress=lambda done, total: bar.update())

    @property
    def runner_name(self) -> str:
        """Which forward runs the model: ``fast`` (the engine's decoder) or ``transformers``."""
        return self._ensure_runner().name

    @property
    def costs(self) -> CostModel:
        """Verification cost curves, read from the cache (:meth:`calibrate` measures missing ones)."""
        if self._costs is None:
            from reader_spec.budget.probe import probe_verify

            runner = self.runner_name
            loaded = self.loaded
            device = device_description(self.model.device)
            model_key = f"{loaded.name}|{loaded.fingerprint}|{self.model.dtype}|{device}"
            path = cost_cache_path(f"{model_key}|{runner}|{forward_fingerprint()}")
            self._costs = CostModel(
                load_costs(path),
                measure=lambda batch, drafted, n: probe_verify(self.model, batch, drafted, n, runner),
                budget=self.budget,
                path=path,
            )
        return self._costs

    def warm_up(self, batch_size: int = 1, prompt_tokens: int = 0) -> None:
        """Measure costs for the batch sizes a run may use and warm kernels, outside any timing: the
        kernel choices for every step at ``batch_size`` and for prefills of up to ``prompt_tokens``."""
        self.calibrate(batch_size)
        decoder = self._ensure_runner().decoder
        if decoder is not None:
            decoder.choose_kernels(max(batch_size * (self.budget + 1), prompt_tokens))
        self.generate([[1, 2, 3, 4]], GenerationConfig(max_new_tokens=2, eos_token_ids=()))

    # --- one step: draft -> verify -> accept -----------------------------------------------------
    def _step(self, runner: ModelRunner, batch: list[DecodingSequence]) -> None:
        """One verification pass over every sequence of the batch."""
        started = time.perf_counter()
        keys = [s.key for s in batch]
        context = sum(len(s.tokens) for s in batch) / len(batch) - 1  # the root is not cached yet
        plan = self.planner.plan(
            len(batch), context, lambda seconds: propose_all(self.drafter, keys, self.budget, seconds)
        )
        trees = [DraftTree.from_proposal(s.tokens[-1], p) for s, p in zip(batch, plan.proposals, strict=True)]
        verify_started = time.perf_counter()
        draft_seconds = verify_started - started
        scores = runner.verify(trees, [s.row for s in batch], [s.rule.argmax for s in batch])
        self._synchronize()
        verify_seconds = time.perf_counter() - verify_started
        accepted = 0
        paths = []
        for seq, proposal, tree, node_scores in zip(batch, plan.proposals, trees, scores, strict=True):
            paths.append(self._accept(seq, proposal, tree, node_scores))
            accepted += len(paths[-1]) - 1
            seq.stats.draft_seconds += draft_seconds
            seq.stats.verify_seconds += verify_seconds
        runner.cache.commit_rows([s.row for s in batch], paths)
        self.planner.record(plan, accepted, verify_seconds)

    def _accept(self, seq: DecodingSequence, proposal: Proposal, tree: DraftTree, scores) -> list[int]:
        """Walk the tree with the request's acceptance rule and keep what the limits allow; returns the
        accepted path (tree nodes, root first), whose cache entries the step then commits."""
        path, bonus = seq.rule.select(tree, scores, seq.tokens)
        emitted = [tree.tokens[node] for node in path[1:]] + [bonus]
        kept, seq.finish_reason = seq.stop.clip(seq.generated, emitted)
        seq.tokens.extend(kept)
        if seq.top_logprobs is not None:  # token i was picked at node path[i]
            seq.logprobs += token_logprobs(scores, path[: len(kept)], kept, seq.top_logprobs)
        seq.stats.record_step(proposal, len(kept), [node - 1 for node in path[1 : 1 + len(kept)]])
        if self.drafter is not None:
            feed_back(self.drafter, seq.key, proposal, path, kept)
        return path

    # --- requests joining and leaving ------------------------------------------------------------
    def _admit(self, runner: ModelRunner, admission: Admission) -> DecodingSequence:
        started = time.perf_counter()
        row, request = admission.row, admission.request
        tokens, config = request.tokens, request.config
        # Prompt log-probabilities come from the prefill's logits: none of the prompt is reused.
        reused = admission.reused if config.prompt_logprobs is None else 0
        seq = DecodingSequence(
            request_id=request.request_id,
            key=request.key,
            row=row,
            tokens=list(tokens),
            prompt_length=len(tokens),
            stop=self._stop_criteria(config, len(tokens)),
            rule=rule_for(config, len(tokens)),
            stats=RequestStats(prompt_tokens=len(tokens), cached_tokens=reused),
            started=started,
            top_logprobs=config.logprobs,
        )
        on_logits = None
        if config.prompt_logprobs is not None:
            on_logits = _prompt_logprobs_collector(seq, config.prompt_logprobs)
        # The last prompt token is the first root: prefill everything before it, so every later
        # step, this first one included, verifies a tree rooted at the pending token.
        if admission.source is not None and reused:
            runner.cache.copy_row(admission.source, row, reused)
        runner.prefill(row, tokens[:-1], reused, on_logits)
        self._synchronize()
        seq.stats.prefill_seconds = time.perf_counter() - started
        if self.drafter is not None:
            self.drafter.begin(seq.key, seq.tokens)
        return seq

    def _retire(self, seq: DecodingSequence) -> Output:
        if self.drafter is not None:
            self.drafter.end(seq.key)
        seq.stats.seconds = time.perf_counter() - seq.started
        return seq.output()

    # --- set-up ----------------------------------------------------------------------------------
    @property
    def _uses_costs(self) -> bool:
        return self.budget > 0 and self.adaptive_budget

    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids, refused (``PromptError``) when the model has no room to generate."""
        tokens = encode_prompt(self.tokenizer, prompt)
        if self.max_context is not None and len(tokens) >= self.max_context:
            raise PromptError(
                f"the prompt is {len(tokens):,} tokens long and the model's context is "
                f"{self.max_context:,}: there is no room to generate"
            )
        return tokens

    def _room_for(self, tokens: list[int], config: GenerationConfig) -> int:
        """Cache positions a request may fill: its prompt, its new tokens and a step's tree."""
        return len(tokens) + self._stop_criteria(config, len(tokens)).max_new_tokens + self.budget + 2

    def _reserve_room(
        self, runner: ModelRunner, requests: Iterable[tuple[list[int], GenerationConfig]]
    ) -> None:
        """Room for all these requests in one growth of the cache, if any: growing copies every row of
        every layer."""
        rooms = [self._room_for(tokens, config) for tokens, config in requests]
        if rooms:
            runner.cache.reserve(max(rooms))

    def _stop_criteria(self, config: GenerationConfig, prompt_length: int) -> StopCriteria:
        eos = config.eos_token_ids
        if eos is None:
            eos = model_eos_ids(self.model, self.tokenizer)
        max_new_tokens = config.max_new_tokens
        if self.max_context is not None:
            max_new_tokens = min(max_new_tokens, self.max_context - prompt_length)
        return StopCriteria(max_new_tokens, frozenset(eos), config.stop_strings, self.tokenizer)

    def _ensure_runner(self) -> ModelRunner:
        """The runner, with a cache row for every sequence the scheduler may run (rows only grow while
        nothing runs, so no context is ever moved)."""
        runner, rows = self._runner, self.scheduler.num_rows
        if runner is None or (runner.cache.num_rows < rows and not self.scheduler.running):
            capacity = runner.cache.capacity if runner is not None else 64
            runner = self._runner = ModelRunner(self.model, rows, capacity, self.runner_kind)
            self.scheduler.forget_prefixes()
            self._offer_cache(runner)
        return runner

    def _offer_cache(self, runner: ModelRunner) -> None:
        """Let a draft model with the target's shapes read and write the target's KV cache (asked
        again for every new runner and every new drafter)."""
        share_cache = getattr(self.drafter, "share_cache", None)
        if share_cache is not None:
            share_cache(runner, self._row_of)

    def _row_of(self, key: int) -> int:
        """The cache row of a running request (a drafter sharing the cache asks once per request)."""
        return next(seq.row for seq in self.scheduler.running if seq.key == key)


def run_to_end(stepwise: Generator[None, None, T]) -> T:
    """Every step of a stepwise run at once; returns what the run returns."""
    while True:
        try:
            next(stepwise)
        except StopIteration as done:
            return done.value


def _per_request(
    config: GenerationConfig | Sequence[GenerationConfig] | None, count: int
) -> list[GenerationConfig]:
    if config is None or isinstance(config, GenerationConfig):
        return [config or GenerationConfig()] * count
    configs = list(config)
    if len(configs) != count:
        raise ValueError(f"got {len(configs)} generation configs for {count} prompts")
    if not all(isinstance(c, GenerationConfig) for c in configs):
        raise TypeError("config must be a GenerationConfig or a sequence of them")
    return configs


def _prompt_logprobs_collector(seq: DecodingSequence, top: int) -> Callable[[int, torch.Tensor], None]:
    """A prefill's callback that fills ``seq.prompt_logprobs`` chunk by chunk: the logits at prompt
    position i predict token i + 1."""
    prompt = seq.tokens[: seq.prompt_length]
    seq.prompt_logprobs = [None]

    def collect(start: int, logits: torch.Tensor) -> None:
        following = prompt[start + 1 : start + 1 + len(logits)]
        seq.prompt_logprobs += token_logprobs(logits, range(len(following)), following, top)

    return collect


def model_eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The end-of-sequence ids the engine stops at by default, for other decoders to stop alike."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, Iterable) else (int(eos),)
