"""The measurement scripts run against the current API (they are not imported anywhere else)."""

import runpy
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_context_index_script_runs_and_drafts_on_repetitive_text(monkeypatch, capsys):
    argv = ["bench_context_index.py", "--prompt-tokens", "400", "--output-tokens", "200", "--repeats", "2",
            "--max-nodes", "8"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(SCRIPTS / "bench_context_index.py"), run_name="__main__")
    out = capsys.readouterr().out
    phrases = out.split("== uniform")[0]
    tokens_per_step = float(phrases.split("tokens/step ")[1].split(";")[0])
    assert "build index" in out and tokens_per_step > 1.0  # repeated phrases get accepted drafts


@pytest.mark.model
def test_weights_agreement_script_compares_a_packed_copy_with_float32(monkeypatch, capsys):
    argv = ["weights_agreement.py", "--weights", "int4", "--limit", "2", "--max-new-tokens", "8",
            "--categories", "coding,math", "writing"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(SCRIPTS / "weights_agreement.py"), run_name="__main__")
    out = capsys.readouterr().out
    identical = out.split("identical outputs: ")[1].split("/")
    assert identical[1].startswith("6 ") and int(identical[0]) >= 4  # the file's own weights: near-ties
    agreement = float(out.split("choice on float32's output: ")[1].split("%")[0])
    assert 80 <= agreement <= 100  # int8 per channel, and int4 where it is exact, stay close to float32


def test_drafting_script_builds_a_datastore_once_and_reader_reads_it(monkeypatch, capsys, tmp_path):
    argv = ["bench_drafting.py", "--drafters", "reader", "--batch-sizes", "2", "--contexts", "300",
            "--steps", "5", "--datastore-tokens", "20000",
            "--datastore-dir", str(tmp_path / "store")]  # fmt: skip
    monkeypatch.syspath_prepend(str(SCRIPTS))
    for run in range(2):
        monkeypatch.setattr(sys, "argv", argv)
        runpy.run_path(str(SCRIPTS / "bench_drafting.py"), run_name="__main__")
        out = capsys.readouterr().out
        assert ("built a datastore" in out) == (run == 0)  # the second run reuses it
        (row,) = [line for line in out.splitlines() if line.startswith("| reader |")]
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert int(cells[3].replace(",", "")) >= 20000 and float(cells[-1]) > 1.0


def run_on_a_recording(script: str, monkeypatch, tmp_path) -> None:
    """Run a replay script on two copies of a short recorded conversation, with the tiny tokenizer."""
    from tests.bench.test_replay import CONVERSATION, TURN_TEMPLATE, write_tasks
    from tests.conftest import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = TURN_TEMPLATE
    tokenizer.save_pretrained(tmp_path / "tok")
    write_tasks(tmp_path / "tasks.jsonl.gz", [{"messages": CONVERSATION}] * 2)
    monkeypatch.setenv("READER_SPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(SCRIPTS))
    monkeypatch.setattr(
        sys, "argv", [script, str(tmp_path / "tasks.jsonl.gz"), "--model", str(tmp_path / "tok")]
    )
    runpy.run_path(str(SCRIPTS / script), run_name="__main__")


def brute_run(searched, recording, start: int, end: int, budget: int) -> int:
    """The longest run of the recording from ``start`` that follows an occurrence of the token before."""
    best = 0
    for e in range(len(searched) - 1):
        if searched[e] != recording[start - 1]:
            continue
        run = 0
        while (
            run < budget
            and start + run < end
            and e + 1 + run < len(searched)
            and searched[e + 1 + run] == recording[start + run]
        ):
            run += 1
        best = max(best, run)
    return best


def test_replay_ceiling_follows_the_best_occurrence(monkeypatch, capsys, tmp_path):
    import random

    import numpy as np

    monkeypatch.syspath_prepend(str(SCRIPTS))  # the script imports recordings.py beside it
    best_run = runpy.run_path(str(SCRIPTS / "replay_ceiling.py"))["best_run"]
    rng = random.Random(4)
    for _ in range(300):
        recording = np.array([rng.randrange(3) for _ in range(rng.randrange(2, 30))])
        start, budget = rng.randrange(1, len(recording)), rng.randrange(1, 6)
        searched = recording[:start]
        expected = brute_run(searched, recording, start, len(recording), budget)
        assert best_run(searched, recording, start, len(recording), budget) == expected
    run_on_a_recording("replay_ceiling.py", monkeypatch, tmp_path)
    out = capsys.readouterr().out
    text_only = float(out.split("ceiling from the text: ")[1].split(" ")[0])
    with_history = float(out.split("ceiling from the text and history: ")[1].split(" ")[0])
    assert 1.0 <= text_only < with_history  # the second task's answers repeat the first's


def test_replay_calibration_reports_every_trial(monkeypatch, capsys, tmp_path):
    run_on_a_recording("replay_calibration.py", monkeypatch, tmp_path)
    out = capsys.readouterr().out
    trials = int(out.split(" steps, ")[1].split(" trials")[0].replace(",", ""))
    by_agreement = out.split("by sources agreeing")[1].split("by labelling source")[0]
    counted = [
        int(line.split(":")[1].split()[0].replace(",", "")) for line in by_agreement.splitlines()[1:] if line
    ]
    assert trials > 0 and sum(counted) == trials  # every trial lands in exactly one row


def test_draft_variants_integer_inputs_round_each_linear_layers_input():
    """W8A8 simulated: one int8 level moves the logits, two levels leave them near the int8 copy's."""
    import torch

    from tests.conftest import make_tiny_llama

    variants = runpy.run_path(str(SCRIPTS / "draft_variants.py"), run_name="draft_variants")
    model = make_tiny_llama()  # its own: a shared model may have been packed by the fast runner
    ids = torch.arange(3, 40)[None]
    with torch.inference_mode():
        weights_only = variants["rounded"](model, 8, None)(ids).logits
        one_level = variants["integer_inputs"](model, 1)(ids).logits
        two_levels = variants["integer_inputs"](model, 2)(ids).logits
    one_off = (one_level - weights_only).abs().max()
    two_off = (two_levels - weights_only).abs().max()
    assert one_off > 0 and two_off < one_off / 50  # each level quantizes what the ones before left


def test_noise_script_runs_plain_decoding_against_itself_in_the_bench_turns(
    monkeypatch, capsys, tiny_llama_dir
):
    argv = ["bench_noise.py", "--model", str(tiny_llama_dir), "--batch-sizes", "2", "3", "--repeats", "2",
            "--limit", "1", "--max-new-tokens", "4"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(SCRIPTS / "bench_noise.py"), run_name="__main__")
    out = capsys.readouterr().out
    for size in (2, 3):
        summary = out.split(f"batch {size}: ratios ")[1].split(";")[0].split()
        assert len(summary) == 2 and all(float(ratio) > 0 for ratio in summary)
    assert out.count(", repeat ") == 4
