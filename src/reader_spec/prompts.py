"""Turning what users pass (text, chat messages, token ids, JSONL lines) into prompt token ids."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar

from reader_spec.config import SAMPLING_FIELDS
from reader_spec.files import json_lines

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = Mapping[str, str]
Prompt = str | Sequence[Message] | Sequence[int]
REQUEST_SETTINGS = ("max_new_tokens", *SAMPLING_FIELDS)
IdFilter = Literal["all", "odd", "even"]
"""Which integer ids to keep: a datastore of the odd Spec-Bench questions is measured on the even ones."""


class PromptError(ValueError):
    """A prompt or input line that cannot be used; the message says which and why."""


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> list[int]:
    """Token ids for text (encoded as is), chat messages (chat template) or token ids (unchanged)."""
    if isinstance(prompt, str):
        if not prompt:
            raise PromptError("empty prompt")
        return list(tokenizer(prompt)["input_ids"])
    if not isinstance(prompt, Sequence) or not prompt:
        raise PromptError(f"a prompt must be text, chat messages or token ids, got {type(prompt).__name__}")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = len(tokenizer)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise PromptError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        return list(prompt)
    if all(isinstance(m, Mapping) for m in prompt):
        return _apply_chat_template(tokenizer, prompt)
    raise PromptError("a prompt list must hold only token ids or only chat messages")


def _apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> list[int]:
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise PromptError(f"message {i} needs string 'role' and 'content' fields")
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("this model's tokenizer has no chat template; pass plain text instead")
    from jinja2 import TemplateError  # what transformers renders templates with; only needed here

    try:
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    except TemplateError as e:  # a template's raise_exception: "roles must alternate" and the like
        raise PromptError(f"the chat template refused the messages: {e}") from None
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    return list(ids)


@dataclass(frozen=True)
class InputRecord:
    id: object
    prompt: Prompt
    settings: dict = field(default_factory=dict)
    """Per-request overrides of generation settings (``temperature``, ``seed``, ``max_new_tokens``...)."""


def read_jsonl(path: str | Path) -> Iterator[InputRecord]:
    """Lines ``{"id": ..., "messages": [...]}`` or ``{"id": ..., "prompt": "..."}``.

    Ids default to the line number. A line may also carry its own generation settings
    (``max_new_tokens`` and the sampling settings of ``GenerationConfig``).
    """
    for number, record in json_lines(path, PromptError):
        if not isinstance(record, dict):
            raise PromptError(f"{path}:{number}: expected a JSON object")
        if "messages" in record:
            prompt = record["messages"]
            if not isinstance(prompt, list) or not all(isinstance(m, dict) for m in prompt):
                raise PromptError(f"{path}:{number}: 'messages' must be a list of objects")
        elif isinstance(record.get("prompt"), str):
            prompt = record["prompt"]
        else:
            raise PromptError(f"{path}:{number}: needs a 'messages' list or a 'prompt' string")
        settings = {k: record[k] for k in REQUEST_SETTINGS if k in record}
        yield InputRecord(record.get("id", number), prompt, settings)


class _HasId(Protocol):
    @property
    def id(self) -> object: ...


T = TypeVar("T", bound=_HasId)


def by_id_parity(items: Iterable[T], question_ids: IdFilter) -> list[T]:
    """The items (questions, input records) whose integer ``id`` has the parity asked for."""
    items = list(items)
    if question_ids == "all":
        return items
    wanted = 1 if question_ids == "odd" else 0
    kept = []
    for item in items:
        if not isinstance(item.id, int) or isinstance(item.id, bool):
            raise PromptError(f"id {item.id!r} is not an integer, so it is neither odd nor even")
        if item.id % 2 == wanted:
            kept.append(item)
    return kept
