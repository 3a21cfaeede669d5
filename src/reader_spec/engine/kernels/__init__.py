"""The fast runner's compiled CPU kernels (``torch.ops.reader_spec``), built as :mod:`reader_spec.compiled`
says: the matrix products of :mod:`reader_spec.engine.weights` (float32 in ``blocked_linear.cpp``, int8
in ``integer_product.cpp``, 4 or 8 bits per group of 32 inputs in ``grouped_product.cpp``), the
output layer's greedy argmax (``greedy_head.cpp``), the small operators between the products and
attention (``layer_ops.cpp``), and whole decoder layers of the Llama shape (``decoder_layer.cpp``).
Where they cannot be built, the runner uses PyTorch's own operators.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from reader_spec import compiled

SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "blocked_linear.cpp",
        "integer_product.cpp",
        "grouped_product.cpp",
        "greedy_head.cpp",
        "layer_ops.cpp",
        "decoder_layer.cpp",
    )
]
HEADERS = [Path(__file__).with_name("kernels.h")]
"""What the sources include: part of what identifies a build."""
BLOCK = 32
"""Output columns per weight block; must match ``kBlock`` in the source."""
PANEL = 16
"""Output columns per panel of a float32 block (two panels a block, one 64-byte line of each per k);
must match ``kPanel`` in ``kernels.h``."""
WEIGHT_GROUP = 32
"""Inputs per scale (and minimum) of weights quantized per group; must match ``kWeightGroup`` in
``kernels.h``."""


@cache
def available() -> bool:
    """Build (if needed) and load the kernel; False where that fails."""
    return compiled.load("reader_spec_kernels", SOURCES, python_module=False, headers=HEADERS) is not None
