"""The output layer's argmax for greedy requests, without reading the whole float32 matrix.

Greedy decoding needs one thing from a pass's output layer: the token with the largest logit. That
layer is the largest matrix of a small model (49,152 x 576 in SmolLM2-135M, a fifth of its weights),
and a pass of a few tokens costs what reading it costs. :class:`GreedyHead` keeps an int8 copy of the
matrix (a quarter of the bytes) and approximates every logit in integers: the hidden state is
quantized to about 15 bits (two int8 levels, the second quantizing what the first left over, for
AVX-512 VNNI's byte products; one int16 level elsewhere, for AVX2's 16-bit products), and integer dot
products run at twice to four times float32's rate and are exact in any order. Float32 logits are
then computed only for the columns whose bound says they can still be the largest (a handful on real
text), by the same compiled tile as the full product. The token is the full product's argmax bit for
bit, ties included (the first of equal maxima, as ``torch.argmax``), so greedy outputs do not change.
In a verification pass only the rows greedy acceptance can reach need a token (a root, and a draft
whose token is the one found at its parent); the rows after a rejected draft, where the model is least
sure, are left unresolved. Where the whole float32 layer is faster (timed once per row bucket, as the
kernels are), it runs instead.

The bound. For column j with float32 weights ``W_j``, int8 copy ``q_j`` and scale ``s_j`` (quantization
error ``e_j = W_j - s_j q_j``), and a hidden state ``h`` of K features with integer approximation ``g``
(``|h - g| = d``), the float32 logit differs from the exact dot product ``h . W_j`` by at most
``gamma |h| |W_j|`` (rounding of a K-term dot product in any order, ``gamma = (K + 1) u / (1 - (K + 1)
u)``, ``u = 2^-24``); ``h . W_j`` differs from ``g . s_j q_j`` by at most ``d |W_j| + |g| |e_j|``
(Cauchy-Schwarz); and the approximation is that integer product scaled, with a few roundings (below
``gamma |g| |s_j q_j|``). With ``n = max(|h|, |g|)``, the distance is at most ``n slack_j + d |W_j|``:
``slack_j`` is ``|e_j| + gamma (|W_j| + |s_j q_j|)`` with 5% and ``16 u (|W_j| + |s_j q_j|)`` to spare for
the rounding of the comparison itself, rounded up to float32; the kernel adds 5% to ``d``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from reader_spec.engine import kernels
from reader_spec.engine.host import longs
from reader_spec.engine.kernel_choice import row_bucket
from reader_spec.engine.layouts import BLOCK, INT8_GROUP, PANEL, quantize_int8, to_groups
from reader_spec.engine.memory import PageArena
from reader_spec.engine.timing import best_times
from reader_spec.engine.tree import DraftTree
from reader_spec.engine.weights import PackedLinear

KEPT_PRIOR = 0.5
"""The share of draft rows the head is taken to compute to the end before it has run on any trees
(:attr:`GreedyHead.kept_share`): about what verification accepts of the drafts it is given."""
KEPT_PRIOR_ROWS = 8.0
"""How many draft rows that prior weighs, against what passes show."""
KEPT_DECAY = 0.99
"""Per pass with drafts, how much of what the passes before showed of the kept share counts."""


@dataclass(frozen=True)
class Trees:
    """A pass's draft trees as the greedy head reads them: each row's parent row (-1 for a root) and
    token, and how many roots there are."""

    parents: torch.Tensor
    tokens: torch.Tensor
    roots: int


UNBOUNDED = -1
"""The kernel's token for a row that is not finite (the full product then decides it)."""
UNNEEDED = -2
"""The token of a row that greedy acceptance cannot reach (below a rejected draft)."""
UNIT_ROUNDOFF = 2.0**-24
CHUNK_BLOCKS = 128
"""Blocks of 32 columns quantized at a time: a few MB of temporaries, never a whole float copy."""


class GreedyHead:
    """``argmax(head(hidden), -1)`` for a float32 output layer, reading an int8 copy and a few columns."""

    def __init__(self, head: PackedLinear):
        self.head = head
        panels, features, _ = head.weight.shape
        blocks = panels * PANEL // BLOCK
        groups = -(-features // INT8_GROUP)
        self.quantized = PageArena(blocks * groups * BLOCK * INT8_GROUP).empty(
            (blocks, groups, BLOCK * INT8_GROUP), torch.uint8
        )
        """The int8 copy as the integer product reads it (:func:`~reader_spec.engine.layouts.to_groups`)."""
        self.scales = torch.empty(blocks * BLOCK, device="cpu")
        self.slack = torch.empty(blocks * BLOCK, device="cpu")
        self.norms = torch.empty(blocks * BLOCK, device="cpu")
        for first in range(0, blocks, CHUNK_BLOCKS):
            panels_of_chunk = slice(first * BLOCK // PANEL, (first + CHUNK_BLOCKS) * BLOCK // PANEL)
            chunk = head.weight[panels_of_chunk]  # padding columns are zero: q 0, slack 0
            plain = chunk.transpose(1, 2).reshape(-1, features)
            quantized, scales = quantize_int8(plain)
            columns = slice(first * BLOCK, first * BLOCK + plain.shape[0])
            self.scales[columns] = scales
            self.slack[columns], self.norms[columns] = _slack(plain, quantized, scales)
            self.quantized[first : first + CHUNK_BLOCKS] = to_groups(quantized, quantized.shape[0])
        self._seconds_by_bucket: dict[int, tuple[float, float]] = {}
        """The bounded head's and the whole float32 layer's seconds at that row bucket, every row
        computed (timed once)."""
        self._kept = KEPT_PRIOR * KEPT_PRIOR_ROWS
        self._drafts = KEPT_PRIOR_ROWS
        """Decayed sums of draft rows computed to the end and of draft rows given (:attr:`kept_share`)."""

    @staticmethod
    def applies(head: PackedLinear) -> bool:
        """Whether this head can run it: float32 in column blocks, no bias, the compiled kernels built."""
        return head.blocked and head.scales is None and head.bias is None and kernels.available()

    def __call__(self, hidden: torch.Tensor, trees: Trees | None = None) -> torch.Tensor:
        """The argmax token of each row of ``hidden`` (``[rows, in]``): ``[rows]``, long.

        With ``trees`` (each row's parent row, -1 for a root, and its own token), a row's token is
        found only where greedy acceptance can read it: at a root, or at a draft whose token is the
        one found at its parent. The rows after a rejected draft get ``UNNEEDED``: they are where the
        model is least sure, and each would send tens of column blocks through the exact product."""
        rows = hidden.shape[0]
        roots = rows if trees is None else trees.roots
        if not self.wins(rows, roots):
            return self.head(hidden).argmax(-1)
        tokens, any_unbounded, kept = self._bounded(hidden, trees)
        if rows > roots:
            self._kept = self._kept * KEPT_DECAY + (kept - roots)
            self._drafts = self._drafts * KEPT_DECAY + (rows - roots)
        if any_unbounded:  # inf or NaN in a row: its bound says nothing, take the full product
            unbounded = tokens == UNBOUNDED
            tokens[unbounded] = self.head(hidden[unbounded]).argmax(-1)
        return tokens

    def _bounded(self, hidden: torch.Tensor, trees: Trees | None = None) -> tuple[torch.Tensor, bool, int]:
        """Each row's token (``UNBOUNDED``, ``UNNEEDED`` or the argmax), whether any is ``UNBOUNDED``
        (told by the kernel: reading the tokens back is dear after a pass has swept the caches)
        and how many rows the integer products computed to the end (the others were found below a
        rejected draft partway)."""
        head = self.head
        parents, drafted = (trees.parents, trees.tokens) if trees is not None else (None, None)
        tables = (self.quantized, self.scales, self.slack, self.norms)
        return torch.ops.reader_spec.greedy_tokens(
            hidden, head.weight, *tables, head.out_features, parents, drafted
        )

    @property
    def kept_share(self) -> float:
        """The share of draft rows the integer products have been computing to the end, over recent
        passes with drafts (the rest left the sweep below a rejected draft)."""
        return self._kept / self._drafts

    def wins(self, rows: int, roots: int | None = None) -> bool:
        """Whether the bounded head beats the whole output layer on a pass of ``rows`` rows, ``roots``
        of them roots of trees (default: all) and the others drafts. Each takes its time at the row
        bucket, timed once with every row computed; the head computes a draft's row only until the
        draft is known rejected, so it is priced at the rows it is expected to keep
        (:attr:`kept_share` of the drafts)."""
        full = self._seconds(rows)
        if full is None:
            return False
        drafts = rows - (rows if roots is None else roots)
        kept = self._seconds(math.ceil(rows - drafts * (1.0 - self.kept_share)))
        return kept[0] <= full[1]

    def _seconds(self, rows: int) -> tuple[float, float] | None:
        """The bounded head's and the whole layer's seconds at the row bucket of ``rows`` (None past
        the last bucket), timed when first asked."""
        bucket = row_bucket(rows)
        if bucket is None:
            return None
        if bucket not in self._seconds_by_bucket:
            generator = torch.Generator().manual_seed(0)  # not the caller's random state
            hidden = torch.randn(bucket, self.head.in_features, generator=generator, device="cpu")
            with torch.inference_mode():
                head, full = best_times([lambda: self._bounded(hidden), lambda: self.head(hidden).argmax(-1)])
            self._seconds_by_bucket[bucket] = (head, full)
        return self._seconds_by_bucket[bucket]


def _slack(
    plain: torch.Tensor, quantized: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each column's bound per unit of ``max(|h|, |g|)`` and its norm ``|W_j|`` (see the module's
    docstring), both rounded up to float32."""
    features = plain.shape[1]
    gamma = (features + 1) * UNIT_ROUNDOFF / (1 - (features + 1) * UNIT_ROUNDOFF)
    exact = plain.double()
    approx = quantized.double() * scales.double()[:, None]
    norms = exact.norm(dim=1) + approx.norm(dim=1)
    slack = 1.05 * ((exact - approx).norm(dim=1) + gamma * norms) + 16 * UNIT_ROUNDOFF * norms
    return _rounded_up(slack), _rounded_up(exact.norm(dim=1))


def _rounded_up(values: torch.Tensor) -> torch.Tensor:
    rounded = values.float()
    return torch.where(
        rounded.double() < values,
        torch.nextafter(rounded, torch.tensor(torch.inf, device=rounded.device)),
        rounded,
    )


def tree_rows(trees: Sequence[DraftTree]) -> Trees:
    """The rows of a pass's trees, back to back, as :class:`GreedyHead` reads them."""
    parents: list[int] = []
    tokens: list[int] = []
    for tree in trees:
        start = len(parents)
        parents += [parent + start if parent >= 0 else -1 for parent in tree.parents]
        tokens += tree.tokens
    return Trees(longs(parents), longs(tokens), len(trees))
