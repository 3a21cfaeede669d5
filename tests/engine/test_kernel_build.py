"""The compiled kernels keep their sixteen-lane vectors in registers on every x86 level they build for.

GCC stores a vector type wider than the target's registers in memory and expands each operation on it
piece by piece; on an AVX2 CPU that made every kernel about ten times slower, with the same results, so
no test of results could notice. This compiles each source for AVX2 and for AVX-512 with GCC's warning
for such expansion and requires none. PyTorch's headers, most of each compile, are parsed once per
level into a precompiled header.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

from reader_spec.engine import kernels

LEVELS = {"AVX2": "x86-64-v3", "AVX-512": "x86-64-v4"}


def _compiler() -> str:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        pytest.fail(f"no C++ compiler ({compiler}): make builds the kernels with it")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    if "Free Software Foundation" not in version:
        pytest.skip("the warning checked here is GCC's")
    return compiler


def _flags(level: str) -> list[str]:
    flags = ["-O1", f"-march={LEVELS[level]}", "-std=c++17", "-fopenmp", "-Wvector-operation-performance"]
    return flags + [f"-I{path}" for path in include_paths()]


@pytest.fixture(scope="module")
def torch_headers(tmp_path_factory) -> dict[str, Path]:
    """Per level, a header of the sources' PyTorch includes, precompiled (both levels at once)."""
    compiler = _compiler()
    headers = {level: tmp_path_factory.mktemp(level) / "torch_headers.h" for level in LEVELS}
    builds = []
    for level, header in headers.items():
        header.write_text("".join(sorted(set(_torch_includes()))))
        command = [compiler, *_flags(level), "-x", "c++-header", str(header)]
        builds.append(subprocess.Popen(command, stderr=subprocess.PIPE, text=True))
    for build in builds:
        _, errors = build.communicate()
        assert build.returncode == 0, errors[-2000:]
    return headers


@pytest.mark.parametrize("level", list(LEVELS))
def test_no_vector_operation_is_expanded_piecewise(level, torch_headers):
    compiler, header = _compiler(), torch_headers[level]
    runs = [
        subprocess.Popen(
            [compiler, *_flags(level), "-include", str(header), "-Winvalid-pch", "-S", str(source)],
            cwd=header.parent,
            stderr=subprocess.PIPE,
            text=True,
        )
        for source in kernels.SOURCES
    ]
    for source, run in zip(kernels.SOURCES, runs, strict=True):
        _, errors = run.communicate()
        assert run.returncode == 0, f"{source.name} does not build for {level}:\n{errors[-2000:]}"
        assert "invalid-pch" not in errors, errors[-2000:]  # the precompiled header was used
        expanded = [line for line in errors.splitlines() if "expanded piecewise" in line]
        assert not expanded, f"{source.name} for {level}:\n" + "\n".join(expanded[:5])


def _torch_includes() -> list[str]:
    """The sources' own PyTorch includes, as lines."""
    pattern = re.compile(r"^#include <(?:ATen|c10|torch)/.*>$", re.MULTILINE)
    return [
        f"{line}\n"
        for path in [*kernels.SOURCES, *kernels.HEADERS]
        for line in pattern.findall(path.read_text())
    ]
