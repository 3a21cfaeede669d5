"""The fast runner's compiled CPU kernels (``torch.ops.reader_spec``), built as :mod:`reader_spec.compiled`
says: the matrix products of :mod:`reader_spec.engine.weights` and the small operators between them
(``layer_ops.cpp``). Where they cannot be built, the runner uses PyTorch's own operators.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from reader_spec import compiled

SOURCES = [Path(__file__).with_name(name) for name in ("blocked_linear.cpp", "layer_ops.cpp")]
BLOCK = 32
"""Output columns per weight block; must match ``kBlock`` in the source."""


@cache
def available() -> bool:
    """Build (if needed) and load the kernel; False where that fails."""
    return compiled.load("reader_spec_kernels", SOURCES, python_module=False) is not None
