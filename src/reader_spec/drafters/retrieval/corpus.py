"""Corpora for the datastore: documents read from files or answered by the model, as token ids.

Files: ``.jsonl`` (optionally ``.jsonl.gz``) holds one document per line, and any other file is one
plain-text document (``.gz`` is decompressed). A JSONL line is ``{"text": ...}``, ``{"messages": [...]}``
(a conversation, rendered with the tokenizer's chat template exactly as the model sees chats),
``{"prompt": ...}`` (the ``reader generate`` format) or ``{"turns": [...]}`` (Spec-Bench questions,
joined as paragraphs). Texts are tokenized in batches by the fast tokenizer, without special tokens:
document separators take their place.

Model answers: the model's own greedy answers to prompts, stored as the prompt's token ids followed by
the answer's, exactly as the model saw and produced them (no round trip through text, which can
tokenize differently). That is what a request's context looks like while it decodes, so the suffix
``<assistant prompt> + answer so far`` finds earlier answers to similar prompts.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING

from reader_spec.files import json_lines
from reader_spec.prompts import IdFilter, InputRecord, PromptError, by_id_parity, encode_prompt, read_jsonl

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from reader_spec.engine.loop import Output
    from reader_spec.loading import LoadedModel

Document = str | list[dict[str, str]]
"""Plain text, or chat messages."""


def read_documents(path: str | Path) -> Iterator[Document]:
    """The documents of one file (see the module docstring)."""
    path = Path(path)
    stem = path.name[:-3] if path.name.endswith(".gz") else path.name
    if not stem.endswith(".jsonl"):
        with _open_text(path) as f:
            yield f.read()
        return
    for number, record in json_lines(path, PromptError):
        yield _jsonl_document(record, f"{path}:{number}")


def tokenize_documents(
    tokenizer: PreTrainedTokenizerBase, documents: Iterable[Document], batch_size: int = 64
) -> Iterator[list[int]]:
    """Token ids per document; batches go through the fast tokenizer together."""
    iterator = iter(documents)
    while batch := list(islice(iterator, batch_size)):
        texts = [d if isinstance(d, str) else _chat_text(tokenizer, d) for d in batch]
        yield from tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


def file_documents(
    tokenizer: PreTrainedTokenizerBase, paths: Iterable[str | Path], batch_size: int = 64
) -> Iterator[list[int]]:
    """Token ids of every document of every file, in order."""
    documents = (document for path in paths for document in read_documents(path))
    return tokenize_documents(tokenizer, documents, batch_size)


def file_sources(paths: Iterable[str | Path]) -> list[dict]:
    """Provenance of input files for ``meta.json``; fails early on a missing file."""
    sources = []
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise PromptError(f"no such input file: {path}")
        sources.append({"path": str(path.resolve()), "bytes": path.stat().st_size, "kind": "file"})
    return sources


def read_prompts(path: str | Path, question_ids: IdFilter = "all") -> list[InputRecord]:
    """Prompts from a ``reader generate`` JSONL or a Spec-Bench question file, filtered by id parity.

    Spec-Bench questions (lines with ``question_id``) are asked their first turn, as ``reader bench`` does.
    """
    path = Path(path)
    if _first_record(path).get("question_id") is not None:
        records = list(_first_turns(path))
    else:
        records = list(read_jsonl(path))
    try:
        return by_id_parity(records, question_ids)
    except PromptError as e:
        raise PromptError(f"{path}: {e}") from None


def answer_documents(
    loaded: LoadedModel,
    records: Sequence[InputRecord],
    max_new_tokens: int = 256,
    batch_size: int = 1,
    on_finish: Callable[[Output], None] | None = None,
    runner: str = "auto",
) -> list[list[int]]:
    """Each prompt's token ids followed by the model's greedy answer (``runner``: the forward, as for
    :class:`~reader_spec.engine.loop.Engine`).

    Decoded with READER's drafter (request text and earlier answers): the output is exactly plain greedy
    decoding's, only faster.
    """
    from reader_spec.config import GenerationConfig
    from reader_spec.drafters import ReaderDrafter
    from reader_spec.engine.loop import Engine

    prompts = [r.prompt for r in records]
    engine = Engine(loaded, ReaderDrafter(), runner=runner)
    outputs = engine.generate(
        prompts,
        GenerationConfig(max_new_tokens=max_new_tokens),
        batch_size=batch_size,
        ids=[r.id for r in records],
        on_finish=on_finish,
    )
    return [encode_prompt(loaded.tokenizer, p) + o.tokens for p, o in zip(prompts, outputs, strict=True)]


def _open_text(path: Path):
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def _first_record(path: Path) -> dict:
    try:
        for _, record in json_lines(path, PromptError):
            return record if isinstance(record, dict) else {}
    except PromptError:
        return {}  # read_jsonl reports it with its line number
    raise PromptError(f"{path}: no prompts")


def _first_turns(path: Path) -> Iterator[InputRecord]:
    """Spec-Bench lines (``question_id``, ``turns``) as the chat prompts of their first turns."""
    for number, record in json_lines(path, PromptError):
        turns = record.get("turns") if isinstance(record, dict) else None
        try:
            question_id = int(record["question_id"])
        except (KeyError, TypeError, ValueError):
            question_id = None
        if question_id is None or not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise PromptError(f"{path}:{number}: a question needs an integer 'question_id' and text 'turns'")
        yield InputRecord(question_id, [{"role": "user", "content": turns[0]}])


def _jsonl_document(record: object, where: str) -> Document:
    if isinstance(record, dict):
        if isinstance(record.get("text"), str):
            return record["text"]
        messages = record.get("messages")
        if isinstance(messages, list):
            if not all(isinstance(m, dict) and _is_message(m) for m in messages):
                raise PromptError(f"{where}: every message needs string 'role' and 'content' fields")
            return messages
        if isinstance(record.get("prompt"), str):
            return record["prompt"]
        turns = record.get("turns")
        if isinstance(turns, list) and all(isinstance(t, str) for t in turns):
            return "\n\n".join(turns)
    raise PromptError(f"{where}: needs a 'text' or 'prompt' string, a 'messages' list or 'turns'")


def _chat_text(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> str:
    """A whole conversation through the chat template, without a trailing generation prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("this tokenizer has no chat template, so 'messages' documents cannot be rendered")
    return tokenizer.apply_chat_template(messages, tokenize=False)


def _is_message(message: dict) -> bool:
    return isinstance(message.get("role"), str) and isinstance(message.get("content"), str)
