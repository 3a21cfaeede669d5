"""The decoding loop: prefill, then draft -> verify -> accept, for a batch of requests at once.

Each step every active sequence gets a draft tree from the drafter, one forward pass verifies all
trees of the batch, each sequence accepts its own number of tokens plus the bonus token, and the
KV cache keeps exactly the accepted entries. Finished sequences leave the batch at once and waiting
requests take their slots. With no drafter (or a zero budget) this is plain autoregressive decoding:
the baseline every speedup is measured against.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from reader_spec.acceptance import AcceptanceRule, rule_for
from reader_spec.budget import (
    CostModel,
    allocate,
    cost_cache_path,
    fixed_allocation,
    load_costs,
    time_interleaved,
)
from reader_spec.config import GenerationConfig
from reader_spec.drafters.base import Drafter
from reader_spec.prompts import Prompt, encode_prompt
from reader_spec.runner import ModelRunner, text_config
from reader_spec.stopping import StopCriteria
from reader_spec.tree import EMPTY_PROPOSAL, DraftTree, Proposal

if TYPE_CHECKING:
    from reader_spec.loading import LoadedModel

DEFAULT_BUDGET = 16
"""Most draft tokens one sequence may verify per step."""


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    """Verification passes after prefill; each emits the accepted drafts plus one bonus token."""
    step_tokens: int = 0
    """Tokens emitted by those passes (all of them: prefill stops before the last prompt token)."""
    accept_lengths: list[int] = field(default_factory=list)
    """Tokens each pass emitted, bonus included (Spec-Bench's accept lengths; sums to ``step_tokens``)."""
    drafted: int = 0
    accepted: int = 0
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    """Accepted draft tokens by the source that proposed them (for a merged node, its likeliest one)."""
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    seconds: float = 0.0

    @property
    def mean_accepted(self) -> float:
        """Spec-Bench's mean accepted tokens per step, bonus included (plain decoding: 1.0)."""
        return self.step_tokens / self.steps if self.steps else 1.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict:
        shares = {}
        if self.seconds:
            shares = {
                "draft_share": self.draft_seconds / self.seconds,
                "verify_share": self.verify_seconds / self.seconds,
                "prefill_share": self.prefill_seconds / self.seconds,
            }
        return {
            **{k: v for k, v in vars(self).items()},
            "mean_accepted": self.mean_accepted,
            "tokens_per_second": self.tokens_per_second,
            **shares,
        }


@dataclass
class Output:
    id: object
    tokens: list[int]
    text: str
    finish_reason: str
    stats: RequestStats


@dataclass
class _Sequence:
    """A request being decoded in a slot of the batch."""

    index: int
    request_id: object
    history: list[int]
    """Prompt plus emitted tokens; the last one is the pending root, not yet in the KV cache."""
    prompt_length: int
    stop: StopCriteria
    rule: AcceptanceRule
    stats: RequestStats
    started: float
    finish_reason: str | None = None
    proposal: Proposal = field(default=EMPTY_PROPOSAL)

    @property
    def generated(self) -> list[int]:
        return self.history[self.prompt_length :]


class Engine:
    """Batched speculative decoding with any drafter on a loaded model."""

    def __init__(
        self,
        loaded: LoadedModel,
        drafter: Drafter | None = None,
        *,
        budget: int = DEFAULT_BUDGET,
        adaptive_budget: bool = True,
        costs: CostModel | None = None,
    ):
        if budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.drafter = drafter
        self.budget = budget if drafter is not None else 0
        self.allocate = allocate if adaptive_budget else fixed_allocation
        self._costs = costs
        self._runner: ModelRunner | None = None
        self._ids = itertools.count()

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
        finished request's slot goes to the next waiting one.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        encoded = [encode_prompt(self.tokenizer, p) for p in prompts]
        configs = _per_request(config, len(encoded))
        ids = list(range(len(encoded))) if ids is None else list(ids)
        if len(ids) != len(encoded):
            raise ValueError("ids and prompts must have the same length")
        waiting = deque(zip(ids, encoded, configs, strict=True))
        results: dict[int, Output] = {}
        order = {}
        active: list[_Sequence] = []
        longest = max((len(e) + c.max_new_tokens for e, c in zip(encoded, configs, strict=True)), default=1)
        runner = self._ensure_runner(batch_size, longest + self.budget + 2)
        while waiting or active:
            while waiting and len(active) < batch_size:
                request_id, tokens, request_config = waiting.popleft()
                seq = self._admit(runner, len(active), request_id, tokens, request_config)
                order[seq.index] = len(order)
                active.append(seq)
            self._step(runner, active)
            for slot in reversed(range(len(active))):
                seq = active[slot]
                if seq.finish_reason is not None:
                    output = self._retire(runner, active, slot)
                    results[order[seq.index]] = output
                    if on_finish is not None:
                        on_finish(output)
        return [results[i] for i in range(len(results))]

    # --- the loop --------------------------------------------------------------------------------
    def _admit(
        self, runner: ModelRunner, slot: int, request_id, tokens: list[int], config: GenerationConfig
    ) -> _Sequence:
        started = time.perf_counter()
        seq = _Sequence(
            index=next(self._ids),
            request_id=request_id,
            history=list(tokens),
            prompt_length=len(tokens),
            stop=self._stop_criteria(config),
            rule=rule_for(config),
            stats=RequestStats(prompt_tokens=len(tokens)),
            started=started,
        )
        # The last prompt token is the first root: prefill everything before it, so every later
        # step, this first one included, verifies a tree rooted at the pending token.
        logits = runner.prefill(slot, tokens[:-1]) if len(tokens) > 1 else None
        if logits is None:
            runner.cache.reset_slot(slot)
        seq.stats.prefill_seconds = time.perf_counter() - started
        if self.drafter is not None:
            self.drafter.begin(seq.index, seq.history)
        return seq

    def _step(self, runner: ModelRunner, batch: list[_Sequence]) -> None:
        """One verification pass over every sequence in the batch (slot i holds ``batch[i]``)."""
        started = time.perf_counter()
        if self.budget > 0:
            proposals = [self.drafter.propose(s.index, self.budget) for s in batch]
            context = float(runner.cache.lengths[: len(batch)].float().mean())
            counts = self.allocate(proposals, self.costs, self.budget, context)
            proposals = [p.truncated(n) for p, n in zip(proposals, counts, strict=True)]
        else:
            proposals = [EMPTY_PROPOSAL] * len(batch)
        trees = [DraftTree.from_proposal(s.history[-1], p) for s, p in zip(batch, proposals, strict=True)]
        drafted = time.perf_counter()
        logits = runner.verify(trees)
        verified = time.perf_counter()
        for slot, (seq, tree, proposal) in enumerate(zip(batch, trees, proposals, strict=True)):
            path, bonus = seq.rule.select(tree, logits[slot], seq.history)
            emitted = [tree.tokens[node] for node in path[1:]] + [bonus]
            kept, seq.finish_reason = seq.stop.clip(seq.generated, emitted)
            runner.cache.commit(slot, path)
            seq.history.extend(kept)
            stats = seq.stats
            stats.steps += 1
            stats.step_tokens += len(kept)
            stats.accept_lengths.append(len(kept))
            stats.new_tokens += len(kept)
            stats.drafted += len(proposal)
            emitted_nodes = path[1 : 1 + len(kept)]  # a limit may cut the accepted path short
            stats.accepted += len(emitted_nodes)
            for node in emitted_nodes:
                source = proposal.sources[node - 1] if proposal.sources else "draft"
                stats.accepted_by_source[source] = stats.accepted_by_source.get(source, 0) + 1
            stats.draft_seconds += drafted - started
            stats.verify_seconds += verified - drafted
            if self.drafter is not None:
                self.drafter.observe(seq.index, proposal, [node - 1 for node in path[1:]])
                self.drafter.extend(seq.index, kept)

    def _retire(self, runner: ModelRunner, active: list[_Sequence], slot: int) -> Output:
        seq = active[slot]
        last = len(active) - 1
        if slot != last:
            runner.cache.move_slot(last, slot)
            active[slot] = active[last]
        active.pop()
        if self.drafter is not None:
            self.drafter.end(seq.index)
        seq.stats.seconds = time.perf_counter() - seq.started
        return Output(
            id=seq.request_id,
            tokens=seq.generated,
            text=seq.stop.final_text(seq.generated),
            finish_reason=seq.finish_reason,
            stats=seq.stats,
        )

    # --- set-up ----------------------------------------------------------------------------------
    def _stop_criteria(self, config: GenerationConfig) -> StopCriteria:
        eos = config.eos_token_ids
        if eos is None:
            eos = model_eos_ids(self.model, self.tokenizer)
        return StopCriteria(config.max_new_tokens, frozenset(eos), config.stop_strings, self.tokenizer)

    def _ensure_runner(self, slots: int, capacity: int) -> ModelRunner:
        runner = self._runner
        if runner is None or runner.cache.num_slots < slots:
            runner = self._runner = ModelRunner(self.model, slots, capacity)
        runner.cache.reserve(capacity)
        return runner

    @property
    def costs(self) -> CostModel:
        """Verification cost curves, measured on first use and cached per machine and model."""
        if self._costs is None:
            path = cost_cache_path(f"{self.loaded.name}|{self.loaded.fingerprint}|{self.model.dtype}")
            self._costs = CostModel(
                load_costs(path),
                measure=lambda batch, drafted, context: _probe_verify(self.model, batch, drafted, context),
                budget=self.budget,
                path=path,
            )
        return self._costs

    def warm_up(self, batch_size: int = 1) -> None:
        """Measure costs for the batch sizes a run may use and warm kernels, outside any timing."""
        if self.budget > 0:
            for batch in range(1, batch_size + 1):
                self.costs.seconds(batch, 0)
        self.generate([[1, 2, 3, 4]], GenerationConfig(max_new_tokens=2, eos_token_ids=()))


def _probe_verify(model, batch: int, drafted: Sequence[int], context: int) -> dict[int, float]:
    """Seconds of a packed verification pass of ``batch`` chains holding each total of draft
    tokens (spread evenly), after ``context`` tokens in every slot."""
    most = max(drafted)
    probe = ModelRunner(model, batch, context + most // batch + 2)
    tokens = torch.randint(0, text_config(model.config).vocab_size, (context,)).tolist()
    probe.prefill(0, tokens)
    for slot in range(1, batch):
        probe.cache.copy_slot(0, slot)

    def chain(width: int) -> DraftTree:
        return DraftTree([tokens[i % context] for i in range(width)], list(range(-1, width - 1)))

    def verify(total: int) -> Callable[[], object]:
        trees = [chain(1 + total // batch + (slot < total % batch)) for slot in range(batch)]
        return lambda: probe.verify(trees)

    return time_interleaved({total: verify(total) for total in drafted})


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


def model_eos_ids(model, tokenizer) -> tuple[int, ...]:
    """The end-of-sequence ids the engine stops at by default, for other decoders to stop alike."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, Iterable) else (int(eos),)
