"""The fast runner's compiled CPU kernel (``torch.ops.reader_spec``), built as :mod:`reader_spec.compiled`
says. Where it cannot be built, the runner uses PyTorch's own kernels on the same weight layout.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from reader_spec import compiled

SOURCES = [Path(__file__).with_name("blocked_linear.cpp")]
BLOCK = 32
"""Output columns per weight block; must match ``kBlock`` in the source."""


@cache
def available() -> bool:
    """Build (if needed) and load the kernel; False where that fails."""
    return compiled.load("reader_spec_kernels", SOURCES, python_module=False) is not None
