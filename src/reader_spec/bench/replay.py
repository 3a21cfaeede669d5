"""Replay: how well drafters draft on recorded conversations, at scale, without running a model.

Every assistant turn of a recorded conversation is one request. Its context is the chat template applied
to the messages before it, with the generation prompt; its recorded continuation is what the template
adds for the turn itself, up to and including the first end-of-sequence token (the trailing newline of
SmolLM2's template comes after it and belongs to the next context). Context plus continuation is
therefore exactly the tokenization of the conversation through that turn. Roles are passed to the
template as recorded (SmolLM2's template renders any role, ``tool`` included, as ``<|im_start|>role``);
messages after the last assistant turn never reach a context and are dropped.

Each step a drafter proposes a tree under the budget (with measured verification costs, an adaptive
drafter's tree is priced and cut as the engine does at batch 1); the recorded tokens stand in for the target
model, so the step accepts the deepest path of the tree that follows them, plus one bonus token, just
as a greedy verification pass whose model produced the recording would. Then come ``observe`` and
``extend``, as in the engine. One drafter instance serves every turn of every task in order, so drafters
with memory see earlier turns and tasks the way a server would.

Tokenizing is slow (the template is applied to every prefix), so conversations are tokenized once per
file and tokenizer and cached as numpy arrays, written atomically.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from reader_spec.budget.costs import CostModel
from reader_spec.budget.planner import BudgetPlanner
from reader_spec.drafters import Drafter, feed_back, propose_all
from reader_spec.engine.sequence import DraftCounts
from reader_spec.engine.tree import DraftTree, Proposal
from reader_spec.files import json_lines, write_atomic

METHODS = ("pld", "suffix", "reader")
"""The drafters a replay compares by default (any name of ``DRAFTERS`` may be given)."""

CACHE_FORMAT = 2


class ReplayError(ValueError):
    """A recording that cannot be replayed; the message says which and why."""


@dataclass(frozen=True)
class Conversation:
    """One tokenized task: ``tokens`` through its last assistant turn, and per turn (context end,
    continuation end): the context is ``tokens[:a]`` and the recorded continuation ``tokens[a:b]``.
    ``category``: the task's, where the recording gives one (``reader bench`` writes Spec-Bench's)."""

    id: str
    tokens: np.ndarray
    turns: tuple[tuple[int, int], ...]
    category: str = ""


# --- reading and tokenizing ----------------------------------------------------------------------
def read_tasks(path: str | Path) -> list[dict]:
    """JSON lines (gzipped when the name ends in .gz), each a task with a ``messages`` list."""
    tasks = []
    for number, task in json_lines(path, ReplayError):
        messages = task.get("messages") if isinstance(task, dict) else None
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ReplayError(f"{path}:{number}: needs a 'messages' list of {{role, content}} strings")
        if not isinstance(task.get("category", ""), str):
            raise ReplayError(f"{path}:{number}: 'category' must be a string")
        task.setdefault("instance_id", str(task.get("id", number)))
        tasks.append(task)
    return tasks


def tokenize_conversation(
    tokenizer, messages: Sequence[Mapping[str, str]]
) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of the conversation through its last assistant turn, and each turn's (context end,
    continuation end).

    The template is rendered for every prefix to find where each context and turn ends in the text;
    the pieces between those points are tokenized separately, and their concatenation must equal the
    conversation tokenized whole (else the tokenizer merges tokens across turns and contexts would not
    be what a server sees).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ReplayError("the tokenizer has no chat template")
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant:
        return [], []
    messages = [{"role": m["role"], "content": m["content"]} for m in messages[: assistant[-1] + 1]]

    def render(upto: int, generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(
                messages[:upto], add_generation_prompt=generation_prompt, tokenize=False
            )
        except Exception as e:  # jinja raises its own errors, e.g. for roles a template refuses
            raise ReplayError(f"the chat template fails on this conversation: {e}") from e

    full = render(len(messages), False)
    cuts: list[int] = [0]
    for i in assistant:
        context, through = render(i, True), render(i + 1, False)
        if not (through.startswith(context) and full.startswith(through)):
            raise ReplayError("the chat template does not extend each prefix of the conversation")
        cuts += [len(context), len(through)]
    tokens: list[int] = []
    boundaries: list[int] = []
    for start, end in zip(cuts, [*cuts[1:], len(full)], strict=True):
        tokens += tokenizer(full[start:end], add_special_tokens=False)["input_ids"]
        boundaries.append(len(tokens))
    if tokens != list(tokenizer(full, add_special_tokens=False)["input_ids"]):
        raise ReplayError("the tokenizer merges tokens across turns; contexts would differ from a server's")
    eos = tokenizer.eos_token_id
    turns = []
    for context_end, turn_end in zip(boundaries[0:-1:2], boundaries[1::2], strict=True):
        turn = tokens[context_end:turn_end]
        end = context_end + turn.index(eos) + 1 if eos in turn else turn_end
        if end > context_end:
            turns.append((context_end, end))
    return tokens, turns


def load_conversations(
    path: str | Path, tokenizer, fingerprint: str, cache_dir: Path | None = None
) -> list[Conversation]:
    """Every task of a recording, tokenized, from the cache when this file and tokenizer were seen."""
    path = Path(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    key = json.dumps([CACHE_FORMAT, digest, fingerprint, tokenizer.chat_template, tokenizer.eos_token_id])
    cache = None
    if cache_dir is not None:
        cache = Path(cache_dir) / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.npz"
        if cache.is_file():
            return _read_cache(cache)
    conversations = []
    for task in tqdm(read_tasks(path), desc="tokenizing", unit="task", file=sys.stderr, leave=False):
        tokens, turns = tokenize_conversation(tokenizer, task["messages"])
        conversations.append(
            Conversation(
                str(task["instance_id"]), np.asarray(tokens, np.int32), tuple(turns), task.get("category", "")
            )
        )
    if cache is not None:
        _write_cache(cache, conversations)
    return conversations


def _write_cache(path: Path, conversations: Sequence[Conversation]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lengths = [len(c.tokens) for c in conversations]
    turns = [(i, a, b) for i, c in enumerate(conversations) for a, b in c.turns]
    buffer = io.BytesIO()
    np.savez(
        buffer,
        tokens=np.concatenate([c.tokens for c in conversations] or [np.empty(0, np.int32)]),
        offsets=np.cumsum([0, *lengths]),
        turns=np.asarray(turns, dtype=np.int64).reshape(-1, 3),
        ids=np.asarray([c.id for c in conversations], dtype=str),
        categories=np.asarray([c.category for c in conversations], dtype=str),
    )
    write_atomic(path, buffer.getvalue())


def _read_cache(path: Path) -> list[Conversation]:
    with np.load(path) as data:
        tokens, offsets, turns = data["tokens"], data["offsets"], data["turns"]
        ids, categories = data["ids"], data["categories"]
    by_task: dict[int, list[tuple[int, int]]] = {}
    for task, a, b in turns.tolist():
        by_task.setdefault(task, []).append((a, b))
    return [
        Conversation(
            str(ids[i]), tokens[offsets[i] : offsets[i + 1]], tuple(by_task.get(i, ())), str(categories[i])
        )
        for i in range(len(ids))
    ]


# --- replaying -----------------------------------------------------------------------------------
@dataclass(kw_only=True)
class MethodStats(DraftCounts):
    """Totals of one drafter over a replay (``new_tokens``: every recorded continuation token)."""

    method: str
    tasks: int = 0
    turns: int = 0
    seconds: float = 0.0
    drafter_seconds: float = 0.0
    verify_seconds: float = 0.0
    """With a cost model: what the steps' verification passes would take (drafted tokens and context
    priced by it)."""
    plain_seconds: float = 0.0
    """With a cost model: what plain decoding of the same tokens would take (one pass each)."""

    _SUMMED = ("turns", "steps", "new_tokens", "accepted", "drafted", "seconds", "drafter_seconds",
               "verify_seconds", "plain_seconds")  # fmt: skip

    def add(self, other: MethodStats) -> None:
        for name in self._SUMMED:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def modelled_speedup(self) -> float | None:
        """Plain decoding's modelled time over this method's (passes only; no cost model: None)."""
        return self.plain_seconds / self.verify_seconds if self.verify_seconds else None

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "mean_accepted": self.mean_accepted,
            "drafted_per_accepted": self.drafted_per_accepted,
            "modelled_speedup": self.modelled_speedup,
        }


@dataclass(frozen=True)
class ReplayedStep:
    """One step of a drafter against a recording: what it proposed, kept and emitted, and its time."""

    proposal: Proposal
    accepted: int
    emitted: list[int]
    propose_seconds: float
    feedback_seconds: float


def replay_step(
    drafter: Drafter,
    request: Hashable,
    root: int,
    recording: Sequence[int],
    max_nodes: int,
    context: int = 0,
    planner: BudgetPlanner | None = None,
) -> ReplayedStep:
    """Propose, verify against the recorded continuation (as a greedy pass of the model that produced
    it would), and feed the outcome back: the engine's step with the recording as the target model.

    The proposal is sized by ``planner`` as the engine's step sizes it at batch 1 with ``context``
    tokens of context (default: verified whole up to ``max_nodes``); the planner learns from the step
    as the engine's does, the recording's passes taking what its cost curve says."""
    planner = planner or BudgetPlanner(max_nodes)
    clock = time.perf_counter()
    plan = planner.plan(1, context, lambda seconds: propose_all(drafter, [request], max_nodes, seconds))
    step = settle(drafter, request, root, recording, plan.proposals[0], time.perf_counter() - clock)
    planner.record(plan, step.accepted)
    return step


def settle(
    drafter: Drafter,
    request: Hashable,
    root: int,
    recording: Sequence[int],
    proposal: Proposal,
    propose_seconds: float = 0.0,
) -> ReplayedStep:
    """Verify a proposal against the recorded continuation (as a greedy pass of the model that
    produced it would) and feed the outcome back to the drafter."""
    tree = DraftTree.from_proposal(root, proposal)
    path, _ = tree.walk(_recorded(recording, tree.depths))
    accepted = len(path) - 1
    emitted = list(recording[: accepted + 1])  # accepted drafts plus the bonus token
    clock = time.perf_counter()
    feed_back(drafter, request, proposal, path, emitted)
    return ReplayedStep(proposal, accepted, emitted, propose_seconds, time.perf_counter() - clock)


def replay_turn(
    drafter: Drafter,
    request: Hashable,
    context: Sequence[int],
    continuation: Sequence[int],
    budget: int,
    costs: CostModel | None = None,
    planner: BudgetPlanner | None = None,
) -> MethodStats:
    """Replay one recorded continuation through a drafter, as the engine would run it greedily.

    With ``costs`` each step's verification and plain decoding's passes are timed by that model;
    ``planner`` sizes each step's tree (see :func:`replay_step`), carried across turns as the engine
    carries its own across requests."""
    stats = MethodStats(method="", turns=1)
    started = time.perf_counter()
    drafter.begin(request, context)
    in_drafter = time.perf_counter() - started
    position = 0
    root = context[-1] if len(context) else -1
    while position < len(continuation):
        at = len(context) + position
        step = replay_step(drafter, request, root, continuation[position:], budget, at, planner)
        in_drafter += step.propose_seconds + step.feedback_seconds
        if costs is not None:
            stats.verify_seconds += costs.seconds(1, len(step.proposal), at)
            stats.plain_seconds += sum(costs.seconds(1, 0, at + k) for k in range(len(step.emitted)))
        stats.steps += 1
        stats.new_tokens += len(step.emitted)
        stats.accepted += min(step.accepted, len(step.emitted))
        stats.drafted += len(step.proposal)
        position += len(step.emitted)
        root = step.emitted[-1]
    clock = time.perf_counter()
    drafter.end(request)
    stats.drafter_seconds = in_drafter + time.perf_counter() - clock
    stats.seconds = time.perf_counter() - started
    return stats


def _category_cell(stats: MethodStats, modelled: bool) -> str:
    """A category's tokens per step and, where modelled, its speedup first; '-' where it ran no step."""
    if not stats.steps:
        return "-"
    tokens = f"{stats.mean_accepted:.2f}"
    return f"{stats.modelled_speedup:.2f}x ({tokens})" if modelled else tokens


def _describe(settings: Mapping[str, object]) -> str:
    """A drafter's settings on one line; ``priced`` says how its trees were sized."""
    rest = ", ".join(f"{key}={value}" for key, value in settings.items() if key != "priced")
    sizing = "trees priced and cut by the costs" if settings.get("priced") else "proposals verified whole"
    return f"{rest or 'defaults'} ({sizing})"


def _recorded(recording: Sequence[int], depths: Sequence[int]) -> Callable[[int], int]:
    """The replay's target model: the recorded token after each tree node, -1 past the recording."""
    end = len(recording)
    return lambda node: recording[depths[node]] if depths[node] < end else -1


@dataclass
class ReplayReport:
    settings: dict
    environment: dict
    methods: dict[str, MethodStats] = field(default_factory=dict)
    tasks: list[dict] = field(default_factory=list)
    """Per task: its id, its category (empty where the recording gives none) and, per method, its totals."""
    categories: dict[str, dict[str, MethodStats]] = field(default_factory=dict)
    """Per category the recording names, per method, the totals of its tasks."""

    def markdown(self) -> str:
        s = self.settings
        source = f" of {s['file']}" if "file" in s else ""
        lines = [
            f"Replay{source} ({s['tasks']} tasks, {s['turns']} turns, {s['tokens']} recorded tokens), "
            f"budget {s['budget']} nodes per step, {s['seconds']:.0f} s in all.",
            "",
            "| method | tokens/step | drafted/accepted | steps | accepted | drafted | seconds | drafter s | "
            "drafter ms/step | modelled speedup |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for m in self.methods.values():
            per_step = 1000 * m.drafter_seconds / m.steps if m.steps else 0.0
            ratio = "-" if m.drafted_per_accepted is None else f"{m.drafted_per_accepted:.2f}"
            modelled = "-" if m.modelled_speedup is None else f"{m.modelled_speedup:.2f}x"
            lines.append(
                f"| {m.method} | {m.mean_accepted:.2f} | {ratio} | {m.steps} | {m.accepted} | {m.drafted} | "
                f"{m.seconds:.1f} | {m.drafter_seconds:.1f} | {per_step:.3f} | {modelled} |"
            )
        lines += self._category_lines()
        drafters = s.get("drafters", {})
        if drafters:
            lines += ["", "Settings of each drafter:"]
            lines += [f"- {name}: {_describe(settings)}" for name, settings in drafters.items()]
        lines += [
            "",
            "tokens/step: mean tokens emitted per verification step, accepted drafts plus the bonus token "
            "(plain decoding: 1.00). drafted/accepted: draft tokens verified per accepted draft token. "
            "modelled speedup (with --costs): plain decoding's passes over the method's, each priced by "
            "the verification costs for its draft tokens and context (drafting time not included).",
        ]
        return "\n".join(lines)

    def _category_lines(self) -> list[str]:
        """Tokens per step by category and, with costs, the modelled speedup (each category's plain
        passes over its method's) and its mean over the categories that ran steps, as ``reader bench``
        summarizes."""
        if not self.categories:
            return []
        names = list(self.methods)
        modelled = all(m.modelled_speedup is not None for m in self.methods.values())
        lines = ["", "By category: " + ("modelled speedup (tokens/step)" if modelled else "tokens/step"), ""]
        lines += ["| category | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
        for category, stats in sorted(self.categories.items()):
            cells = [_category_cell(stats[name], modelled) for name in names]
            lines.append(f"| {category} | " + " | ".join(cells) + " |")
        if modelled:
            means = []
            for name in names:
                speedups = [c[name].modelled_speedup for c in self.categories.values() if c[name].steps]
                means.append(f"{sum(speedups) / len(speedups):.2f}x" if speedups else "-")
            lines.append("| **mean over categories** | " + " | ".join(means) + " |")
        return lines

    def as_dict(self) -> dict:
        return {
            "settings": self.settings,
            "environment": self.environment,
            "methods": {name: s.as_dict() for name, s in self.methods.items()},
            "categories": {
                category: {name: s.as_dict() for name, s in stats.items()}
                for category, stats in self.categories.items()
            },
            "tasks": self.tasks,
        }

    def save(self, directory: Path) -> None:
        """``replay.json`` and ``replay.md`` in ``directory``, each written atomically."""
        directory.mkdir(parents=True, exist_ok=True)
        write_atomic(directory / "replay.json", json.dumps(self.as_dict(), indent=1))
        write_atomic(directory / "replay.md", self.markdown() + "\n")


def run_replay(
    conversations: Sequence[Conversation],
    drafters: Mapping[str, Drafter],
    budget: int,
    *,
    settings: Mapping[str, object] | None = None,
    progress: bool = True,
    costs: CostModel | None = None,
    priced: Collection[str] = (),
) -> ReplayReport:
    """Replay every turn of every conversation through each drafter, turn by turn with the drafters
    interleaved, each drafter keeping its state across turns and tasks.

    With ``costs`` (batch-1 verification costs) every method's passes are timed by them, and the
    drafters ``priced`` names have their trees cut by them each step, as the engine's budget does."""
    if budget < 1:
        raise ValueError(f"budget must be at least 1, got {budget}")
    started = time.perf_counter()
    totals = {name: MethodStats(method=name) for name in drafters}
    pricing = (lambda: costs) if costs is not None else None
    planners = {
        name: BudgetPlanner(budget, pricing if name in priced else None, gated=False) for name in drafters
    }
    report = ReplayReport(
        settings={
            **(settings or {}),
            "budget": budget,
            "tasks": len(conversations),
            "turns": sum(len(c.turns) for c in conversations),
            "tokens": sum(b - a for c in conversations for a, b in c.turns),
            "drafters": {
                name: {**getattr(drafter, "settings", {}), "priced": costs is not None and name in priced}
                for name, drafter in drafters.items()
            },
        },
        environment={
            "python": platform.python_version(),
            "numpy": np.__version__,
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        methods=totals,
    )
    with tqdm(
        total=report.settings["turns"], desc="replay", unit="turn", file=sys.stderr, disable=not progress
    ) as bar:
        for task_index, conversation in enumerate(conversations):
            tokens = conversation.tokens.tolist()
            task_totals = {name: MethodStats(method=name, tasks=1) for name in drafters}
            for turn_index, (context_end, end) in enumerate(conversation.turns):
                context, continuation = tokens[:context_end], tokens[context_end:end]
                for name, drafter in drafters.items():
                    request = (task_index, turn_index)
                    turn = replay_turn(drafter, request, context, continuation, budget, costs, planners[name])
                    task_totals[name].add(turn)
                bar.update()
            groups = [totals]
            if conversation.category:
                new = {name: MethodStats(method=name) for name in drafters}
                groups.append(report.categories.setdefault(conversation.category, new))
            for name, stats in task_totals.items():
                for group in groups:
                    group[name].add(stats)
                    group[name].tasks += 1
            report.tasks.append(
                {
                    "id": conversation.id,
                    "category": conversation.category,
                    **{n: s.as_dict() for n, s in task_totals.items()},
                }
            )
            bar.set_postfix_str(" ".join(f"{n} {s.mean_accepted:.2f}" for n, s in totals.items()))
    report.settings["seconds"] = time.perf_counter() - started
    return report
