"""The output layer's argmax for greedy requests, without reading the whole float32 matrix.

Greedy decoding needs one thing from a pass's output layer: the token with the largest logit. That
layer is the largest matrix of a small model (49,152 x 576 in SmolLM2-135M, a fifth of its weights),
and a pass of a few tokens costs what reading it costs. :class:`GreedyHead` keeps an int8 copy of the
matrix (a quarter of the bytes) and, per column, a bound on how far the int8 logit can be from the
float32 one; float32 logits are then computed only for the columns that can still be the largest (a
handful on real text), by the same compiled tile as the full product. The token is the full
product's argmax bit for bit, ties included (the first of equal maxima, as ``torch.argmax``), so
greedy outputs do not change. At many rows (a large batch) the int8 product is no longer cheaper
than the float32 one; which of the two runs is timed once per row bucket, as the kernels are.

The bound. For column j with float32 weights ``W_j``, int8 copy ``q_j`` and scale ``s_j`` (quantization
error ``e_j = W_j - s_j q_j``), and a hidden state ``h`` of K features, the float32 logit and the int8
one each differ from their exact dot product by at most ``gamma |h| |W_j|`` and ``gamma |h| |s_j q_j|``
(rounding of a K-term dot product in any order, ``gamma = (K + 1) u / (1 - (K + 1) u)``, ``u = 2^-24``),
and
the two dot products by at most ``|h| |e_j|`` (Cauchy-Schwarz). ``slack_j`` is their sum with 5% and
``16 u (|W_j| + |s_j q_j|)`` to spare for the rounding of the comparison itself (float32, at most 4
roundings of terms below ``|h| (|W_j| + |s_j q_j|)``), rounded up to float32.
"""

from __future__ import annotations

import torch

from reader_spec.engine import kernels
from reader_spec.engine.memory import PageArena
from reader_spec.engine.weights import BLOCK, ROW_BUCKETS, PackedLinear, fastest, quantize_int8

UNIT_ROUNDOFF = 2.0**-24
CHUNK_BLOCKS = 128
"""Blocks of 32 columns quantized at a time: a few MB of temporaries, never a whole float copy."""


class GreedyHead:
    """``argmax(head(hidden), -1)`` for a float32 output layer, reading an int8 copy and a few columns."""

    def __init__(self, head: PackedLinear):
        self.head = head
        blocks, features, _ = head.weight.shape
        self.quantized = PageArena(head.weight.numel()).empty(head.weight.shape, torch.int8)
        self.scales = torch.empty(blocks * BLOCK)
        self.slack = torch.empty(blocks * BLOCK)
        for first in range(0, blocks, CHUNK_BLOCKS):
            chunk = head.weight[first : first + CHUNK_BLOCKS]  # padding columns are zero: q 0, slack 0
            plain = chunk.transpose(1, 2).reshape(-1, features)
            quantized, scales = quantize_int8(plain)
            columns = slice(first * BLOCK, first * BLOCK + plain.shape[0])
            self.scales[columns] = scales
            self.slack[columns] = _slack(plain, quantized, scales)
            self.quantized[first : first + CHUNK_BLOCKS] = quantized.view(-1, BLOCK, features).transpose(1, 2)
        self._wins_by_bucket: dict[int, bool] = {}
        """Whether the int8 copy beats the whole float32 layer at that row bucket (timed once)."""

    @staticmethod
    def applies(head: PackedLinear) -> bool:
        """Whether this head can run it: float32 in column blocks, no bias, the compiled kernels built."""
        return head.blocked and head.scales is None and head.bias is None and kernels.available()

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """The argmax token of each row of ``hidden`` (``[rows, in]``): ``[rows]``, long."""
        if not self._wins(hidden.shape[0]):
            return self.head(hidden).argmax(-1)
        tokens = self._bounded(hidden)
        unbounded = tokens < 0  # a row with inf or NaN: its bound says nothing, take the full product
        if unbounded.any():
            tokens[unbounded] = self.head(hidden[unbounded]).argmax(-1)
        return tokens

    def _bounded(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.ops.reader_spec.greedy_tokens(
            hidden, self.head.weight, self.quantized, self.scales, self.slack, self.head.out_features
        )

    def _wins(self, rows: int) -> bool:
        bucket = next((b for b in ROW_BUCKETS if b >= rows), None)
        if bucket is None:
            return False
        wins = self._wins_by_bucket.get(bucket)
        if wins is None:
            generator = torch.Generator().manual_seed(0)  # not the caller's random state
            hidden = torch.randn(bucket, self.head.in_features, generator=generator)
            with torch.inference_mode():
                wins = fastest([lambda: self._bounded(hidden), lambda: self.head(hidden).argmax(-1)]) == 0
            self._wins_by_bucket[bucket] = wins
        return wins


def _slack(plain: torch.Tensor, quantized: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Each column's bound per unit of ``|h|`` (see the module's docstring), rounded up to float32."""
    features = plain.shape[1]
    gamma = (features + 1) * UNIT_ROUNDOFF / (1 - (features + 1) * UNIT_ROUNDOFF)
    exact = plain.double()
    approx = quantized.double() * scales.double()[:, None]
    norms = exact.norm(dim=1) + approx.norm(dim=1)
    slack = 1.05 * ((exact - approx).norm(dim=1) + gamma * norms) + 16 * UNIT_ROUNDOFF * norms
    rounded = slack.float()
    return torch.where(rounded.double() < slack, torch.nextafter(rounded, torch.tensor(torch.inf)), rounded)
