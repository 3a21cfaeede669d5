"""Exact, seeded token draws: the processed distribution of one tree node, and its Gumbel-max draw.

A draw at absolute position t of a request is ``argmax(score + gumbel(seed, t, token))`` over the tokens
the processed distribution keeps. Gumbel-max makes that an exact sample of the distribution; the noise
is a counter-based hash of (seed, position, token), so the draw does not depend on which tree node,
step, drafter or batch asked for it. A tree node and the plain decoding step at the same position see
the same context, hence the same distribution and the same noise: speculative and plain sampling emit
the same token, and the accepted path is exactly what plain sampling would have produced.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from reader_spec.config import GenerationConfig

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_NUCLEUS_FIRST_K = 64
"""Top-p looks at this many of the most likely tokens first and widens only if they hold too little mass."""


def _splitmix64(state: np.ndarray) -> np.ndarray:
    """SplitMix64's output function: a bijective 64-bit mixer (array arithmetic wraps modulo 2**64)."""
    z = (state ^ (state >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def gumbel_noise(seed: int, position: int, tokens: np.ndarray) -> np.ndarray:
    """Standard Gumbel noise for ``tokens`` at ``position``: element ``token`` of a SplitMix64 stream
    whose key is element ``position`` of the stream keyed by ``seed``."""
    base = _splitmix64(np.array([seed], dtype=np.uint64))
    key = _splitmix64(base + np.array([position + 1], dtype=np.uint64) * _GOLDEN)
    bits = _splitmix64(key + (tokens.astype(np.uint64) + np.uint64(1)) * _GOLDEN)
    uniform = ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
    return -np.log(-np.log(uniform))


@dataclass(frozen=True)
class Occurrences:
    """What the penalties see of one node's context, over the vocabulary; None where no penalty asks."""

    in_text: torch.Tensor | None = None
    """Whether each token is in the text so far, prompt included (the repetition penalty)."""
    in_output: torch.Tensor | None = None
    """How often each token is in the output so far, as floats (the presence and frequency penalties)."""


def penalize(scores: torch.Tensor, config: GenerationConfig, occurrences: Occurrences | None) -> torch.Tensor:
    """The logit bias added, then transformers' repetition penalty (positive logits of tokens in the
    text divided by it, negative ones multiplied), then OpenAI's presence and frequency penalties
    subtracted for the output's tokens."""
    if config.logit_bias:
        tokens, biases = zip(*config.logit_bias, strict=True)
        scores = scores.clone()
        scores[list(tokens)] += torch.tensor(biases, dtype=scores.dtype, device=scores.device)
    if occurrences is None:
        return scores
    if occurrences.in_text is not None and config.repetition_penalty != 1:
        scores = scores.clone()
        seen, penalty = occurrences.in_text, config.repetition_penalty
        picked = scores[seen]
        scores[seen] = torch.where(picked < 0, picked * penalty, picked / penalty)
    counts = occurrences.in_output
    if counts is not None and (config.presence_penalty or config.frequency_penalty):
        scores = scores - config.frequency_penalty * counts - config.presence_penalty * (counts > 0).float()
    return scores


def support(
    logits: torch.Tensor, config: GenerationConfig, occurrences: Occurrences | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens the processed distribution can emit and their scores (log-probabilities plus a constant).

    ``occurrences`` is what the penalties see of the node's context. Temperature must be positive
    here; greedy decoding never needs the distribution.
    """
    scores = penalize(logits.float(), config, occurrences) / config.temperature
    tokens: torch.Tensor | None = None
    if 0 < config.top_k < scores.numel():
        kth = torch.topk(scores, config.top_k).values[-1]
        tokens = (scores >= kth).nonzero().squeeze(1)  # ties with the k-th score stay, as in transformers
    if config.top_p < 1:
        tokens = _nucleus(scores, tokens, config.top_p)
    if tokens is None:
        tokens = torch.arange(scores.numel(), device=scores.device)
    kept = scores[tokens]
    if config.min_p > 0:
        probs = torch.softmax(kept, dim=0)
        survive = probs >= config.min_p * probs.max()
        tokens, kept = tokens[survive], kept[survive]
    return tokens, kept


def _nucleus(scores: torch.Tensor, tokens: torch.Tensor | None, top_p: float) -> torch.Tensor:
    """Tokens whose more likely tokens hold less than ``top_p`` of the mass (transformers' top-p rule).

    Sorting the whole vocabulary costs milliseconds; the k most likely tokens decide the nucleus as
    soon as they hold at least ``top_p`` of the mass, so k starts small and grows only when needed.
    """
    candidates = scores if tokens is None else scores[tokens]
    probs = torch.softmax(candidates, dim=0)
    n = probs.numel()
    k = min(_NUCLEUS_FIRST_K, n)
    while True:
        top, order = torch.topk(probs, k)
        if k == n or float(top.sum()) >= top_p:
            above = torch.cumsum(top, dim=0) - top
            kept = order[above < top_p]
            return kept if tokens is None else tokens[kept]
        k = min(4 * k, n)


def pick(
    logits: torch.Tensor,
    config: GenerationConfig,
    seed: int,
    position: int,
    occurrences: Occurrences | None = None,
) -> int:
    """The token a request emits at ``position`` given the model's logits there."""
    if config.greedy:
        return int(penalize(logits, config, occurrences).argmax())
    tokens, scores = support(logits, config, occurrences)
    tokens, scores = tokens.cpu(), scores.double().cpu()
    noise = gumbel_noise(seed, position, tokens.numpy())
    return int(tokens[int(np.argmax(scores.numpy() + noise))])
