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
from typing import Protocol

from reader_spec import compiled

SOURCES = [Path(__file__).with_name("native.cpp")]

log = logging.getLogger(__name__)


class NgramTable(Protocol):
    """The core's ``NgramTable`` (``native.cpp``) as type checkers see it: the compiled module has no
    stubs. Matches are ``(length, end)`` pairs, as ``ngram_index.Match`` holds them."""

    def __len__(self) -> int: ...
    def append(self, tokens: list[int]) -> None: ...
    def own_match(self, length: int) -> tuple[int, int]: ...
    def longest_match(self, query: list[int]) -> tuple[int, int]: ...
    def occurrences(self, length: int, end: int, limit: int) -> list[int]: ...
    def continuations(
        self, length: int, end: int, limit: int, max_depth: int, stop: int
    ) -> list[tuple[list[int], float]]: ...
    def copy(self) -> NgramTable: ...


@cache
def core() -> ModuleType | None:
    """The compiled module, built if needed; None where it cannot be built or is switched off."""
    if os.environ.get("READER_SPEC_PURE") == "1":
        return None
    module = compiled.load("reader_spec_retrieval", SOURCES, python_module=True)
    if module is None:
        log.warning("drafting runs in pure Python: slower, same drafts")
    return module
