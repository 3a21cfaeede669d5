"""When a request is done: length, end-of-sequence tokens and stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FINISH_LENGTH, FINISH_EOS, FINISH_STOP = "length", "eos", "stop"

# What a decoder writes for bytes that are not (yet) a whole UTF-8 character.
_REPLACEMENT = "\ufffd"


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
        """Whether the output now holds a stop string, decoding only a tail window (this runs per token).

        A token may add no character of its own (one byte of a longer character with byte fallback, a
        skipped special token), so no fixed number of tokens is enough: the window doubles until its
        text before the last token's part can hold the longest stop string, or it covers everything.
        """
        total = len(generated) + len(kept)

        def tail(size: int) -> list[int]:  # without copying all of ``generated``
            return [*generated[max(total - size, 0) :], *kept][-size:]

        longest = max(map(len, self.stop_strings))
        # The last token decoded alone is at least as long as what it adds in context (bytes it completes
        # read as one U+FFFD each), give or take a leading space that a decoder strips at the start.
        room = longest + len(self._decode(kept[-1:])) + 1
        size = longest + 2
        while True:
            text = self._decode(tail(size))
            # A window starting inside a character reads it as U+FFFD (byte fallback reads the whole run
            # of byte tokens it starts in so): move the start back to the character's first byte.
            for _ in range(3):
                if size >= total or not text.startswith(_REPLACEMENT):
                    break
                size += 1
                text = self._decode(tail(size))
            seen = text.lstrip(_REPLACEMENT)
            # Only U+FFFD from four starts in a row: the last character is unfinished, so ends no stop.
            if size >= total or not seen or len(seen) >= room:
                return any(stop in text for stop in self.stop_strings)
            size *= 2

    def final_text(self, tokens: Sequence[int]) -> str:
        """Decoded output, cut before the first stop string."""
        text = self._decode(tokens)
        cuts = [text.find(stop) for stop in self.stop_strings if stop in text]
        return text[: min(cuts)] if cuts else text

    def _decode(self, tokens: Sequence[int]) -> str:
        """The text the user gets back; stops are matched in it too, so finish reason and text agree."""
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)
