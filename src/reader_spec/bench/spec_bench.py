"""The Spec-Bench prompts (Apache-2.0, shipped gzipped in ``bench/data/spec_bench``) and fair subsets."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from reader_spec.files import json_lines
from reader_spec.prompts import PromptError


@dataclass(frozen=True)
class Question:
    id: int
    category: str
    turns: tuple[str, ...]

    @property
    def messages(self) -> list[dict[str, str]]:
        """The first turn as a chat prompt."""
        return [{"role": "user", "content": self.turns[0]}]


def default_suite() -> Path:
    return Path(str(files("reader_spec.bench") / "data" / "spec_bench" / "question.jsonl.gz"))


def load_questions(path: str | Path | None = None) -> list[Question]:
    """Questions in file order; lines need ``question_id``, ``category`` and ``turns``."""
    path = Path(path) if path is not None else default_suite()
    questions = []
    for number, raw in json_lines(path, PromptError):
        try:
            turns = raw["turns"]
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
                raise TypeError("'turns' must be a non-empty list of strings")
            questions.append(Question(int(raw["question_id"]), str(raw["category"]), tuple(turns)))
        except (ValueError, KeyError, TypeError) as e:
            raise PromptError(f"{path}:{number}: not a Spec-Bench question ({e})") from None
    return questions


def per_category(
    questions: Iterable[Question], limit: int | None = None, categories: Iterable[str] | None = None
) -> list[Question]:
    """The first ``limit`` questions of each category (all categories unless named), grouped by category."""
    wanted = set(categories) if categories is not None else None
    groups: dict[str, list[Question]] = {}
    for q in questions:
        if wanted is None or q.category in wanted:
            group = groups.setdefault(q.category, [])
            if limit is None or len(group) < limit:
                group.append(q)
    if wanted is not None and (missing := wanted - groups.keys()):
        raise PromptError(f"no questions in categories: {', '.join(sorted(missing))}")
    return [q for category in sorted(groups) for q in groups[category]]


def interleave_categories(questions: list[Question]) -> list[Question]:
    """Round-robin over categories, so consecutive batches mix categories and prompt lengths."""
    groups: dict[str, list[Question]] = {}
    for q in questions:
        groups.setdefault(q.category, []).append(q)
    mixed = []
    for round_index in range(max((len(g) for g in groups.values()), default=0)):
        mixed.extend(g[round_index] for g in groups.values() if round_index < len(g))
    return mixed
