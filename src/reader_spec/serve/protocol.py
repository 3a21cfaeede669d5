"""The OpenAI request bodies this server accepts, checked field by field, and its error objects.

Parameters keep the OpenAI names and meanings (``presence_penalty`` and ``frequency_penalty`` count the
output's tokens, as vLLM's do); ``top_k``, ``min_p`` and ``repetition_penalty`` are extra body fields
(as vLLM takes them). OpenAI parameters this server does not implement are refused
with a 400 naming the field when they ask for something other than their default, rather than
silently ignored; unknown fields are ignored, as OpenAI's own clients send a few.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from reader_spec.config import GenerationConfig

DEFAULT_COMPLETION_TOKENS = 16
"""OpenAI's default ``max_tokens`` for completions; chat completions run to the end of the context
instead, and stop here too where the model's context length is unknown."""
MAX_CHOICES = 128
"""The most choices (``n``) one request may ask for, as OpenAI allows."""
MAX_TOP_LOGPROBS = 20
"""The most likeliest tokens a request may ask for at each position (chat's limit at OpenAI, vLLM's
default for both endpoints)."""

UNSUPPORTED_DEFAULTS: dict[str, Any] = {
    "best_of": 1,
    "suffix": None,
    "tools": None,
    "tool_choice": None,
    "functions": None,
    "function_call": None,
    "response_format": None,
}
"""OpenAI parameters this server does not implement, and the values that ask for nothing."""

Number = Annotated[float, Field(allow_inf_nan=False)]


class OpenAIError(Exception):
    """An error the client caused or should hear about, as OpenAI reports it."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: StrictStr
    max_tokens: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: StrictInt = 0
    min_p: Number = 0.0
    repetition_penalty: Number = 1.0
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    logit_bias: dict[StrictStr, Number] | None = None
    seed: StrictInt | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None

    @field_validator("n")
    @classmethod
    def _choices(cls, n):
        if not 1 <= n <= MAX_CHOICES:
            raise ValueError(f"n must lie in [1, {MAX_CHOICES}]")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    def check_supported(self) -> None:
        """Refuse OpenAI parameters that ask for behaviour this server does not have."""
        extra = self.model_extra or {}
        for name, default in UNSUPPORTED_DEFAULTS.items():
            if name in extra and extra[name] not in (default, None):
                raise OpenAIError(400, f"{name}={extra[name]!r} is not supported by this server", name)

    def generation_config(self, max_new_tokens: int) -> GenerationConfig:
        """The engine's settings; raises ``OpenAIError`` naming the field that is out of range."""
        settings = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": self.logit_bias or (),
            "seed": self.seed,
        }
        try:
            return GenerationConfig(
                max_new_tokens=max_new_tokens,
                stop_strings=tuple(self.stop or ()),
                **settings,
            )
        except ValueError as e:
            param = next((name for name in settings if str(e).startswith(name)), None)
            raise OpenAIError(400, str(e), param) from None


class CompletionRequest(_Request):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool = False

    @field_validator("logprobs")
    @classmethod
    def _top(cls, logprobs):
        return _top_logprobs("logprobs", logprobs)

    def generation_config(self, max_new_tokens: int) -> GenerationConfig:
        """With ``echo`` the log-probabilities cover the prompt too."""
        config = super().generation_config(max_new_tokens)
        return replace(config, logprobs=self.logprobs, prompt_logprobs=self.logprobs if self.echo else None)

    @field_validator("prompt")
    @classmethod
    def _prompts_not_empty(cls, prompt):
        many = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
        if not prompt or (many and not all(prompt)):
            raise ValueError("the prompt is empty")
        return prompt

    @model_validator(mode="after")
    def _choices_in_all(self):
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise ValueError(f"prompts times n must be at most {MAX_CHOICES}")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: a string or token ids, or a list of either (a choice each, in order)."""
        many = isinstance(self.prompt, list) and isinstance(self.prompt[0], str | list)
        return list(self.prompt) if many else [self.prompt]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, content):
        """OpenAI clients may send a list of content parts: their texts, joined as OpenAI joins them."""
        if not isinstance(content, list):
            return content
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(f"only text content parts are supported, got {kind!r}")
            if not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs a 'text' string")
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top(cls, top_logprobs):
        return _top_logprobs("top_logprobs", top_logprobs)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    def generation_config(self, max_new_tokens: int) -> GenerationConfig:
        config = super().generation_config(max_new_tokens)
        return replace(config, logprobs=(self.top_logprobs or 0) if self.logprobs else None)

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages):
        if not messages:
            raise ValueError("messages must hold at least one message")
        return messages

    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _top_logprobs(name: str, top: int | None) -> int | None:
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"{name} must lie in [0, {MAX_TOP_LOGPROBS}]")
    return top


def choice_configs(config: GenerationConfig, n: int) -> list[GenerationConfig]:
    """The settings of a request's ``n`` choices: with a seed, choice i draws with seed + i, so that
    the choices differ and the request repeats; without one each draws fresh."""
    if config.seed is None:
        return [config] * n
    return [replace(config, seed=(config.seed + i) % 2**64) for i in range(n)]


def finish_reason(engine_reason: str) -> str:
    """The engine's ``length`` / ``eos`` / ``stop`` in OpenAI's words."""
    return "length" if engine_reason == "length" else "stop"
