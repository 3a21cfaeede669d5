"""Acceptance rules: which path of a verified draft tree the target model agrees with.

Every rule has the same shape: at a tree node, pick the token the target model emits there; if a
child carries it, descend; otherwise stop and emit the picked token as the bonus. The rule only
decides how a token is picked at a node, so greedy decoding and sampling share the loop. A greedy
rule is given the model's argmax tokens instead of logits (``argmax``): the runner finds them
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
from reader_spec.engine.sampling import Occurrences, pick
from reader_spec.engine.tree import DraftTree


class AcceptanceRule(Protocol):
    argmax: bool
    """Whether :meth:`select` takes the model's argmax token at each node instead of its logits."""

    def select(self, tree: DraftTree, scores: torch.Tensor, history: Sequence[int]) -> tuple[list[int], int]:
        """Accepted node indices (root first) and the bonus token.

        ``scores[i]`` is what the target model gives after the path to node i: its logits, or its
        argmax token where the rule is ``argmax``; ``history`` is the request's text up to and
        including the root token.
        """


class GreedyRule:
    """Exactly plain greedy decoding: the model's argmax at every node."""

    argmax = True

    def select(self, tree: DraftTree, scores: torch.Tensor, history: Sequence[int]) -> tuple[list[int], int]:
        best = scores.tolist()
        return tree.walk(best.__getitem__)


class SamplingRule:
    """One request's token choice with its settings: seeded draws, penalties, greedy or not.

    The token at absolute position t is ``pick(logits, config, seed, t, occurrences)``, where the
    occurrences count the node's own context (the request's text and the node's ancestors, never its
    siblings); the output is what follows the first ``prompt_length`` tokens.
    """

    argmax = False

    def __init__(self, config: GenerationConfig, seed: int, prompt_length: int = 0):
        self.config = config
        self.seed = seed
        self.prompt_length = prompt_length
        self._in_text: torch.Tensor | None = None
        self._in_output: torch.Tensor | None = None
        self._counted_upto = 0

    def select(self, tree: DraftTree, logits: torch.Tensor, history: Sequence[int]) -> tuple[list[int], int]:
        if self.config.penalized:
            self._count(history, logits)
        first_position = len(history)

        def choose(node: int) -> int:
            occurrences = Occurrences(self._in_text, self._in_output)
            if node and self.config.penalized:
                occurrences = self._with_path([tree.tokens[n] for n in tree.path_to(node)[1:]])
            return pick(logits[node], self.config, self.seed, first_position + tree.depths[node], occurrences)

        return tree.walk(choose)

    def _count(self, history: Sequence[int], logits: torch.Tensor) -> None:
        """Bring the request's occurrences up to date with its text (which only grows)."""
        config, vocab, device = self.config, logits.shape[-1], logits.device
        if self._in_text is None and config.repetition_penalty != 1:
            self._in_text = torch.zeros(vocab, dtype=torch.bool, device=device)
        if self._in_output is None and (config.presence_penalty or config.frequency_penalty):
            self._in_output = torch.zeros(vocab, dtype=torch.float32, device=device)
        new = list(history[self._counted_upto :])
        if self._in_text is not None and new:
            self._in_text[new] = True
        output = list(history[max(self._counted_upto, self.prompt_length) :])
        if self._in_output is not None and output:
            self._add(self._in_output, output)
        self._counted_upto = len(history)

    def _with_path(self, path: list[int]) -> Occurrences:
        """The occurrences after the drafted tokens ``path`` (all of them output)."""
        in_text = in_output = None
        if self._in_text is not None:
            in_text = self._in_text.clone()
            in_text[path] = True
        if self._in_output is not None:
            in_output = self._in_output.clone()
            self._add(in_output, path)
        return Occurrences(in_text, in_output)

    @staticmethod
    def _add(counts: torch.Tensor, tokens: list[int]) -> None:
        index = torch.tensor(tokens, device=counts.device)
        counts.index_add_(0, index, torch.ones(len(tokens), dtype=counts.dtype, device=counts.device))


def rule_for(config: GenerationConfig, prompt_length: int = 0) -> AcceptanceRule:
    """The cheapest exact rule for a request's settings (the argmax alone unless the logits are needed:
    penalties, sampling or log-probabilities); unseeded sampling draws a fresh seed."""
    if config.plain_greedy and config.logprobs is None:
        return GreedyRule()
    seed = config.seed if config.seed is not None else secrets.randbits(64)
    return SamplingRule(config, seed, prompt_length)
