"""The retrieval core compiled from ``native.cpp`` (see :mod:`reader_spec.compiled`): drafting's hot
loops at C++ speed, with the same results as the pure Python functions it replaces.

``READER_SPEC_PURE=1`` keeps the pure Python paths (for comparison; tests run both).
"""

from __future__ import annotations

import logging
import os
from functools import cache
from pathlib import Path
from types import ModuleType

from reader_spec import compiled

SOURCES = [Path(__file__).with_name("native.cpp")]

log = logging.getLogger(__name__)


@cache
def core() -> ModuleType | None:
    """The compiled module, built if needed; None where it cannot be built or is switched off."""
    if os.environ.get("READER_SPEC_PURE") == "1":
        return None
    module = compiled.load("reader_spec_retrieval", SOURCES, python_module=True)
    if module is None:
        log.warning("drafting runs in pure Python: slower, same drafts")
    return module
