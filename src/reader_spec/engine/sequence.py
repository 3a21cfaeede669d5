"""A request while it decodes, its figures, and what it returns when done."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from reader_spec.engine.acceptance import AcceptanceRule
from reader_spec.engine.logprobs import TokenLogprob
from reader_spec.engine.stopping import StopCriteria
from reader_spec.engine.tree import Proposal


def mean_accepted(new_tokens: int, steps: int) -> float:
    """Spec-Bench's mean accepted tokens per step, bonus included (plain decoding: 1.0)."""
    return new_tokens / steps if steps else 1.0


@dataclass(kw_only=True)
class DraftCounts:
    """The speculation figures every report shares (a request, a replay, a batch run)."""

    steps: int = 0
    """Verification passes after prefill; each emits the accepted drafts plus one bonus token."""
    new_tokens: int = 0
    """Tokens emitted by those passes (all of them: prefill stops before the last prompt token)."""
    drafted: int = 0
    """Draft tokens verified."""
    accepted: int = 0
    """Draft tokens accepted and emitted (a limit may cut an accepted path short)."""

    @property
    def mean_accepted(self) -> float:
        return mean_accepted(self.new_tokens, self.steps)

    @property
    def drafted_per_accepted(self) -> float | None:
        """Draft tokens verified per accepted draft token (None when none was accepted)."""
        return self.drafted / self.accepted if self.accepted else None


@dataclass(kw_only=True)
class RequestStats(DraftCounts):
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens whose keys and values the row held or another row's were copied: not prefilled."""
    accept_lengths: list[int] = field(default_factory=list)
    """Tokens each pass emitted, bonus included (Spec-Bench's accept lengths; sums to ``new_tokens``)."""
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    """Accepted draft tokens by the source that proposed them (for a merged node, its likeliest one)."""
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    seconds: float = 0.0

    def record_step(self, proposal: Proposal, emitted: int, accepted: Sequence[int]) -> None:
        """One verification pass of ``proposal`` that emitted ``emitted`` tokens, ``accepted`` of them
        proposal nodes (indices into ``proposal``; a limit may have cut the accepted path short)."""
        self.steps += 1
        self.new_tokens += emitted
        self.accept_lengths.append(emitted)
        self.drafted += len(proposal)
        self.accepted += len(accepted)
        for node in accepted:
            source = proposal.sources[node] if proposal.sources else "draft"
            self.accepted_by_source[source] = self.accepted_by_source.get(source, 0) + 1

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
            **vars(self),
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
    logprobs: list[TokenLogprob] | None = None
    """One per token of ``tokens`` where the request asked for them (``GenerationConfig.logprobs``)."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """One per prompt token, None for the first (nothing predicts it), where the request asked for
    them (``GenerationConfig.prompt_logprobs``)."""


@dataclass
class DecodingSequence:
    """A request being decoded in one row of the KV cache."""

    request_id: object
    """The caller's id, returned with the output."""
    key: int
    """Unique per request in this engine: what the drafter knows the request by."""
    row: int
    """The KV-cache row that holds this request's context."""
    tokens: list[int]
    """Prompt plus emitted tokens; the last one is the pending root, not yet in the KV cache."""
    prompt_length: int
    stop: StopCriteria
    rule: AcceptanceRule
    stats: RequestStats
    started: float
    finish_reason: str | None = None
    top_logprobs: int | None = None
    """The request's ``GenerationConfig.logprobs``: how many likeliest tokens to return at each of its
    tokens (None: no log-probabilities)."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """One per generated token, where ``top_logprobs`` asks for them."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """Filled at prefill where the request asks for them."""

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    def output(self) -> Output:
        return Output(
            id=self.request_id,
            tokens=self.generated,
            text=self.stop.final_text(self.generated),
            finish_reason=self.finish_reason,
            stats=self.stats,
            logprobs=self.logprobs if self.top_logprobs is not None else None,
            prompt_logprobs=self.prompt_logprobs,
        )
