"""File helpers every part shares: the cache directory, atomic writes, JSONL lines, content hashes."""

from __future__ import annotations

import errno
import gzip
import hashlib
import json
import os
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path

HASH_BLOCK = 1 << 20


def cache_root() -> Path:
    """Where measured costs, de-quantized weights and tokenized replays are kept between runs.

    ``READER_SPEC_CACHE`` overrides the user cache directory (tests and CI point it at a fresh one).
    """
    override = os.environ.get("READER_SPEC_CACHE")
    if override:
        return Path(override)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("reader-spec"))


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write through a temporary file in the same directory, so readers never see half a file.

    The temporary file is removed when anything fails; the result gets the permissions a plain
    ``open`` would give (``mkstemp``'s 0600 would make results private to their writer).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def fsync_directory(path: Path) -> None:
    """Make the renames into a directory survive a power cut: POSIX keeps a file's name in its
    directory, which syncing the file does not write. Skipped where directories cannot be opened
    (no ``os.O_DIRECTORY``: Windows) or synced (``EINVAL``: some network and FUSE file systems)."""
    flag = getattr(os, "O_DIRECTORY", None)
    if flag is None:
        return
    fd = os.open(path, os.O_RDONLY | flag)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    finally:
        os.close(fd)


def json_lines(path: str | Path, error: type[Exception]) -> Iterator[tuple[int, object]]:
    """Each non-blank line of a JSONL file (gzipped when the name ends in .gz), parsed, with its number.

    A line that is not JSON or not UTF-8, and a .gz file that is damaged or cut short, raise ``error``
    naming the file and line, so every reader reports alike. Lines are read as bytes and decoded one
    by one, so a bad byte is blamed on its own line (a text stream decodes ahead, a block at a time).
    """
    opener = gzip.open if Path(path).suffix == ".gz" else open
    with opener(path, "rb") as f:
        number = 0
        while True:
            number += 1
            try:
                raw = f.readline()
                line = raw.decode("utf-8")
            except EOFError:
                raise error(f"{path}:{number}: the gzip data is cut short (an incomplete file)") from None
            except (gzip.BadGzipFile, zlib.error) as e:
                raise error(f"{path}:{number}: damaged or not gzip data ({e})") from None
            except UnicodeDecodeError as e:
                raise error(f"{path}:{number}: not UTF-8 text (byte {e.start + 1} of the line)") from None
            if not raw:
                return
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}:{number}: not valid JSON ({e.msg})") from None
            yield number, record


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(HASH_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()
