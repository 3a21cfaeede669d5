"""Draft trees: the candidate continuations one verification pass checks at once.

Node 0 is the root: the last emitted token, not yet in the KV cache. Every other node is a drafted
token whose parent comes earlier in the list, so a prefix of the node list is always a valid tree.
That lets a budget cut a best-first proposal anywhere without repairing it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class Proposal:
    """Drafted nodes below the root, best first.

    ``parents[i]`` is -1 for a child of the root, else the index of an earlier proposed node.
    ``probs[i]`` is the drafter's estimate that the path root..i is accepted (non-increasing
    along every path), which is what budgets rank nodes by. ``sources[i]`` names who proposed it.
    """

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if not (len(self.parents) == len(self.probs) == n) or len(self.sources) not in (0, n):
            raise ValueError("Proposal fields must have equal lengths")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i} has parent {parent}; parents must come before children")

    def __len__(self) -> int:
        return len(self.tokens)

    def truncated(self, max_nodes: int) -> Proposal:
        """The first ``max_nodes`` nodes: still a tree because parents precede children."""
        if max_nodes >= len(self.tokens):
            return self
        n = max(max_nodes, 0)
        return Proposal(
            self.tokens[:n], self.parents[:n], self.probs[:n], self.sources[:n] if self.sources else ()
        )


EMPTY_PROPOSAL = Proposal()


@dataclass
class DraftTree:
    """A root token plus proposed nodes, with what verification needs: depths and ancestry."""

    tokens: list[int]
    parents: list[int]
    depths: list[int] = field(init=False)
    children: list[dict[int, int]] = field(init=False)

    def __post_init__(self) -> None:
        if not self.tokens or self.parents[0] != -1:
            raise ValueError("a draft tree needs a root with parent -1")
        self.depths = [0] * len(self.tokens)
        self.children = [{} for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            parent = self.parents[i]
            if not 0 <= parent < i:
                raise ValueError(f"node {i} has parent {parent}; parents must come before children")
            self.depths[i] = self.depths[parent] + 1
            # A duplicate sibling is still verified (it is in the pass) but never accepted: the walk
            # follows the first, best-ranked one. Drafters merge duplicates before proposing.
            self.children[parent].setdefault(self.tokens[i], i)

    @classmethod
    def from_proposal(cls, root_token: int, proposal: Proposal) -> DraftTree:
        return cls([root_token, *proposal.tokens], [-1, *(p + 1 for p in proposal.parents)])

    def __len__(self) -> int:
        return len(self.tokens)

    def ancestor_mask(self) -> torch.Tensor:
        """``mask[i, j]`` is True when node i may attend to node j (j is i or an ancestor of i)."""
        n = len(self.tokens)
        rows: list[list[bool]] = []
        for i, parent in enumerate(self.parents):  # as lists, then one array: the host pays per op
            row = rows[parent].copy() if parent >= 0 else [False] * n
            row[i] = True
            rows.append(row)
        # numpy, not torch.tensor: cheaper after a pass has swept the caches, once per tree of every pass
        return torch.from_numpy(np.array(rows, dtype=bool).reshape(n, n))

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to ``node``."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def walk(self, choose: Callable[[int], int]) -> tuple[list[int], int]:
        """Descend from the root while the token chosen at a node is one of its children.

        ``choose(node)`` returns the token the target model emits after the path to ``node``.
        Returns the accepted node indices (root first) and the bonus token chosen at the last one.
        """
        node, path = 0, [0]
        while True:
            token = choose(node)
            child = self.children[node].get(token)
            if child is None:
                return path, token
            node = child
            path.append(node)


def chain_proposal(tokens: Sequence[int], probs: Sequence[float], source: str = "") -> Proposal:
    """A single path as a proposal (a tree of breadth one)."""
    n = len(tokens)
    return Proposal(tuple(tokens), tuple(range(-1, n - 1)), tuple(probs), (source,) * n if source else ())
