"""Shared fixtures: a tiny random Llama with a word-level tokenizer, and the default model."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from reader_spec.engine import kernels
from reader_spec.loading import LoadedModel, tokenizer_fingerprint

TINY_VOCAB = 96
TEST_DEVICE = os.environ.get("READER_TEST_DEVICE", "cpu")
"""Where the tests' models and tensors live: ``READER_TEST_DEVICE=cuda`` runs the engine, runner and
drafter tests on a GPU (made the default device, so that tests build their tensors there too; the
command line's own device handling is checked by ``reader generate --device cuda --compare``)."""
if TEST_DEVICE != "cpu":
    torch.set_default_device(TEST_DEVICE)
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}<assistant>"


def make_tiny_tokenizer(vocab_size: int = TINY_VOCAB) -> PreTrainedTokenizerFast:
    """Words ``w0 .. w{n-1}`` plus role markers, whitespace-split; ``w1`` is end-of-sequence."""
    words = [f"w{i}" for i in range(vocab_size - 3)] + ["<user>", "<system>", "<assistant>"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="w1", unk_token="w0")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_tiny_llama(vocab_size: int = TINY_VOCAB, seed: int = 0, device: str | torch.device | None = None):
    """A random tiny Llama, on ``device`` (default: the current default device). Its weights are drawn
    on the CPU whatever the device, so that they are the same everywhere: tests that rely on what this
    model happens to generate (drafts a datastore accepts, outputs that int8 weights change) see on a
    GPU what they see on a CPU."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=1,
        bos_token_id=0,
    )
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config)
    return model.to(device or torch.get_default_device()).eval().requires_grad_(False)


@pytest.fixture(scope="session", autouse=True)
def compiled_parts():
    """Load the compiled parts first, from the cache ``make`` built them into. A process loads each part
    once, wherever it is first asked for; asked for first by a test that points ``READER_SPEC_CACHE``
    at an empty directory, it would be built again there (a minute of this suite)."""
    from reader_spec.drafters.retrieval import native
    from reader_spec.engine import kernels

    kernels.available()
    native.core()


@pytest.fixture
def on_cpu():
    """For a test of CPU-only machinery (the compiled kernels, blocked weights, the greedy head, kernel
    timing): its models and tensors are built on the CPU whatever ``READER_TEST_DEVICE`` says, so it
    checks the same thing on every machine."""
    with torch.device("cpu"):
        yield


@pytest.fixture
def directory_fsyncs(monkeypatch) -> list[int]:
    """Inode numbers of the directories fsynced during the test (what makes a rename durable)."""
    synced: list[int] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            synced.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return synced


KERNELS_MISSING = "the compiled kernels must build on this machine (make builds them)"


@pytest.fixture
def compiled_kernels():
    """For a test of the compiled kernels, which must build wherever the tests run: a missing compiler
    fails the test instead of testing the fallback twice."""
    if not kernels.available():
        pytest.fail(KERNELS_MISSING)


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    tokenizer = make_tiny_tokenizer()
    return LoadedModel(make_tiny_llama(), tokenizer, "tiny-llama", tokenizer_fingerprint(tokenizer))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny):
    directory = tmp_path_factory.mktemp("tiny-llama")
    tiny.model.save_pretrained(directory)
    tiny.tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    """The default model (de-quantized once, then read from the weights cache)."""
    from reader_spec.loading import load_model

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    return load_model(device=TEST_DEVICE)


@pytest.fixture(scope="session")
def smollm_engine(smollm) -> LoadedModel:
    """A copy of the default model for engines to run: the fast runner packs its weights in place,
    and ``smollm`` stays transformers' own, the reference."""
    import copy
    from dataclasses import replace

    return replace(smollm, model=copy.deepcopy(smollm.model))


def pytest_terminal_summary(terminalreporter):
    """Show every tolerated near-tie mismatch of the end-to-end exactness tests, when they ran."""
    import sys

    exactness = sys.modules.get("tests.engine.test_exactness_default_model")
    if exactness is None or not exactness.COMPARED:
        return
    terminalreporter.section("exactness near-ties")
    summary = f"compared: {', '.join(exactness.COMPARED)}"
    terminalreporter.write_line(summary)
    terminalreporter.write_line("\n".join(exactness.NEAR_TIES) or "none: every output was identical")
