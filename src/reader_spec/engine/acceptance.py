"""Acceptance rules: which path of a verified draft tree the target model agrees with.

Every rule has the same shape: at a tree node, pick the token the target model emits there; if a
child carries it, descend; otherwise stop and emit the picked token as the bonus. The rule only
decides how a token is picked at a node, so greedy decoding and sampling share the loop. A greedy
rule is given the model's argmax tokens instead of logits (``greedy``): the runner finds them
without the whole output layer.
Because drafters propose deterministic tokens, this walk is exact for any tree: the emitted tokens
are the ones plain decoding would pick.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Protocol

import torch

from reader_spec.config import GenerationConfig
from reader_spec.engine.sampling import pick
from reader_spec.engine.tree import DraftTree


class AcceptanceRule(Protocol):
    greedy: bool
    """Whether :meth:`select` takes the model's argmax token at each node instead of its logits."""

    def select(self, tree: DraftTree, scores: torch.Tensor, history: Sequence[int]) -> tuple[list[int], int]:
        """Accepted node indices (root first) and the bonus token.

        ``scores[i]`` is what the target model gives after the path to node i: its logits, or its
        argmax token where the rule is ``greedy``; ``history`` is the request's text up to and
        including the root token.
        """


class GreedyRule:
    """Exactly plain greedy decoding: the model's argmax at every node."""

    greedy = True

    def select(self, tree: DraftTree, scores: torch.Tensor, history: Sequence[int]) -> tuple[list[int], int]:
        best = scores.tolist()
        return tree.walk(best.__getitem__)


class SamplingRule:
    """One request's token choice with its settings: seeded draws, repetition penalty, greedy or not.

    The token at absolute position t is ``pick(logits, config, seed, t, seen)``, where ``seen`` holds
    the node's own context (the request's text and the node's ancestors, never its siblings).
    """

    greedy = False

    def __init__(self, config: GenerationConfig, seed: int):
        self.config = config
        self.seed = seed
        self._seen: torch.Tensor | None = None
        self._seen_upto = 0

    def select(self, tree: DraftTree, logits: torch.Tensor, history: Sequence[int]) -> tuple[list[int], int]:
        seen = self._context_mask(history, logits) if self.config.repetition_penalty != 1 else None
        first_position = len(history)

        def choose(node: int) -> int:
            node_seen = seen
            if seen is not None and node:
                node_seen = seen.clone()
                node_seen[[tree.tokens[n] for n in tree.path_to(node)[1:]]] = True
            return pick(logits[node], self.config, self.seed, first_position + tree.depths[node], node_seen)

        return tree.walk(choose)

    def _context_mask(self, history: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """Tokens of the request's text, kept up to date incrementally (the text only grows)."""
        if self._seen is None:
            self._seen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        new = history[self._seen_upto :]
        if new:
            self._seen[list(new)] = True
        self._seen_upto = len(history)
        return self._seen


def rule_for(config: GenerationConfig) -> AcceptanceRule:
    """The cheapest exact rule for a request's settings; unseeded sampling draws a fresh seed."""
    if config.plain_greedy:
        return GreedyRule()
    return SamplingRule(config, config.seed if config.seed is not None else secrets.randbits(64))
