"""File helpers every part shares: the cache directory, atomic writes of files and directories, JSONL
lines, content hashes."""

from __future__ import annotations

import errno
import gzip
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

HASH_BLOCK = 1 << 20

log = logging.getLogger(__name__)


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


# --- directories built beside their destination and moved in whole ---------------------------------
def staging_directory(output: Path) -> Path:
    """A hidden directory beside ``output`` to build it in (same file system: the move is a rename),
    named for ``output`` and this process so that a later build can tell it was left by a kill."""
    output.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=output.parent, prefix=_sibling_prefix(output, "building")))


def install_directory(staging: Path, output: Path) -> None:
    """Move a finished directory into place; an existing ``output`` is removed only after the swap.

    POSIX cannot swap two directories atomically, so an existing one is renamed aside, then the new
    one in: between the two renames (two system calls) ``output`` is missing. A failure of the second
    rename puts the old one back at once; a kill between them leaves it in the ``.old-`` sibling,
    which the next build of ``output`` moves back before anything else (:func:`sweep_stale_builds`).
    """
    if not output.exists():
        os.replace(staging, output)
        fsync_directory(output.parent)
        return
    old = Path(tempfile.mkdtemp(dir=output.parent, prefix=_sibling_prefix(output, "old")))
    os.replace(output, old)  # an empty directory is replaced by a rename
    try:
        os.replace(staging, output)
    except BaseException:
        os.replace(old, output)
        raise
    fsync_directory(output.parent)
    shutil.rmtree(old, ignore_errors=True)


def sweep_stale_builds(output: Path, started_at: float, restorable: Callable[[Path], bool]) -> None:
    """Remove the ``.building-`` and ``.old-`` siblings that killed builds of ``output`` left.

    A sibling is stale when the process named in it no longer runs: a build that is still running
    keeps its own, and a pid reused since then only delays the removal. A sibling without a pid (from
    versions that did not record it) is stale when it is older than this build (``started_at``, a
    ``time.time()``). POSIX only: elsewhere no process can be asked whether it runs, and nothing is
    removed. Two machines building one output on a shared file system at the same time are not
    supported (each sees the other's pid as gone). If ``output`` is missing and a stale ``.old-``
    sibling is ``restorable`` (complete), a kill hit :func:`install_directory` between its renames:
    that sibling is moved back to ``output`` instead of being removed.
    """
    if os.name != "posix" or not output.parent.is_dir():
        return
    pattern = re.compile(rf"\.{re.escape(output.name)}\.(building|old)-(?:(\d+)-)?\w+")
    stale: list[tuple[str, Path]] = []
    for sibling in output.parent.iterdir():
        found = pattern.fullmatch(sibling.name)
        if not found or not sibling.is_dir() or sibling.is_symlink():
            continue
        pid = found.group(2)
        live = _running(int(pid)) if pid else sibling.stat().st_mtime >= started_at
        if not live:
            stale.append((found.group(1), sibling))
    previous = [s for kind, s in stale if kind == "old" and restorable(s)]
    if previous and not output.exists() and not output.is_symlink():
        kept = max(previous, key=lambda s: s.stat().st_mtime)
        log.warning("restoring %s, which a killed build had moved aside", output)
        os.replace(kept, output)
        fsync_directory(output.parent)
        stale.remove(("old", kept))
    for _, sibling in stale:
        log.info("removing %s, left by a killed build", sibling)
        shutil.rmtree(sibling, ignore_errors=True)


def _sibling_prefix(output: Path, kind: str) -> str:
    """Hidden working directories beside ``output`` name their kind and the process that owns them."""
    return f".{output.name}.{kind}-{os.getpid()}-"


def _running(pid: int) -> bool:
    """Whether a process with this id runs on this machine (signal 0 only checks)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True
