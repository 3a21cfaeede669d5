"""Output tokens' log-probabilities, read from the logits that verified them.

A verification pass already holds the model's logits at every node of the accepted path, so an
accepted draft token's log-probability costs a softmax over one row, no extra pass. They are the
model's own (raw) log-probabilities, before temperature, penalties or truncation, as vLLM reports
them by default: a request's settings change which token is picked, not what the model thinks of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability and, most likely first, the tokens the model liked most there."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """``(token, logprob)`` pairs, as many as the request asked for."""


def token_logprobs(
    logits: torch.Tensor, nodes: Sequence[int], tokens: Sequence[int], top: int
) -> list[TokenLogprob]:
    """``tokens[i]``'s log-probability under ``logits[nodes[i]]``, with the ``top`` likeliest tokens there."""
    if not tokens:
        return []
    rows = torch.log_softmax(logits[list(nodes)].float(), dim=-1)
    index = torch.tensor(list(tokens), device=rows.device).unsqueeze(1)
    chosen = rows.gather(1, index).squeeze(1).tolist()
    if top <= 0:
        return [TokenLogprob(t, p) for t, p in zip(tokens, chosen, strict=True)]
    values, ids = rows.topk(min(top, rows.shape[-1]), dim=-1)
    return [
        TokenLogprob(t, p, tuple(zip(i, v, strict=True)))
        for t, p, i, v in zip(tokens, chosen, ids.tolist(), values.tolist(), strict=True)
    ]
