"""The ``reader`` command on a tiny saved model: JSON contract, comparison, and one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from reader_spec.cli import main


@pytest.fixture(autouse=True)
def isolated_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("READER_SPEC_CACHE", str(tmp_path / "cache"))


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_with_compare(capsys, tiny_llama_dir, tmp_path):
    lines = [
        {"id": "a", "prompt": "w5 w6 w7 w5 w6 w7 w5 w6"},
        {"id": 7, "messages": [{"role": "user", "content": "w9 w10 w9 w10"}]},
        {"prompt": "w20 w21"},
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    code, out, _ = run(
        capsys, "generate", "--model", str(tiny_llama_dir), "--input", str(path),
        "--max-new-tokens", "12", "--batch-size", "2", "--compare", "--json",
    )  # fmt: skip
    assert code == 0
    result = json.loads(out)
    assert [r["id"] for r in result["requests"]] == ["a", 7, 3]
    for request in result["requests"]:
        assert set(request) >= {"id", "tokens", "text", "seconds", "stats", "baseline"}
        assert request["tokens"] == request["baseline"]["tokens"]
        assert 1 <= len(request["tokens"]) <= 12
        stats = request["stats"]
        assert sum(stats["accept_lengths"]) == stats["new_tokens"] == len(request["tokens"])
        assert stats["mean_accepted"] == pytest.approx(len(request["tokens"]) / stats["steps"])
    assert result["summary"]["identical"] == 3 and result["summary"]["speedup"] > 0


def test_generate_text_output(capsys, tiny_llama_dir):
    code, out, _ = run(
        capsys, "generate", "--model", str(tiny_llama_dir), "--prompt", "w3 w4 w3 w4", "--max-new-tokens", "5"
    )
    assert code == 0
    assert "=== 0 ===" in out and "tok/s" in out and "tokens/step" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "/no/such/model", "--prompt", "x"], "no such file or directory"),
        (["--prompt", "x", "--batch-size", "0"], "--batch-size"),
        (["--input", "/no/such/file.jsonl"], "No such file"),
        (["--prompt", "x", "--device", "tpu9"], "--device"),
        (["--prompt", "x", "--device", "cuda:7"], "no such GPU"),
    ],
)
def test_errors_are_one_line_with_status_2(capsys, argv, message):
    code, out, err = run(capsys, "generate", *argv)
    assert code == 2
    assert message in err and err.count("\n") == 1 and not out


@pytest.mark.parametrize("argv", [["--dtype", "bfloat16"], ["--weights", "int8"]])
def test_other_number_formats_equal_their_own_plain_decoding(capsys, tiny_llama_dir, argv):
    code, out, _ = run(
        capsys, "generate", "--model", str(tiny_llama_dir), "--prompt", "w3 w4 w3 w4 w3",
        "--max-new-tokens", "12", "--device", "cpu", "--compare", "--json", *argv,
    )  # fmt: skip
    assert code == 0
    (request,) = json.loads(out)["requests"]
    assert request["tokens"] == request["baseline"]["tokens"]


def test_malformed_input_line(capsys, tiny_llama_dir, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": 1, "prompt": "w3"}\n{"id": 2, "messages": "not a list"}\n')
    code, _, err = run(capsys, "generate", "--model", str(tiny_llama_dir), "--input", str(path))
    assert code == 2 and "bad.jsonl:2" in err and "messages" in err


def test_sampling_settings_per_request_and_compare_draws_the_same(capsys, tiny_llama_dir, tmp_path):
    lines = [
        {"id": "greedy", "prompt": "w5 w6 w7 w5 w6 w7", "temperature": 0},
        {"id": "hot", "prompt": "w5 w6 w7 w5 w6 w7", "temperature": 1.0, "seed": 4, "max_new_tokens": 6},
        {"id": "unseeded", "prompt": "w9 w10 w9 w10"},
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    code, out, _ = run(
        capsys, "generate", "--model", str(tiny_llama_dir), "--input", str(path), "--max-new-tokens", "10",
        "--temperature", "0.8", "--top-p", "0.9", "--batch-size", "3", "--compare", "--json",
    )  # fmt: skip
    assert code == 0
    requests = {r["id"]: r for r in json.loads(out)["requests"]}
    assert len(requests["hot"]["tokens"]) <= 6 < len(requests["greedy"]["tokens"])
    assert all(r["tokens"] == r["baseline"]["tokens"] for r in requests.values())


def test_logprobs_are_listed_with_json_and_summed_up_in_text(capsys, tiny_llama_dir):
    argv = ["generate", "--model", str(tiny_llama_dir), "--prompt", "w5 w6 w7 w5", "--max-new-tokens", "8"]
    code, out, _ = run(capsys, *argv, "--logprobs", "2", "--compare", "--json")
    assert code == 0
    (request,) = json.loads(out)["requests"]
    assert request["tokens"] == request["baseline"]["tokens"]
    assert [lp["token"] for lp in request["logprobs"]] == request["tokens"]
    for lp in request["logprobs"]:
        assert lp["logprob"] <= 0 and len(lp["top"]) == 2 and lp["top"][0][1] >= lp["logprob"]
    code, out, _ = run(capsys, *argv, "--logprobs", "0")
    assert code == 0 and "perplexity" in out
    code, out, _ = run(capsys, *argv, "--json")
    assert "logprobs" not in json.loads(out)["requests"][0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "0"], "top_p must lie in (0, 1]"),
        (["--logprobs", "-1"], "logprobs must be None or an integer >= 0"),
        (["--logit-bias", "5=-101"], "logit_bias values must lie in [-100, 100]"),
        (["--logit-bias", "96=-100"], "request 0: logit_bias names token 96, outside the vocabulary"),
    ],
)
def test_invalid_sampling_settings_are_one_line_errors(capsys, tiny_llama_dir, argv, message):
    code, out, err = run(capsys, "generate", "--model", str(tiny_llama_dir), "--prompt", "w3", *argv)
    assert code == 2 and message in err and err.count("\n") == 1 and not out


def test_a_logit_bias_from_the_command_line_or_an_input_line(capsys, tiny_llama_dir, tmp_path):
    argv = ["generate", "--model", str(tiny_llama_dir), "--max-new-tokens", "8", "--json"]
    code, _, err = run(capsys, *argv, "--prompt", "w5", "--logit-bias", "96=-100")
    assert code == 2 and "outside the vocabulary" in err
    assert not (tmp_path / "cache" / "costs").exists()  # refused before any measurement
    _, out, _ = run(capsys, *argv, "--prompt", "w5 w6 w7 w5", "--drafter", "none")
    first = json.loads(out)["requests"][0]["tokens"][0]
    _, out, _ = run(capsys, *argv, "--prompt", "w5 w6 w7 w5", "--logit-bias", f"{first}=-100", "--compare")
    (request,) = json.loads(out)["requests"]
    assert first not in request["tokens"] and request["tokens"] == request["baseline"]["tokens"]
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"prompt": "w5 w6 w7 w5", "logit_bias": {str(first): -100}}) + "\n")
    _, out, _ = run(capsys, *argv, "--input", str(path), "--drafter", "none")
    assert json.loads(out)["requests"][0]["tokens"] == request["tokens"]
    with pytest.raises(SystemExit, match="2"):
        main([*argv, "--prompt", "w5", "--logit-bias", "5:-100"])
    assert "expected TOKEN=BIAS, e.g. 50256=-100, got '5:-100'" in capsys.readouterr().err


def test_invalid_setting_on_an_input_line_names_the_request(capsys, tiny_llama_dir, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "x", "prompt": "w3", "top_p": 2}\n')
    code, _, err = run(capsys, "generate", "--model", str(tiny_llama_dir), "--input", str(path))
    assert code == 2 and "request 'x'" in err and "top_p" in err


def test_a_prompt_longer_than_the_context_is_one_line_before_any_work(capsys, tiny_llama_dir, monkeypatch):
    from reader_spec.engine.loop import Engine

    def no_work(*args, **kwargs):
        raise AssertionError("worked on a prompt that cannot be decoded")

    monkeypatch.setattr(Engine, "warm_up", no_work)
    prompt = " ".join(["w5"] * 2100)  # the tiny model's context is 2,048 positions
    code, out, err = run(capsys, "generate", "--model", str(tiny_llama_dir), "--prompt", prompt)
    assert code == 2 and out == ""
    assert err == (
        "reader: error: the prompt is 2,100 tokens long and the model's context is 2,048: "
        "there is no room to generate\n"
    )


def test_calibrate_prints_the_measured_curves(capsys, tiny_llama_dir):
    argv = ["calibrate", "--model", str(tiny_llama_dir), "--batch-size", "2", "--budget", "2"]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith("batch")]
    assert [row.split(":")[0] for row in rows] == ["batch   1", "batch   2"]
    assert "4: " in rows[1] and "4: " not in rows[0]  # each curve reaches its batch's whole budget
    floor = out[out.index("floor on this machine") :].splitlines()
    assert "fast runner" in floor[0] and floor[1].startswith("tokens in a pass at batch 1")
    widths = [cell.split(":")[0] for line in floor[2:6] for cell in line.split("  ")]
    assert widths == [str(n) for n in range(1, 33)]  # every width up to 32, whatever the budget


def test_calibrate_again_measures_cached_curves_anew(capsys, tiny_llama_dir, caplog):
    """A cached curve is read, not measured; ``--again`` measures it anew and overwrites the cache."""
    import json
    import logging

    from reader_spec.budget.costs import PROBE_CONTEXT

    argv = ["calibrate", "--model", str(tiny_llama_dir), "--budget", "2"]
    path = run(capsys, *argv)[1].splitlines()[0].split("cached in ")[1]
    with open(path) as f:
        measured = json.load(f)
    stale = {context: {b: dict.fromkeys(curve, 9.0) for b, curve in by_batch.items()}
             for context, by_batch in measured.items()}  # fmt: skip
    with open(path, "w") as f:
        json.dump(stale, f)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="reader_spec"):
        out = run(capsys, *argv)[1]
        assert "measuring" not in caplog.text and "batch   1: 0: 9000.0" in out  # the cache is read
        out = run(capsys, *argv, "--again")[1]
    assert "measuring verification costs" in caplog.text
    assert "9000.0" not in out
    with open(path) as f:
        assert json.load(f)[str(PROBE_CONTEXT)]["1"]["0"] != 9.0


@pytest.fixture(scope="module")
def tiny_gpt2_dir(tmp_path_factory):
    """An architecture the fast runner does not know."""
    from transformers import AutoModelForCausalLM, GPT2Config

    from tests.conftest import TINY_VOCAB, make_tiny_tokenizer

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=TINY_VOCAB, n_embd=32, n_layer=2, n_head=2, eos_token_id=1, bos_token_id=0)
    directory = tmp_path_factory.mktemp("tiny-gpt2")
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    make_tiny_tokenizer().save_pretrained(directory)
    return directory


def test_runner_fast_refuses_an_unknown_architecture_and_auto_falls_back(capsys, tiny_gpt2_dir):
    argv = ["generate", "--model", str(tiny_gpt2_dir), "--prompt", "w3 w4 w5", "--max-new-tokens", "4"]
    code, out, err = run(capsys, *argv, "--runner", "fast")
    assert code == 2 and not out
    assert "the fast runner does not support GPT2LMHeadModel" in err and err.count("\n") == 1
    code, out, _ = run(capsys, *argv, "--runner", "auto", "--compare", "--json")
    assert code == 0 and json.loads(out)["summary"]["identical"] == 1


def test_both_runners_give_the_same_output(capsys, tiny_llama_dir):
    argv = ["generate", "--model", str(tiny_llama_dir), "--prompt", "w3 w4 w5 w3 w4", "--max-new-tokens", "8"]
    outputs = []
    for runner in ("fast", "transformers"):
        code, out, _ = run(capsys, *argv, "--runner", runner, "--json")
        assert code == 0
        outputs.append(json.loads(out)["requests"][0]["tokens"])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 8


@pytest.mark.parametrize(
    "drafting",
    [
        ["--drafter", "model"],  # the int8 self-draft by default
        ["--drafter", "rasd", "--rasd-top-k", "3"],
        ["--draft-model", "DIR"],  # reader fused with another model of the same tokenizer
    ],
)
def test_generate_with_a_draft_model_equals_plain_decoding(capsys, tiny_llama_dir, drafting):
    drafting = [str(tiny_llama_dir) if arg == "DIR" else arg for arg in drafting]
    code, out, _ = run(
        capsys, "generate", "--model", str(tiny_llama_dir), "--prompt", "w3 w4 w5 w3 w4 w5 w3",
        "--max-new-tokens", "10", "--compare", "--json", *drafting,
    )  # fmt: skip
    assert code == 0
    assert json.loads(out)["summary"]["identical"] == 1


def test_draft_model_errors_are_one_line(capsys, tiny_llama_dir, tiny_gpt2_dir):
    base = ["generate", "--model", str(tiny_llama_dir), "--prompt", "w3 w4", "--max-new-tokens", "3"]
    code, _, err = run(capsys, *base, "--drafter", "none", "--draft-model", "self")
    assert code == 2 and "--draft-model needs a drafter" in err and err.count("\n") == 1
    code, _, err = run(capsys, *base, "--draft-model", "/no/such/draft")
    assert code == 2 and "no such file or directory" in err and err.count("\n") == 1
    gpt2 = ["generate", "--model", str(tiny_gpt2_dir), "--prompt", "w3 w4", "--max-new-tokens", "3"]
    code, _, err = run(capsys, *gpt2, "--drafter", "model")
    assert code == 2 and "--draft-model self needs the fast runner" in err and err.count("\n") == 1
