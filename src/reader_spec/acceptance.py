"""Acceptance rules: which path of a verified draft tree the target model agrees with.

Every rule has the same shape: at a tree node, pick the token the target model emits there; if a
child carries it, descend; otherwise stop and emit the picked token as the bonus. The rule only
decides how a token is picked from the node's logits (argmax for greedy decoding), so sampling
rules plug in here without touching the engine loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from reader_spec.tree import DraftTree


class AcceptanceRule(Protocol):
    def select(self, tree: DraftTree, logits: torch.Tensor, history: Sequence[int]) -> tuple[list[int], int]:
        """Accepted node indices (root first) and the bonus token.

        ``logits[i]`` are the target model's logits after the path to node i; ``history`` is the
        request's text up to and including the root token.
        """


class GreedyRule:
    """Exactly plain greedy decoding: the model's argmax at every node."""

    def select(self, tree: DraftTree, logits: torch.Tensor, history: Sequence[int]) -> tuple[list[int], int]:
        best = logits.argmax(dim=-1).tolist()
        return tree.walk(best.__getitem__)
