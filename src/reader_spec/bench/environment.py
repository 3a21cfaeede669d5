"""What a benchmark's report says about where it ran: the machine, the software, the commit, and the
process's peak resident memory."""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch
import transformers

from reader_spec.engine import kernels
from reader_spec.engine.runner import device_description, forward_fingerprint
from reader_spec.loading import LoadedModel
from reader_spec.machine import cpu_id, cpu_name


def reset_peak_rss(hand_back: bool = True) -> bool:
    """Restart the kernel's resident-set high-water mark (Linux), so that a peak belongs to one run.

    Memory an earlier run freed stays resident inside the allocator unless handed back first
    (``hand_back``; too slow between the steps of methods taking turns)."""
    if hand_back:
        gc.collect()
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_mib() -> float:
    """The process's resident-set high-water mark since the last reset, else over its lifetime."""
    try:
        found = re.search(r"^VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        found = None
    if found:
        return int(found.group(1)) / 1024
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS, KiB elsewhere
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def environment(loaded: LoadedModel, draft: LoadedModel | None = None) -> dict:
    return {
        "cpu": cpu_name(),
        "cpu_id": cpu_id(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": loaded.name,
        "draft_model": draft.name if draft is not None else None,
        "dtype": str(loaded.model.dtype),
        "device": device_description(loaded.model.device),
        "compiled_kernels": kernels.available(),
        "forward": forward_fingerprint(),
        "commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def git_commit() -> str:
    """The source checkout's commit, ``-dirty`` when it has changes; empty outside a checkout."""
    try:
        result = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=12"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        return ""
    return result.stdout.strip() if result.returncode == 0 else ""
