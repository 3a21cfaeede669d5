"""When a request is done: length, end-of-sequence tokens and stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FINISH_LENGTH, FINISH_EOS, FINISH_STOP = "length", "eos", "stop"


@dataclass(frozen=True)
class StopCriteria:
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    stop_strings: tuple[str, ...] = ()
    tokenizer: object = None

    def clip(self, generated: Sequence[int], new: Sequence[int]) -> tuple[list[int], str | None]:
        """The part of ``new`` to emit after ``generated``, and why the request finished (or None).

        A draft tree may accept tokens past a limit; they are dropped here so the output is exactly
        what plain decoding would have produced.
        """
        kept: list[int] = []
        for token in new:
            kept.append(token)
            if token in self.eos_token_ids:
                return kept, FINISH_EOS
            if self.stop_strings and self._ends_in_stop(generated, kept):
                return kept, FINISH_STOP
            if len(generated) + len(kept) >= self.max_new_tokens:
                return kept, FINISH_LENGTH
        return kept, None

    def _ends_in_stop(self, generated: Sequence[int], kept: list[int]) -> bool:
        # Every token decodes to at least one character in practice, so a window of as many tokens
        # as the longest stop string has characters covers any occurrence the last token completed.
        window = max(map(len, self.stop_strings)) + 2
        tail = [*generated[-window:], *kept][-window:]
        text = self.tokenizer.decode(tail, skip_special_tokens=False)
        return any(stop in text for stop in self.stop_strings)

    def final_text(self, tokens: Sequence[int]) -> str:
        """Decoded output, cut before the first stop string."""
        text = self.tokenizer.decode(list(tokens), skip_special_tokens=True)
        cuts = [text.find(stop) for stop in self.stop_strings if stop in text]
        return text[: min(cuts)] if cuts else text
