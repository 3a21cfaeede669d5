"""The decoding loop: prefill, then draft -> verify -> accept, for a batch of requests at once.

Each step every active sequence gets a draft tree from the drafter, one forward pass verifies all
trees of the batch, each sequence accepts its own number of tokens plus the bonus token, and the
KV cache keeps exactly the accepted entries. A finished sequence frees its cache row at once and a
waiting request takes it. With no drafter (or a zero budget) this is plain autoregressive decoding:
the baseline every speedup is measured against.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tqdm import tqdm

from reader_spec.budget.allocation import allocate
from reader_spec.budget.costs import CostModel, cost_cache_path, load_costs
from reader_spec.config import GenerationConfig
from reader_spec.drafters.base import Drafter, feed_back
from reader_spec.engine.acceptance import rule_for
from reader_spec.engine.runner import ModelRunner, max_context_of, synchronizer
from reader_spec.engine.sequence import Output, RequestStats
from reader_spec.engine.sequence import Sequence as DecodingSequence
from reader_spec.engine.stopping import StopCriteria
from reader_spec.engine.tree import EMPTY_PROPOSAL, DraftTree, Proposal
from reader_spec.prompts import Prompt, PromptError, encode_prompt

if TYPE_CHECKING:
    from reader_spec.loading import LoadedModel

DEFAULT_BUDGET = 16
"""Most draft tokens one sequence may verify per step (the engine's budget)."""

log = logging.getLogger(__name__)


@dataclass
class _Drafts:
    """One step's drafts, a proposal and its tree per sequence of the batch."""

    proposals: list[Proposal]
    trees: list[DraftTree]
    seconds: float


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
        self.adaptive_budget = adaptive_budget
        self.max_context = max_context_of(self.model.config)
        self._costs = costs
        self._runner: ModelRunner | None = None
        self._keys = itertools.count()
        self._synchronize = synchronizer(self.model.device)

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
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        encoded = [self.encode(p) for p in prompts]
        configs = _per_request(config, len(encoded))
        ids = list(range(len(encoded))) if ids is None else list(ids)
        if len(ids) != len(encoded):
            raise ValueError("ids and prompts must have the same length")
        self.calibrate(batch_size)
        longest = max((len(e) + c.max_new_tokens for e, c in zip(encoded, configs, strict=True)), default=1)
        runner = self._ensure_runner(batch_size, longest + self.budget + 2)
        waiting = deque(zip(range(len(encoded)), ids, encoded, configs, strict=True))
        results: dict[int, Output] = {}
        order: dict[int, int] = {}
        batch: list[DecodingSequence] = []  # ascending cache rows
        free_rows = list(range(batch_size))
        while waiting or batch:
            while waiting and free_rows:
                position, request_id, tokens, request_config = waiting.popleft()
                seq = self._admit(runner, free_rows.pop(0), request_id, tokens, request_config)
                order[seq.key] = position
                bisect.insort(batch, seq, key=lambda s: s.row)
            self._step(runner, batch)
            for seq in [s for s in batch if s.finish_reason is not None]:
                batch.remove(seq)
                bisect.insort(free_rows, seq.row)
                output = self._retire(seq)
                results[order.pop(seq.key)] = output
                if on_finish is not None:
                    on_finish(output)
        return [results[i] for i in range(len(results))]

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
    def costs(self) -> CostModel:
        """Verification cost curves, read from the cache (:meth:`calibrate` measures missing ones)."""
        if self._costs is None:
            from reader_spec.budget.probe import probe_verify

            path = cost_cache_path(f"{self.loaded.name}|{self.loaded.fingerprint}|{self.model.dtype}")
            self._costs = CostModel(
                load_costs(path),
                measure=lambda batch, drafted, context: probe_verify(self.model, batch, drafted, context),
                budget=self.budget,
                path=path,
            )
        return self._costs

    def warm_up(self, batch_size: int = 1) -> None:
        """Measure costs for the batch sizes a run may use and warm kernels, outside any timing."""
        self.calibrate(batch_size)
        self.generate([[1, 2, 3, 4]], GenerationConfig(max_new_tokens=2, eos_token_ids=()))

    # --- one step: draft -> verify -> accept -----------------------------------------------------
    def _step(self, runner: ModelRunner, batch: list[DecodingSequence]) -> None:
        """One verification pass over every sequence of the batch."""
        drafts = self._draft(runner, batch)
        started = time.perf_counter()
        logits = runner.verify(drafts.trees, [s.row for s in batch])
        self._synchronize()
        verify_seconds = time.perf_counter() - started
        for seq, proposal, tree, scores in zip(batch, drafts.proposals, drafts.trees, logits, strict=True):
            self._accept(runner, seq, proposal, tree, scores)
            seq.stats.draft_seconds += drafts.seconds
            seq.stats.verify_seconds += verify_seconds

    def _draft(self, runner: ModelRunner, batch: list[DecodingSequence]) -> _Drafts:
        """Each sequence's proposal, cut to the share of the step's budget the allocation gives it."""
        started = time.perf_counter()
        if self.budget > 0:
            proposals = [self.drafter.propose(s.key, self.budget) for s in batch]
            if self.adaptive_budget:
                context = float(runner.cache.lengths[[s.row for s in batch]].float().mean())
                counts = allocate(proposals, self.costs, self.budget, context)
                proposals = [p.truncated(n) for p, n in zip(proposals, counts, strict=True)]
            else:
                proposals = [p.truncated(self.budget) for p in proposals]
        else:
            proposals = [EMPTY_PROPOSAL] * len(batch)
        trees = [DraftTree.from_proposal(s.tokens[-1], p) for s, p in zip(batch, proposals, strict=True)]
        return _Drafts(proposals, trees, time.perf_counter() - started)

    def _accept(
        self, runner: ModelRunner, seq: DecodingSequence, proposal: Proposal, tree: DraftTree, logits
    ) -> None:
        """Walk the tree with the request's acceptance rule, keep what the limits allow, commit it."""
        path, bonus = seq.rule.select(tree, logits, seq.tokens)
        emitted = [tree.tokens[node] for node in path[1:]] + [bonus]
        kept, seq.finish_reason = seq.stop.clip(seq.generated, emitted)
        runner.cache.commit(seq.row, path)
        seq.tokens.extend(kept)
        seq.stats.record_step(proposal, len(kept), [node - 1 for node in path[1 : 1 + len(kept)]])
        if self.drafter is not None:
            feed_back(self.drafter, seq.key, proposal, path, kept)

    # --- requests joining and leaving ------------------------------------------------------------
    def _admit(
        self, runner: ModelRunner, row: int, request_id, tokens: list[int], config: GenerationConfig
    ) -> DecodingSequence:
        started = time.perf_counter()
        seq = DecodingSequence(
            request_id=request_id,
            key=next(self._keys),
            row=row,
            tokens=list(tokens),
            prompt_length=len(tokens),
            stop=self._stop_criteria(config, len(tokens)),
            rule=rule_for(config),
            stats=RequestStats(prompt_tokens=len(tokens)),
            started=started,
        )
        # The last prompt token is the first root: prefill everything before it, so every later
        # step, this first one included, verifies a tree rooted at the pending token.
        runner.prefill(row, tokens[:-1])
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

    def _stop_criteria(self, config: GenerationConfig, prompt_length: int) -> StopCriteria:
        eos = config.eos_token_ids
        if eos is None:
            eos = model_eos_ids(self.model, self.tokenizer)
        max_new_tokens = config.max_new_tokens
        if self.max_context is not None:
            max_new_tokens = min(max_new_tokens, self.max_context - prompt_length)
        return StopCriteria(max_new_tokens, frozenset(eos), config.stop_strings, self.tokenizer)

    def _ensure_runner(self, rows: int, capacity: int) -> ModelRunner:
        runner = self._runner
        if runner is None or runner.cache.num_rows < rows:
            runner = self._runner = ModelRunner(self.model, rows, capacity)
        runner.cache.reserve(capacity)
        return runner


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
