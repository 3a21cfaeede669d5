"""READER's long-term source: a suffix array over a large tokenized corpus, searched in microseconds.

**Layout.** The corpus is one stream of 32-bit token ids, ``| doc1 | doc2 ... | docN |``, where the
separator ``|`` (``SEPARATOR = 2**32 - 1``) is never a token id (vocabularies above 65,536 work;
REST's 16-bit ids do not). Queries never contain it, so no match spans two documents, and
continuations stop at it.

**Why a suffix array of the reversed stream.** Drafting needs the *longest suffix* of the current text
that occurs in the corpus. Over the reversed stream that suffix, read backwards, is a prefix, so one
left-to-right narrowing pass finds it: extend the match one token further into the past, keep the
suffix-array range of entries that still agree, stop when it would become empty. Entries are stored
as forward positions (the position of the matched suffix's last token), so the token that follows an
occurrence is simply ``tokens[end + 1]``. The alternative, a forward suffix array, needs a separate
search per candidate suffix length.

**Why pydivsufsort.** It ships prebuilt wheels of libdivsufsort (O(n log n) worst case, fast in
practice, 32-bit indices below 2**31 bytes) and accepts integer arrays by encoding each symbol as
big-endian bytes. Separators are remapped to ``max token + 1`` before sorting (the order is unchanged),
so a vocabulary below 65,535 tokens sorts as 2-byte symbols rather than 4: half the bytes to sort
(measured builds: ``docs/bench/README.md``, Datastore). libsais would be faster but has no maintained
Python wheel; numpy prefix doubling needs O(log longest-repeat) full sorts, which corpora with
duplicated files make slow.

**Lookup speed.** While the suffix-array range is large, each narrowing step is two C-level bisects
(``bisect`` with a key) over memory-mapped arrays read through ``memoryview``; once it is small, one
vectorised numpy comparison finishes the match. Continuations of up to ``max_occurrences`` evenly
spaced occurrences are gathered in one numpy read and identical ones are counted together.

**On disk.** A directory with ``tokens.bin`` (little-endian uint32), ``suffix_array.bin`` (little-endian
int32, or int64 past 2**31 tokens) and ``meta.json`` (format version, tokenizer fingerprint, model,
counts, sources, build time, and each array's dtype, length, byte size and sha256). Arrays are opened
with ``numpy.memmap``: opening reads nothing but one pass over the suffix array that checks it (see
``Datastore.open``), and processes share pages. Builds write into a hidden sibling directory and rename
it into place only when complete, so an interrupted build leaves nothing that opens and never damages
the index it replaces; the next build of the same output removes what a killed one left.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import time
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from reader_spec.drafters.retrieval import native
from reader_spec.files import (
    file_sha256,
    fsync_directory,
    install_directory,
    staging_directory,
    sweep_stale_builds,
)

log = logging.getLogger(__name__)

FORMAT = "reader-spec-datastore"
FORMAT_VERSION = 1
SEPARATOR = 0xFFFF_FFFF
"""Document separator in the token stream; never a token id."""

TOKENS_FILE = "tokens.bin"
SUFFIX_ARRAY_FILE = "suffix_array.bin"
META_FILE = "meta.json"

_SCAN_BELOW = 256
"""Suffix-array ranges smaller than this are finished with one numpy comparison instead of bisects."""
_CORRUPT = "an entry points outside the token stream"
"""What both lookup paths raise (ValueError) on a suffix-array entry that no sound array holds."""
_HASH_BLOCK = 1 << 24


class DatastoreError(Exception):
    """A datastore that cannot be built or opened; the message is one line meant for the user."""


@dataclass(frozen=True)
class Lookup:
    """What followed the longest suffix of a context that occurs in the datastore.

    ``continuations`` pairs each distinct continuation (up to ``max_depth`` tokens, cut at a document's
    end) with how many of the ``sampled`` occurrences it follows, most frequent first; the form
    ``build_continuation_trie`` takes. Occurrences at a document's very end continue with nothing and
    are left out, so the counts add up to at most ``sampled``.
    """

    match_length: int
    """Tokens of the context's suffix that were found (0: not even the last token occurs)."""
    occurrences: int
    """How often that suffix occurs in the datastore."""
    sampled: int
    """Occurrences whose continuations were read: all of them, or ``max_occurrences`` evenly spaced."""
    continuations: tuple[tuple[tuple[int, ...], int], ...] = ()


NO_LOOKUP = Lookup(0, 0, 0)


@dataclass(frozen=True)
class ArrayFile:
    """One raw array of the datastore, as recorded in ``meta.json``."""

    dtype: str
    length: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Meta:
    """Provenance and integrity data of a datastore (``meta.json``)."""

    tokenizer_fingerprint: str
    model: str
    tokens: int
    """Corpus tokens, separators excluded."""
    documents: int
    files: dict[str, ArrayFile]
    sources: list[dict] = field(default_factory=list)
    built: str = ""
    """UTC time the build finished, ISO 8601."""
    build_seconds: float = 0.0
    format: str = FORMAT
    format_version: int = FORMAT_VERSION


class Datastore:
    """A token corpus with its suffix array, memory-mapped read-only; see the module docstring."""

    def __init__(self, path: Path, meta: Meta, tokens: np.ndarray, suffix_array: np.ndarray) -> None:
        self.path = path
        self.meta = meta
        self.tokens = tokens
        """The stream ``| doc1 | ... docN |`` (uint32, ``|`` the ``SEPARATOR``)."""
        self.suffix_array = suffix_array
        """Positions in ``tokens`` ordered by the reversed text ending there."""
        self._tok = _scalar_view(tokens, "I")
        self._sa = _scalar_view(suffix_array, "i" if suffix_array.dtype.itemsize == 4 else "q")

    def __len__(self) -> int:
        """Corpus tokens, separators excluded."""
        return self.meta.tokens

    def __repr__(self) -> str:
        return f"Datastore({str(self.path)!r}, tokens={self.meta.tokens}, documents={self.meta.documents})"

    @property
    def disk_bytes(self) -> int:
        """Bytes of the arrays and ``meta.json``."""
        return sum(info.bytes for info in self.meta.files.values()) + (self.path / META_FILE).stat().st_size

    # --- opening -----------------------------------------------------------------------------------
    @classmethod
    def open(
        cls, path: str | os.PathLike, *, fingerprint: str | None = None, verify: bool = False
    ) -> Datastore:
        """Open a datastore; raise :class:`DatastoreError` if it cannot serve this tokenizer.

        ``fingerprint`` (see ``loading.tokenizer_fingerprint``) must match the one it was built with;
        ``None`` skips the check. Sizes are always checked, and so are the token stream's end
        separators and the suffix array's least and greatest entries (a sorted permutation of the
        stream's positions): one sequential pass over the suffix array, a small fraction of a build,
        that refuses random damage before any lookup. ``verify`` also checks every checksum, which
        reads every byte. Damage these checks miss is caught by the lookups (see ``lookup_batch``).
        """
        path = Path(path)
        meta = read_meta(path)
        if fingerprint is not None and fingerprint != meta.tokenizer_fingerprint:
            raise DatastoreError(
                f"{path} was built for another tokenizer (fingerprint {meta.tokenizer_fingerprint}, "
                f"model {meta.model}), not this one ({fingerprint}): rebuild it with this model"
            )
        arrays = {}
        for name in (TOKENS_FILE, SUFFIX_ARRAY_FILE):
            info = meta.files[name]
            file = path / name
            try:
                size = file.stat().st_size
            except FileNotFoundError:
                raise DatastoreError(f"{path} is incomplete: {name} is missing; rebuild it") from None
            if size != info.bytes:
                state = "truncated" if size < info.bytes else "larger than recorded"
                raise DatastoreError(
                    f"{file} is {state} ({size} of {info.bytes} bytes); rebuild the datastore"
                )
            if verify and file_sha256(file) != info.sha256:
                raise DatastoreError(f"{file} is corrupt (checksum mismatch); rebuild the datastore")
            arrays[name] = np.memmap(file, dtype=np.dtype(info.dtype), mode="r", shape=(info.length,))
        tokens, suffix_array = arrays[TOKENS_FILE], arrays[SUFFIX_ARRAY_FILE]
        if tokens[0] != SEPARATOR or tokens[-1] != SEPARATOR:
            raise DatastoreError(
                f"{path / TOKENS_FILE} is corrupt (no document separator at both ends); rebuild the datastore"
            )
        if suffix_array.min() != 0 or suffix_array.max() != len(tokens) - 1:
            raise DatastoreError(
                f"{path / SUFFIX_ARRAY_FILE} is corrupt (entries outside the token stream); "
                "rebuild the datastore"
            )
        return cls(path, meta, tokens, suffix_array)

    # --- building ----------------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        output: str | os.PathLike,
        documents: Iterable[Sequence[int]],
        *,
        fingerprint: str,
        model: str,
        sources: Sequence[dict] = (),
    ) -> Datastore:
        """Index token-id documents into ``output`` and open the result.

        ``output`` may be missing, an empty directory or an existing datastore; it is replaced only
        once the new index is complete. ``sources`` is provenance stored as given in ``meta.json``.
        """
        started, started_at = time.perf_counter(), time.time()
        output = Path(output)
        sweep_stale_builds(output, started_at, restorable=lambda old: (old / META_FILE).is_file())
        check_output(output)
        stream, documents_count = _concatenate(documents)
        staging = staging_directory(output)
        try:
            files = {TOKENS_FILE: _write_array(staging / TOKENS_FILE, stream.astype("<u4", copy=False))}
            log.info("sorting the suffixes of %s tokens", f"{len(stream):,}")
            sa = _suffix_array(stream)
            del stream
            files[SUFFIX_ARRAY_FILE] = _write_array(staging / SUFFIX_ARRAY_FILE, sa)
            del sa
            meta = Meta(
                tokenizer_fingerprint=fingerprint,
                model=model,
                tokens=files[TOKENS_FILE].length - documents_count - 1,
                documents=documents_count,
                files=files,
                sources=list(sources),
                built=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                build_seconds=round(time.perf_counter() - started, 3),
            )
            _write_json(staging / META_FILE, asdict(meta))
            fsync_directory(staging)
            check_output(output)
            install_directory(staging, output)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return cls.open(output, fingerprint=fingerprint)

    # --- search ------------------------------------------------------------------------------------
    def lookup(
        self,
        context: Sequence[int],
        max_suffix: int = 32,
        max_occurrences: int = 64,
        max_depth: int = 16,
    ) -> Lookup:
        """Continuations of the longest suffix of ``context`` (at most ``max_suffix`` tokens) found here.

        Reads what follows up to ``max_occurrences`` of its occurrences, evenly spaced over all of them
        (a stratified sample, ordered by the text before the match), ``max_depth`` tokens each.
        """
        return self.lookup_batch([context], max_suffix, max_occurrences, max_depth)[0]

    def lookup_batch(
        self,
        contexts: Sequence[Sequence[int]],
        max_suffix: int = 32,
        max_occurrences: int = 64,
        max_depth: int = 16,
    ) -> list[Lookup]:
        """``lookup`` of every context of a batch; the compiled core searches them in parallel.

        Every suffix-array entry is checked before it is used as a position, on both paths, so a
        suffix array damaged past ``open``'s checks raises :class:`DatastoreError` instead of
        reading outside the arrays (the compiled core would crash the process).
        """
        if max_suffix < 1 or max_occurrences < 1 or max_depth < 1:
            raise ValueError("max_suffix, max_occurrences and max_depth must be at least 1")
        queries = [_query(context, max_suffix) for context in contexts]
        core = native.core()
        try:
            if core is None or sys.byteorder != "little":
                return [self._lookup(query, max_occurrences, max_depth) for query in queries]
            found = core.lookup(self.tokens, self.suffix_array, queries, max_occurrences, max_depth)
        except ValueError as e:  # the queries are valid by now: only a corrupt array is left to blame
            raise DatastoreError(
                f"{self.path / SUFFIX_ARRAY_FILE} is corrupt ({e}); rebuild the datastore"
            ) from None
        return [Lookup(*one) if one[0] else NO_LOOKUP for one in found]

    def _lookup(self, query: list[int], max_occurrences: int, max_depth: int) -> Lookup:
        lo, hi, length = self._longest_suffix(query)
        if length == 0:
            return NO_LOOKUP
        total = hi - lo
        sampled = min(max_occurrences, total)
        picks = lo + (np.arange(sampled, dtype=np.int64) * total) // sampled
        ends = self._ends(self.suffix_array[picks], length)
        last = len(self.tokens) - 1  # always a separator
        window = self.tokens[np.minimum(ends[:, None] + np.arange(1, max_depth + 1), last)]
        stops = window == SEPARATOR
        cuts = np.where(stops.any(axis=1), stops.argmax(axis=1), max_depth).tolist()
        counts: dict[tuple[int, ...], int] = {}
        for row, cut in zip(window.tolist(), cuts, strict=True):
            if cut:
                key = tuple(row[:cut])
                counts[key] = counts.get(key, 0) + 1
        ranked = sorted(counts.items(), key=lambda item: -item[1])  # stable: ties keep suffix-array order
        return Lookup(length, total, sampled, tuple(ranked))

    def _longest_suffix(self, query: list[int]) -> tuple[int, int, int]:
        """Suffix-array range ``[lo, hi)`` of the longest suffix of ``query`` found, and its length.

        Invariant: every entry in the range ends with the last ``length`` query tokens, and within
        the range the token ``length`` places back is sorted, so bisecting on it narrows the match.
        (The compiled core bisects all the way; a small range is finished here by one scan.)
        """
        tok, sa = self._tok, self._sa
        lo, hi, length = 0, len(sa), 0
        while length < len(query):
            if hi - lo < _SCAN_BELOW:
                return self._finish_by_scan(query, lo, hi, length)
            token, back = query[-1 - length], length

            def key(end: int, back: int = back, size: int = len(tok)) -> int:
                if not back <= end < size:
                    raise ValueError(_CORRUPT)
                return tok[end - back]

            a = bisect_left(sa, token, lo, hi, key=key)
            b = bisect_right(sa, token, a, hi, key=key)
            if a == b:
                break
            lo, hi, length = a, b, length + 1
        return lo, hi, length

    def _finish_by_scan(self, query: list[int], lo: int, hi: int, length: int) -> tuple[int, int, int]:
        """Extend a match over a small range at once: the longest agreeing entries are contiguous."""
        rest = np.array(query[: len(query) - length][::-1], dtype=np.int64)  # next tokens back, nearest first
        ends = self._ends(self.suffix_array[lo:hi], length)
        back = np.arange(length, len(query), dtype=np.int64)
        # Entries agree on `length` non-separator tokens, so each has a separator at or after index 0
        # before any index the clip could alter; the first disagreement comes no later than it.
        agree = self.tokens[np.maximum(ends[:, None] - back, 0)] == rest
        runs = np.where(agree.all(axis=1), len(rest), agree.argmin(axis=1))
        best = int(runs.max())
        if best == 0:
            return lo, hi, length
        rows = np.flatnonzero(runs == best)
        return lo + int(rows[0]), lo + int(rows[-1]) + 1, length + best

    def _ends(self, entries: np.ndarray, matched: int) -> np.ndarray:
        """Suffix-array entries as int64 positions, checked as the compiled core checks them: an
        entry read while ``matched`` tokens agree must lie in ``[matched, len(tokens))`` (a match of
        ``matched`` tokens cannot end sooner: position 0 is a separator)."""
        ends = entries.astype(np.int64)
        if len(ends) and (ends.min() < matched or ends.max() >= len(self.tokens)):
            raise ValueError(_CORRUPT)
        return ends


def _query(context: Sequence[int], max_suffix: int) -> list[int]:
    """The context's last ``max_suffix`` tokens, after its last non-token-id (a barrier: nothing
    before it can match)."""
    query = [int(t) for t in context[-max_suffix:]]
    if query and (min(query) < 0 or max(query) >= SEPARATOR):
        query = query[max(i for i, t in enumerate(query) if not 0 <= t < SEPARATOR) + 1 :]
    return query


# --- reading ---------------------------------------------------------------------------------------
def read_meta(path: Path) -> Meta:
    """The checked ``meta.json`` of a datastore directory."""
    if not path.is_dir():
        raise DatastoreError(f"no datastore at {path}")
    try:
        raw = json.loads((path / META_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DatastoreError(f"{path} is not a datastore (no {META_FILE})") from None
    except (OSError, ValueError) as e:
        raise DatastoreError(f"{path / META_FILE} is unreadable or damaged: {e}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise DatastoreError(f"{path} is not a reader-spec datastore")
    version = raw.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise DatastoreError(
            f"{path} has format version {version}; this reader-spec reads up to {FORMAT_VERSION}: upgrade it"
        )
    try:
        files = {name: ArrayFile(**raw["files"][name]) for name in (TOKENS_FILE, SUFFIX_ARRAY_FILE)}
        known = {k: v for k, v in raw.items() if k in Meta.__dataclass_fields__}
        meta = Meta(**{**known, "files": files})
        lengths = {info.length for info in files.values()}
        if len(lengths) != 1 or min(lengths) < 3:  # the smallest stream is a separator, a token, a separator
            raise ValueError("array lengths disagree")
        for info in files.values():
            if np.dtype(info.dtype).itemsize * info.length != info.bytes:
                raise ValueError("array sizes disagree")
    except (KeyError, TypeError, ValueError) as e:
        raise DatastoreError(f"{path / META_FILE} is damaged ({type(e).__name__}: {e})") from None
    return meta


def _scalar_view(array: np.ndarray, code: str) -> Sequence[int]:
    """Python-int indexing of a little-endian array: ``memoryview`` is ~5x faster than numpy scalars."""
    if sys.byteorder == "little":
        return memoryview(array).cast("B").cast(code)
    return array  # numpy converts the byte order; slower, still correct


# --- building --------------------------------------------------------------------------------------
def _concatenate(documents: Iterable[Sequence[int]]) -> tuple[np.ndarray, int]:
    """The separated stream (uint32) and the number of non-empty documents."""
    parts: list[np.ndarray] = []
    for number, document in enumerate(documents, 1):
        ids = np.asarray(document, dtype=np.int64)
        if ids.ndim != 1:
            raise DatastoreError(f"document {number} is not a flat sequence of token ids")
        if len(ids) == 0:
            continue
        if ids.min() < 0 or ids.max() >= SEPARATOR:
            raise DatastoreError(f"document {number} has a token id outside [0, {SEPARATOR})")
        parts.append(ids.astype(np.uint32))
    if not parts:
        raise DatastoreError("no tokens to index: every document is empty")
    stream = np.full(sum(len(p) for p in parts) + len(parts) + 1, SEPARATOR, dtype=np.uint32)
    at = 1
    for part in parts:
        stream[at : at + len(part)] = part
        at += len(part) + 1
    return stream, len(parts)


def _suffix_array(stream: np.ndarray) -> np.ndarray:
    """Forward end positions of the stream's tokens, sorted by the reversed text ending there."""
    from pydivsufsort import divsufsort

    reversed_stream = stream[::-1].copy()
    top = int(reversed_stream[reversed_stream != SEPARATOR].max())
    reversed_stream[reversed_stream == SEPARATOR] = top + 1  # same order, smaller symbols to sort
    order = divsufsort(reversed_stream)
    del reversed_stream
    ends = order.astype("<i4" if len(stream) <= np.iinfo(np.int32).max else "<i8", copy=False)
    np.subtract(len(stream) - 1, ends, out=ends)
    return ends


def _write_array(path: Path, array: np.ndarray) -> ArrayFile:
    """Write raw bytes, hashing them on the way, and flush them to disk."""
    digest = hashlib.sha256()
    data = memoryview(np.ascontiguousarray(array)).cast("B")
    with open(path, "wb") as f:
        for start in range(0, len(data), _HASH_BLOCK):
            block = data[start : start + _HASH_BLOCK]
            digest.update(block)
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    return ArrayFile(array.dtype.str, len(array), len(data), digest.hexdigest())


def _write_json(path: Path, payload: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def check_output(output: Path) -> None:
    """Refuse to replace anything but an empty directory or a datastore (a typo must not cost data)."""
    if not output.exists() and not output.is_symlink():
        return
    if output.is_dir() and not output.is_symlink():
        if not any(output.iterdir()):
            return
        try:
            if json.loads((output / META_FILE).read_text(encoding="utf-8")).get("format") == FORMAT:
                return
        except (OSError, ValueError, AttributeError):
            pass
    raise DatastoreError(f"{output} exists and is not a datastore; choose another output")
