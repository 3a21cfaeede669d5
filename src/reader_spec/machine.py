"""Which processor this is: what keys the compiled parts and measured costs, and labels results.

Under a hypervisor the model name is often only the vendor's line ("AMD EPYC"), shared by hosts of
different generations and matrix rates, so the family and model numbers and the feature flags say
more; a cache directory can also outlive its machine (a home directory shared by several hosts).
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def cpuinfo_fields(cpuinfo: Path = CPUINFO) -> dict[str, str]:
    """The first processor's ``key: value`` lines of ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, colon, value = line.partition(":")
        if not colon:
            if fields:  # a blank line ends the first processor's block
                break
            continue
        fields.setdefault(key.strip(), value.strip())
    return fields


@functools.cache
def _fields() -> dict[str, str]:
    return cpuinfo_fields()


def cpu_name() -> str:
    """The processor's model name, else what the platform says."""
    return _fields().get("model name") or platform.processor() or platform.machine()


def cpu_id(fields: dict[str, str] | None = None) -> str:
    """Family and model numbers ("family 23 model 1"); empty where the architecture has none."""
    fields = _fields() if fields is None else fields
    if "cpu family" not in fields or "model" not in fields:
        return ""
    return f"family {fields['cpu family']} model {fields['model']}"


def cpu_flags() -> str:
    """The processor's feature flags (what a compiled kernel may use), else the platform's name."""
    return _fields().get("flags") or platform.processor()


def cpu_key() -> str:
    """One line that tells this processor from others: name, family and model, and flags."""
    return f"{platform.machine()}|{cpu_name()}|{cpu_id()}|{cpu_flags()}"
