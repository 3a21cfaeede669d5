"""The engine's compiled CPU kernel, built once per machine with the C++ compiler PyTorch uses.

``make`` builds it (``python -m reader_spec.engine.kernels``); otherwise the first fast runner on a
CPU builds it (about ten seconds) into the cache directory, keyed by the source, the PyTorch version
and the CPU it was built for. Where it cannot be built (no compiler), the runner uses PyTorch's own
kernels on the same weight layout and says so once.
"""

from __future__ import annotations

import hashlib
import logging
import platform
from functools import cache
from pathlib import Path

import torch

from reader_spec.files import cache_root

SOURCES = [Path(__file__).with_name("blocked_linear.cpp")]
BLOCK = 32
"""Output columns per weight block; must match ``kBlock`` in the source."""

log = logging.getLogger(__name__)


def build_directory() -> Path:
    key = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES))
    key.update(torch.__version__.encode() + _cpu_flags().encode())
    return cache_root() / "kernels" / key.hexdigest()[:16]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


_loaded_from: Path | None = None
"""Where this process loaded the kernel from: a library registering ``reader_spec`` ops may be loaded
once per process (a second file, e.g. built under another cache directory, aborts the process)."""


@cache
def available() -> bool:
    """Build (if needed) and load the kernel (``torch.ops.reader_spec``); False, said once, where
    that fails."""
    from torch.utils.cpp_extension import load

    global _loaded_from
    directory = _loaded_from or build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        load(
            name="reader_spec_kernels",
            sources=[str(s) for s in SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
        )
    except Exception as error:  # any build failure leaves PyTorch's kernels, which are exact too
        log.warning("the compiled CPU kernel could not be built (%s); using PyTorch's", error)
        return False
    _loaded_from = directory
    return True
