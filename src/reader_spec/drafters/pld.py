"""Prompt lookup decoding, the n-gram peer (transformers' ``prompt_lookup_num_tokens``, vLLM's ``ngram``).

The rule both implement: take the longest suffix of the request's text, ``max_ngram`` tokens at most and
``min_ngram`` at least, that occurred earlier in the text (prompt plus generated tokens) with at least
one token after it, and propose the tokens that followed its **earliest** occurrence, up to
``num_tokens`` of them, cut at the end of the text. Transformers scans n-gram sizes from the largest
down and takes the first match of each (``min_ngram`` is 1 there); vLLM's KMP scan keeps the earliest
position among the longest matches (``prompt_lookup_min``/``prompt_lookup_max``): the same rule.

Like both peers this rescans the text every step, without an index: one vectorized comparison over the
text finds the last token's earlier occurrences (O(text length), a few microseconds per thousand
tokens), and only those are checked further, at most ``max_ngram`` times.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from reader_spec.drafters.token_buffer import TokenBuffer
from reader_spec.engine.tree import EMPTY_PROPOSAL, Proposal, chain_proposal

SOURCE = "pld"

CONFIDENCE = 1.0
"""The probability given to every drafted token. Prompt lookup has no confidence estimate and always
verifies its whole chain; 1.0 makes a budget that ranks nodes by probability do the same (peers are
meant to run with ``adaptive_budget=False`` anyway)."""


def prompt_lookup(text: np.ndarray, num_tokens: int, max_ngram: int, min_ngram: int) -> np.ndarray:
    """The continuation prompt lookup proposes for ``text`` (empty when nothing matches)."""
    n = len(text)
    if num_tokens <= 0 or n < 2:
        return text[:0]
    # Ends of earlier occurrences of the last token; each has at least one token after it.
    ends = np.flatnonzero(text[: n - 1] == text[n - 1])
    length = 1
    while len(ends) and length < max_ngram:
        before = ends - length
        longer = ends[(before >= 0) & (text[np.maximum(before, 0)] == text[n - 1 - length])]
        if not len(longer):
            break
        ends, length = longer, length + 1
    if not len(ends) or length < min_ngram:
        return text[:0]
    start = int(ends[0]) + 1  # the earliest occurrence of the longest match
    return text[start : start + num_tokens]


DEFAULT_NUM_TOKENS = 10
"""transformers' default ``prompt_lookup_num_tokens``: the chain length prompt lookup drafts."""


class PromptLookupDrafter:
    """Prompt lookup decoding as a ``Drafter``: one chain of up to ``num_tokens`` tokens per step.

    Defaults are transformers' (``max_matching_ngram_size=2``, ``prompt_lookup_num_tokens=10``, any
    match of one token or more); ``min_ngram=max_ngram=k`` gives vLLM's setting for ``k``.
    """

    def __init__(self, num_tokens: int = DEFAULT_NUM_TOKENS, max_ngram: int = 2, min_ngram: int = 1) -> None:
        if num_tokens < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError("need num_tokens >= 1 and 1 <= min_ngram <= max_ngram")
        self.num_tokens = num_tokens
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._texts: dict[Hashable, TokenBuffer] = {}

    @property
    def settings(self) -> dict[str, int]:
        return {"num_tokens": self.num_tokens, "max_ngram": self.max_ngram, "min_ngram": self.min_ngram}

    def begin(self, request: Hashable, prompt: Sequence[int]) -> None:
        self._texts[request] = TokenBuffer(prompt)

    def extend(self, request: Hashable, tokens: Sequence[int]) -> None:
        self._texts[request].extend(tokens)

    def propose(self, request: Hashable, max_nodes: int) -> Proposal:
        text = self._texts[request].view()
        drafted = prompt_lookup(text, min(self.num_tokens, max_nodes), self.max_ngram, self.min_ngram)
        if not len(drafted):
            return EMPTY_PROPOSAL
        return chain_proposal(drafted.tolist(), [CONFIDENCE] * len(drafted), SOURCE)

    def observe(self, request: Hashable, proposal: Proposal, accepted: Sequence[int]) -> None:
        """Prompt lookup does not learn from verification."""

    def end(self, request: Hashable) -> None:
        self._texts.pop(request, None)
