"""``reader bench-serve`` on the tiny model: the server under concurrent streaming load, on and off."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from reader_spec.bench.serve_load import run_serve_load
from reader_spec.budget.costs import CostModel
from reader_spec.cli import main

PROMPTS = ["w5 w6 w7 w5 w6 w7 w5 w6", "w20 w21 w22 w20 w21 w22 w20", "w30 w31 w30 w31 w30 w31", "w8 w9 w8"]
MAX_NEW = 8
FLAT_COSTS = CostModel(measure=lambda batch, drafted, context: dict.fromkeys(drafted, 1.0))


@pytest.fixture(scope="module")
def report(tiny, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("READER_SPEC_CACHE", str(tmp_path_factory.mktemp("cache")))
        conversations = [[p] for p in PROMPTS]
        return run_serve_load(
            tiny, conversations, concurrency=[1, 2], max_new_tokens=MAX_NEW, costs=FLAT_COSTS
        )


def test_runs_come_off_then_on_at_each_concurrency(report):
    order = [(r.concurrency, r.speculation) for r in report.runs]
    assert order == [(1, False), (1, True), (2, False), (2, True)]
    for run in report.runs:
        assert [(r.conversation, r.turn) for r in run.requests] == [(i, 0) for i in range(len(PROMPTS))]
        assert 1 <= run.peak_in_flight <= run.concurrency
    assert report.runs[2].peak_in_flight == 2
    assert report.settings["concurrency"] == [1, 2]
    assert report.settings["conversations"] == report.settings["requests"] == len(PROMPTS)


def test_token_counts_add_up(report):
    for run in report.runs:
        row = run.as_dict()
        assert row["requests"] == len(PROMPTS)
        assert row["output_tokens"] == sum(r["output_tokens"] for r in row["per_request"]) > 0
        assert row["tokens_per_second"] == pytest.approx(row["output_tokens"] / row["seconds"])
        for request in run.requests:
            assert 1 <= request.output_tokens <= MAX_NEW
            assert request.chunks <= request.output_tokens
            assert request.ttft is None or 0 < request.ttft <= request.seconds <= run.seconds
    tokens = {(r.concurrency, r.speculation): [q.output_tokens for q in r.requests] for r in report.runs}
    assert tokens[1, False] == tokens[1, True] == tokens[2, False] == tokens[2, True]


def test_speculation_gives_the_same_outputs(report):
    for plain, speculative in zip(report.runs[::2], report.runs[1::2], strict=True):
        assert [r.text for r in speculative.requests] == [r.text for r in plain.requests]
        assert speculative.identical == len(PROMPTS) and plain.identical is None
        assert speculative.speedup == pytest.approx(speculative.tokens_per_second / plain.tokens_per_second)


def test_percentiles_are_ordered(report):
    for run in report.runs:
        row = run.as_dict()
        assert row["ttft_p50"] is not None and row["itl_p50"] is not None
        assert 0 < row["ttft_p50"] <= row["ttft_p99"]
        assert 0 < row["itl_p50"] <= row["itl_p99"]


def test_markdown_and_json_files(report, tmp_path):
    table = report.markdown()
    assert "| concurrency | speculation | requests |" in table
    assert table.count("| 1 | o") == table.count("| 2 | o") == 2
    assert table.count(f"| {len(PROMPTS)}/{len(PROMPTS)} |") == 2
    written = report.save(tmp_path / "out")
    assert [p.name for p in written] == ["serve.json", "serve.md"]
    assert json.loads(written[0].read_text()) == json.loads(json.dumps(report.as_dict()))
    assert written[1].read_text() == table + "\n"


def test_a_conversations_next_turn_finds_its_first_turn_in_the_cache(tiny, tmp_path, monkeypatch):
    """Later turns carry the conversation so far; the server reuses what the first turn left, and
    their outputs are the same with speculation on and off, and with reuse off. One conversation at a
    time: with two at once on two rows, both can finish in one step and the other client's next
    request may take the row first (a reuse the scheduler cannot promise)."""
    monkeypatch.setenv("READER_SPEC_CACHE", str(tmp_path))
    conversations = [[PROMPTS[0], "w9 w8 w9"], [PROMPTS[1]], [PROMPTS[2], "w8 w9 w8", "w40 w41"]]
    reports = {
        reuse: run_serve_load(
            tiny,
            conversations,
            concurrency=[1],
            max_new_tokens=MAX_NEW,
            costs=FLAT_COSTS,
            reuse_prefixes=reuse,
        )
        for reuse in (True, False)
    }
    with_reuse, without = reports[True].runs, reports[False].runs
    assert [(r.conversation, r.turn) for r in with_reuse[0].requests] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (2, 0),
        (2, 1),
        (2, 2),
    ]
    for run in with_reuse:
        assert run.identical in (None, 6)
        for request in run.requests:
            if request.turn > 0:  # at least the first turn's prompt (the answer, where it reads back alike)
                first = next(r for r in run.requests if (r.conversation, r.turn) == (request.conversation, 0))
                assert first.prompt_tokens <= request.cached_tokens < request.prompt_tokens
        assert run.as_dict()["later_turns_ttft_p50"] is not None
    assert all(r.cached_tokens == 0 for run in without for r in run.requests)
    assert [r.text for r in with_reuse[1].requests] == [r.text for r in without[1].requests]
    assert (
        "later turns' TTFT p50 ms" in reports[True].markdown()
        and "prefix reuse on" in reports[True].markdown()
    )


def test_a_missing_serve_extra_is_one_line(capsys, monkeypatch):
    find_spec = importlib.util.find_spec

    def without_uvicorn(name, *rest):
        return None if name == "uvicorn" else find_spec(name, *rest)

    monkeypatch.setattr(importlib.util, "find_spec", without_uvicorn)
    assert main(["bench-serve", "--model", "unused"]) == 2
    out, err = capsys.readouterr()
    assert not out and err.count("\n") == 1 and "pip install 'reader-spec[serve,bench]'" in err


def test_the_cli_does_not_load_the_server_at_start_up():
    code = (
        "import sys; from reader_spec.cli import build_parser; build_parser(); "
        "print(sorted({'fastapi', 'uvicorn', 'reader_spec.bench.serve_load'} & set(sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
