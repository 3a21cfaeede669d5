"""Output tokens' log-probabilities in OpenAI's two shapes: chat's ``content`` list and the legacy
completions' parallel lists.

A token's text is what it adds to the text before it (a few tokens of context are decoded with it:
alone, a SentencePiece token loses its leading space and a byte-level one may be half a character),
special tokens included so that an end-of-text token shows as one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from reader_spec.engine.logprobs import TokenLogprob

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CONTEXT_TOKENS = 6
"""Tokens decoded before a token to find the text it adds."""
FLOOR = -9999.0
"""OpenAI's log-probability for a token the model rules out (JSON has no infinity)."""


def pieces(tokenizer: PreTrainedTokenizerBase, before: Sequence[int], tokens: Sequence[int]) -> list[str]:
    """The text each of ``tokens``, in turn alone, would add after ``before``."""
    context = list(before[-CONTEXT_TOKENS:])
    base = tokenizer.decode(context)
    texts = [tokenizer.decode([*context, token]) for token in tokens]
    return [text[_shared(base, text) :] for text in texts]


def _shared(base: str, text: str) -> int:
    """How many first characters ``text`` shares with ``base`` (a context ending in half a character
    decodes it differently once the token completes it)."""
    if text.startswith(base):
        return len(base)
    return next((i for i, (a, b) in enumerate(zip(base, text, strict=False)) if a != b), len(text))


class LogprobWriter:
    """One choice's tokens' log-probabilities as response fields, chunk after chunk."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, before: Sequence[int]):
        self.tokenizer = tokenizer
        self.text: list[int] = list(before[-CONTEXT_TOKENS:])
        """The last tokens written (or the prompt's, before the first): what the next token follows."""
        self.offset = 0
        """Where the next token's text starts in the completion (the legacy ``text_offset``)."""

    def _entries(
        self, tokens: Sequence[int], logprobs: Sequence[TokenLogprob | None]
    ) -> list[tuple[TokenLogprob | None, str, list[str]]]:
        entries = []
        for token, logprob in zip(tokens, logprobs, strict=True):
            alternatives = [t for t, _ in logprob.top] if logprob is not None else []
            texts = pieces(self.tokenizer, self.text, [token, *alternatives])
            entries.append((logprob, texts[0], texts[1:]))
            self.text = [*self.text[1 - CONTEXT_TOKENS :], token]
        return entries

    def chat(self, logprobs: Sequence[TokenLogprob]) -> dict:
        """Chat's ``logprobs`` object for these tokens."""
        content = [
            {
                **_token(text, logprob.logprob),
                "top_logprobs": [_token(t, p) for t, (_, p) in zip(top, logprob.top, strict=True)],
            }
            for logprob, text, top in self._entries([lp.token for lp in logprobs], logprobs)
        ]
        return {"content": content, "refusal": None}

    def completion(self, tokens: Sequence[int], logprobs: Sequence[TokenLogprob | None]) -> dict:
        """The legacy completions' ``logprobs`` object for these tokens (None for an echoed prompt's
        first token, which nothing predicts)."""
        fields: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for logprob, text, top in self._entries(tokens, logprobs):
            fields["tokens"].append(text)
            fields["text_offset"].append(self.offset)
            self.offset += len(text)
            if logprob is None:
                fields["token_logprobs"].append(None)
                fields["top_logprobs"].append(None)
                continue
            fields["token_logprobs"].append(max(logprob.logprob, FLOOR))
            fields["top_logprobs"].append(
                {t: max(p, FLOOR) for t, (_, p) in zip(top, logprob.top, strict=True)}
            )
        return fields


def _token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": max(logprob, FLOOR), "bytes": list(text.encode("utf-8"))}
