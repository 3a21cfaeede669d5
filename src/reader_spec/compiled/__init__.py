"""The project's compiled parts, built once per machine with the C++ compiler PyTorch uses.

Two parts are compiled: the fast runner's CPU kernels (``engine/kernels``: matrix products and the
operators between them) and the retrieval core that drafting's hot loops run in
(``drafters/retrieval/native``). ``make`` builds both
(``python -m reader_spec.compiled``); otherwise the first use builds each (seconds) into the cache
directory, keyed by its sources, the PyTorch version and the CPU it was built for. Where a part
cannot be built (no compiler), the code that uses it runs its pure Python or PyTorch path, which
gives the same results, and says so once.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from types import ModuleType

from reader_spec.files import cache_root
from reader_spec.machine import cpu_flags

log = logging.getLogger(__name__)

_loaded_from: dict[str, Path] = {}
"""Where this process loaded each part from: a library registering ops may be loaded once per process
(a second file, e.g. built under another cache directory, aborts the process)."""


def build_directory(name: str, sources: list[Path], headers: list[Path] = ()) -> Path:
    import torch

    key = hashlib.sha256(b"".join(s.read_bytes() for s in [*sources, *headers]))
    key.update(torch.__version__.encode() + cpu_flags().encode())
    return cache_root() / "kernels" / f"{name}-{key.hexdigest()[:16]}"


def load(
    name: str, sources: list[Path], *, python_module: bool, headers: list[Path] = ()
) -> ModuleType | bool | None:
    """Build (if needed) and load one part: the module where ``python_module``, else True once its
    ops are registered; None (said once by the caller's fallback) where the build fails. ``headers``:
    files the sources include, which identify the build with them."""
    from torch.utils.cpp_extension import load as load_extension

    directory = _loaded_from.get(name) or build_directory(name, sources, headers)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        loaded = load_extension(
            name=name,
            sources=[str(s) for s in sources],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=python_module,
        )
    except Exception as error:  # any build failure leaves the pure paths, which give the same results
        log.warning("the compiled part %s could not be built (%s); using the pure path", name, error)
        return None
    _loaded_from[name] = directory
    return loaded if python_module else True
