"""Generation settings, validated once so the engine loop can trust them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

SAMPLING_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "seed",
)
"""Settings a request may override one by one (the names transformers and the OpenAI API use)."""


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate for one request, and how to pick each token.

    ``eos_token_ids=None`` uses the model's own end-of-sequence tokens; an empty tuple never stops
    on a token. Output never goes past ``max_new_tokens``, an end-of-sequence token (kept as the last
    token) or the end of a stop string (the text is cut before it), even when a draft tree accepted more.

    Token choice follows transformers' order: logit bias, repetition penalty, temperature, top-k,
    top-p, min-p;
    OpenAI's presence and frequency penalties come right after the repetition penalty, and count the
    output's tokens only (as vLLM applies them), where the repetition penalty sees the prompt too.
    ``temperature=0`` is greedy decoding. With a ``seed`` the output depends only on the request and
    the seed, never on the drafter or the batch (an engine that reuses prefixes may differ from a
    fresh one at a near-tie: ``Engine``); without one every run draws fresh randomness.
    """

    max_new_tokens: int = 128
    stop_strings: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] | None = None
    temperature: float = 0.0
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output holds so far."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once for each time the output holds it so far."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """``(token, bias)`` pairs added to those tokens' logits before anything else (OpenAI's
    ``logit_bias``: -100 bans a token, 100 all but forces it); a mapping is taken too."""
    seed: int | None = None
    logprobs: int | None = None
    """Return each output token's log-probability and the ``logprobs`` likeliest tokens at its position
    (0: the token's alone); None returns none. The model's raw log-probabilities, whatever the settings
    above (:mod:`reader_spec.engine.logprobs`)."""
    prompt_logprobs: int | None = None
    """The same for the prompt's tokens (from its second on), read from the prefill's logits: such a
    prompt is prefilled whole, never taken from the cache."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if isinstance(self.stop_strings, str):
            object.__setattr__(self, "stop_strings", (self.stop_strings,))
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty strings")
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.eos_token_ids is not None:
            object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature must be >= 0", self)
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be an integer >= 0", self)
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p must lie in (0, 1]", self)
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p must lie in [0, 1]", self)
        _check(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty must be > 0",
            self,
        )
        for field in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, field)
            _check(_is_number(value) and -2 <= value <= 2, f"{field} must lie in [-2, 2]", self)
        for field in ("logprobs", "prompt_logprobs"):
            value = getattr(self, field)
            _check(
                value is None or (_is_number(value) and isinstance(value, int) and value >= 0),
                f"{field} must be None or an integer >= 0",
                self,
            )
        _check(
            self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**64),
            "seed must be an integer in [0, 2**64)",
            self,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether a token's logit depends on the tokens before it."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with untouched logits: the argmax of every node can be taken in one batched call."""
        return self.greedy and not self.penalized and not self.logit_bias


MAX_LOGIT_BIAS = 100.0
"""OpenAI's bound on a token's bias."""


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted ``(token, bias)`` pairs; token ids may come as strings (JSON keys)."""
    pairs = bias.items() if isinstance(bias, Mapping) else bias
    try:
        checked = {}
        for token, value in pairs:
            token = int(token) if isinstance(token, str) and token.isdigit() else token
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids, got {token!r}")
            if not _is_number(value) or abs(value) > MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias values must lie in [-100, 100], got {value!r} for token {token}"
                )
            checked[token] = float(value)
    except (TypeError, ValueError) as e:
        message = (
            str(e) if str(e).startswith("logit_bias") else f"logit_bias must map token ids to biases: {e}"
        )
        raise ValueError(message) from None
    return tuple(sorted(checked.items()))


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


def _check(ok: bool, message: str, config: GenerationConfig) -> None:
    if not ok:
        field = message.split()[0]
        raise ValueError(f"{message}, got {getattr(config, field)!r}")
