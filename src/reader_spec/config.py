"""Generation settings, validated once so the engine loop can trust them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate for one request.

    ``eos_token_ids=None`` uses the model's own end-of-sequence tokens; an empty tuple never stops
    on a token. Output never goes past ``max_new_tokens``, an end-of-sequence token (kept as the last
    token) or the end of a stop string (the text is cut before it), even when a draft tree accepted more.
    """

    max_new_tokens: int = 128
    stop_strings: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if isinstance(self.stop_strings, str):
            object.__setattr__(self, "stop_strings", (self.stop_strings,))
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty strings")
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if self.eos_token_ids is not None:
            object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
