"""File helpers: JSONL reading reports damaged files as one-line errors; atomic writes are durable."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from reader_spec.files import json_lines, write_atomic


class InputError(Exception):
    """Stands for the error type each reader passes (PromptError, ReplayError)."""


LINES = [{"a": 1}, {"b": "two"}, {"c": [3]}]


def _gzipped(path: Path, text: str) -> Path:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.write(text)
    return path


def _jsonl(rows: list[object]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


@pytest.mark.parametrize("name", ["lines.jsonl", "lines.jsonl.gz"])
def test_lines_are_numbered_and_blank_ones_skipped(tmp_path, name):
    text = '{"a": 1}\n\n  \n{"b": "two"}\r\n{"c": [3]}'
    path = tmp_path / name
    if name.endswith(".gz"):
        _gzipped(path, text)
    else:
        path.write_text(text, encoding="utf-8", newline="")
    assert list(json_lines(path, InputError)) == [(1, LINES[0]), (4, LINES[1]), (5, LINES[2])]


def _truncated_gzip(path: Path) -> Path:
    rows = [{"text": f"line {i} " + "x" * 200} for i in range(2000)]
    data = gzip.compress(_jsonl(rows).encode())
    path.write_bytes(data[: len(data) // 2])
    return path


def _not_gzip(path: Path) -> Path:
    path.write_text(_jsonl(LINES))
    return path


def _damaged_deflate(path: Path) -> Path:
    data = bytearray(gzip.compress(_jsonl(LINES).encode()))
    data[12:20] = b"\xff" * 8
    path.write_bytes(bytes(data))
    return path


def _bad_utf8(path: Path) -> Path:
    path.write_bytes(_jsonl(LINES[:2]).encode() + b'{"text": "caf\xe9"}\n')
    return path


def _bad_utf8_gzip(path: Path) -> Path:
    path.write_bytes(gzip.compress(_jsonl(LINES[:2]).encode() + b'{"text": "caf\xe9"}\n'))
    return path


def _bad_json(path: Path) -> Path:
    path.write_text('{"a": 1}\n{"b": \n')
    return path


@pytest.mark.parametrize(
    ("name", "damage", "where", "message"),
    [
        ("cut.jsonl.gz", _truncated_gzip, None, "cut short"),
        ("plain.jsonl.gz", _not_gzip, ":1:", "Not a gzipped file"),
        ("damaged.jsonl.gz", _damaged_deflate, ":1:", "damaged or not gzip data"),
        ("latin1.jsonl", _bad_utf8, ":3:", "not UTF-8"),
        ("latin1.jsonl.gz", _bad_utf8_gzip, ":3:", "not UTF-8"),
        ("broken.jsonl", _bad_json, ":2:", "not valid JSON"),
    ],
)
def test_damaged_files_raise_the_callers_error_naming_the_line(tmp_path, name, damage, where, message):
    path = damage(tmp_path / name)
    read: list[int] = []
    with pytest.raises(InputError) as raised:
        read.extend(number for number, _ in json_lines(path, InputError))
    text = str(raised.value)
    assert text.startswith(f"{path}:") and message in text and "\n" not in text
    if where is None:  # a cut-off archive fails on the line after the last one read whole
        where = f":{read[-1] + 1}:"
        assert len(read) > 100
    assert where in text


def test_write_atomic_syncs_the_directory_after_the_rename(tmp_path, directory_fsyncs):
    synced = directory_fsyncs
    path = tmp_path / "sub" / "result.json"
    write_atomic(path, "new")
    assert path.read_text() == "new"
    assert synced == [path.parent.stat().st_ino]
    assert [p.name for p in path.parent.iterdir()] == ["result.json"]


def test_write_atomic_without_directory_sync_support(tmp_path, monkeypatch, directory_fsyncs):
    synced = directory_fsyncs
    monkeypatch.delattr(os, "O_DIRECTORY", raising=False)
    write_atomic(tmp_path / "result.bin", b"\x00\x01")
    assert (tmp_path / "result.bin").read_bytes() == b"\x00\x01" and synced == []


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "result.json"
    write_atomic(path, "old")

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_atomic(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["result.json"]
