"""Replay mode: conversation tokenization, accepted-token arithmetic, the report, caching and the CLI."""

from __future__ import annotations

import gzip
import json
from dataclasses import replace

import numpy as np
import pytest

from reader_spec.bench import replay
from reader_spec.bench.replay import (
    Conversation,
    ReplayError,
    load_conversations,
    read_tasks,
    replay_turn,
    run_replay,
    tokenize_conversation,
)
from reader_spec.bench.runner import recorded
from reader_spec.bench.spec_bench import Question
from reader_spec.budget.costs import PROBE_CONTEXT, CostModel
from reader_spec.cli import main
from reader_spec.engine.tree import EMPTY_PROPOSAL, Proposal, chain_proposal
from reader_spec.loading import ModelLoadError, load_tokenizer
from reader_spec.prompts import encode_prompt
from tests.conftest import make_tiny_tokenizer

# Every turn ends with the end-of-sequence word w1, as chat models end theirs with an end-of-turn token.
TURN_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} w1 {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
# Words starting with "w1" other than w1 itself are avoided: the tokenizer splits the special w1 out of them.
CONVERSATION = [
    {"role": "system", "content": "w5 w6"},
    {"role": "user", "content": "w7 w8 w9"},
    {"role": "assistant", "content": "w20 w21 w7 w8"},
    {"role": "tool", "content": "w22"},
    {"role": "assistant", "content": "w9 w20"},
    {"role": "exit", "content": "w23"},
]


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = TURN_TEMPLATE
    return tokenizer


def test_contexts_are_the_chat_template_and_continuations_end_at_eos(tokenizer):
    tokens, turns = tokenize_conversation(tokenizer, CONVERSATION)
    assistant = [i for i, m in enumerate(CONVERSATION) if m["role"] == "assistant"]
    assert len(turns) == len(assistant) == 2
    for (context_end, end), index in zip(turns, assistant, strict=True):
        assert tokens[:context_end] == encode_prompt(tokenizer, CONVERSATION[:index])  # what a server sees
        content = tokenizer(CONVERSATION[index]["content"])["input_ids"]
        assert tokens[context_end:end] == [*content, tokenizer.eos_token_id]
    # Messages after the last assistant turn are dropped; the unknown role "tool" renders as w0.
    assert tokens[turns[-1][1] :] == []
    assert 0 in tokens[turns[0][1] : turns[1][0]]


def test_tokenization_errors(tokenizer):
    plain = make_tiny_tokenizer()
    plain.chat_template = None
    with pytest.raises(ReplayError, match="no chat template"):
        tokenize_conversation(plain, CONVERSATION)
    appends_always = make_tiny_tokenizer()  # conftest's template ends every prefix with <assistant>
    with pytest.raises(ReplayError, match="does not extend"):
        tokenize_conversation(appends_always, CONVERSATION)
    assert tokenize_conversation(tokenizer, CONVERSATION[:2]) == ([], [])


def conversation(context: list[int], turns: list[list[int]], between: list[int]) -> Conversation:
    """Hand-made tokens: a context, then turns separated by ``between`` (a tool message, say)."""
    tokens, spans = list(context), []
    for turn in turns:
        start = len(tokens)
        tokens += turn
        spans.append((start, len(tokens)))
        tokens += between
    return Conversation("hand", np.asarray(tokens, dtype=np.int32), tuple(spans))


class Oracle:
    """Proposes exactly what the recording holds next (past a turn's end too), as a chain."""

    def __init__(self, recording: list[int]):
        self.recording, self.texts = recording, {}

    def begin(self, request, prompt):
        self.texts[request] = list(prompt)

    def extend(self, request, tokens):
        self.texts[request] += tokens

    def propose(self, request, max_nodes):
        done = len(self.texts[request])
        upcoming = self.recording[done : done + max_nodes]
        return chain_proposal(upcoming, [1.0] * len(upcoming)) if upcoming else EMPTY_PROPOSAL

    def observe(self, request, proposal, accepted):
        assert all(0 <= node < len(proposal) for node in accepted)

    def end(self, request):
        del self.texts[request]


class Fixed(Oracle):
    """Always proposes the same proposal."""

    def __init__(self, proposal: Proposal):
        super().__init__([])
        self.proposal = proposal

    def propose(self, request, max_nodes):
        return self.proposal.truncated(max_nodes)


def test_oracle_accepts_the_whole_budget_and_stops_at_the_turn_end():
    recorded = list(range(10, 20))
    tokens = [1, 2, 3, *recorded, 4, 5, 6]
    stats = replay_turn(Oracle(tokens), "r", tokens[:3], recorded, budget=3)
    # Steps emit 3 accepted + 1 bonus, 3 + 1, then the last 2 (both drafted and accepted, no bonus).
    assert (stats.steps, stats.new_tokens, stats.accepted, stats.drafted) == (3, 10, 8, 9)
    assert stats.mean_accepted == pytest.approx(10 / 3)


def test_empty_and_wrong_drafters_score_exactly_one():
    recorded = [7, 8, 9, 7, 8]
    empty = replay_turn(Fixed(EMPTY_PROPOSAL), "r", [1, 2], recorded, budget=4)
    assert (empty.steps, empty.new_tokens, empty.accepted, empty.drafted) == (5, 5, 0, 0)
    assert empty.mean_accepted == 1.0 and empty.drafted_per_accepted is None
    wrong = replay_turn(Fixed(chain_proposal([90, 91, 92], [0.5] * 3)), "r", [1, 2], recorded, budget=2)
    assert (wrong.steps, wrong.new_tokens, wrong.accepted, wrong.drafted) == (5, 5, 0, 10)
    assert wrong.mean_accepted == 1.0


def test_trees_accept_along_the_branch_that_follows_the_recording():
    # Root children 90 (likelier, wrong) and 7; below 7: 8 then 50 (wrong) -> accepts 7 8, bonus 9.
    tree = Proposal((90, 7, 8, 50), (-1, -1, 1, 2), (0.9, 0.5, 0.4, 0.3))
    stats = replay_turn(Fixed(tree), "r", [1], [7, 8, 9], budget=4)
    assert (stats.steps, stats.new_tokens, stats.accepted, stats.drafted) == (1, 3, 2, 4)
    cut = replay_turn(Fixed(tree), "r", [1], [7, 8, 9], budget=2)  # the budget keeps 90 and 7 only
    assert (cut.steps, cut.accepted) == (2, 1)


class Recorder(Oracle):
    """An oracle that logs the calls it gets."""

    def __init__(self, recording):
        super().__init__(recording)
        self.calls = []

    def begin(self, request, prompt):
        self.calls.append(("begin", request, len(prompt)))
        super().begin(request, prompt)

    def end(self, request):
        self.calls.append(("end", request))
        super().end(request)


def test_run_replay_keeps_one_drafter_per_method_across_turns(tmp_path):
    convo = conversation([1, 2, 3], [[10, 11, 12, 13], [20, 21, 22]], [4, 5])
    recorder = Recorder(convo.tokens.tolist())
    report = run_replay(
        [convo, convo], {"oracle": recorder, "none": Fixed(EMPTY_PROPOSAL)}, 2, progress=False
    )
    begins = [c for c in recorder.calls if c[0] == "begin"]
    assert [c[2] for c in begins] == [3, 9, 3, 9]  # contexts: before turn 1, before turn 2, twice
    assert len({c[1] for c in begins}) == 4 and recorder.calls[1] == ("end", begins[0][1])
    oracle, none = report.methods["oracle"], report.methods["none"]
    assert (oracle.tasks, oracle.turns, oracle.new_tokens) == (2, 4, 14)
    assert oracle.steps == 2 * (2 + 1) and none.steps == none.new_tokens == 14
    assert report.settings["turns"] == 4 and report.settings["tokens"] == 14
    assert [t["id"] for t in report.tasks] == ["hand", "hand"]
    assert sum(t["oracle"]["steps"] for t in report.tasks) == oracle.steps
    report.save(tmp_path)
    saved = json.loads((tmp_path / "replay.json").read_text())
    assert saved["methods"]["none"]["mean_accepted"] == 1.0
    assert "| oracle | 2.33 |" in (tmp_path / "replay.md").read_text()
    with pytest.raises(ValueError):
        run_replay([convo], {"none": Fixed(EMPTY_PROPOSAL)}, 0, progress=False)


def test_priced_replay_stops_verifying_drafts_that_fall_short_of_their_estimates():
    """Sure-looking drafts that are never accepted: the priced replay learns it, as the engine does."""
    convo = conversation([1, 2, 3], [list(range(10, 70))], [4, 5])
    wrong = chain_proposal([99, 98, 97, 96], [0.9, 0.85, 0.8, 0.75])
    costs = CostModel({PROBE_CONTEXT: {1: {d: 1.0 + 0.2 * d for d in range(9)}}}, budget=4)
    report = run_replay([convo], {"priced": Fixed(wrong)}, 4, progress=False, costs=costs, priced=["priced"])
    priced = report.methods["priced"]
    assert priced.steps == 60 and priced.accepted == 0
    assert 4 <= priced.drafted < 60  # all four nodes at first (rate 2.39 against 1.00), then few


def test_priced_replay_cuts_each_tree_where_the_rate_is_best(tmp_path):
    convo = conversation([1, 2, 3], [[10, 11, 12, 13]], [4, 5])
    chain = chain_proposal([10, 11, 99, 98], [0.9, 0.6, 0.05, 0.01])
    # Each draft token adds a fifth of a pass: tokens per second 1.00, 1.58, 1.79, 1.59, 1.43 for 0..4
    # nodes, so two are kept.
    costs = CostModel({PROBE_CONTEXT: {1: {d: 1.0 + 0.2 * d for d in range(9)}}}, budget=4)
    drafters = {"priced": Fixed(chain), "whole": Fixed(chain)}
    report = run_replay([convo], drafters, 4, progress=False, costs=costs, priced=["priced"])
    priced, whole = report.methods["priced"], report.methods["whole"]
    assert priced.drafted == 2 * priced.steps and whole.drafted == 4 * whole.steps
    assert priced.accepted == whole.accepted  # the cut nodes were never accepted
    # Modelled time: 4 tokens emitted in 2 steps (3, then the last 1); plain decoding takes 4 passes.
    assert priced.steps == 2 and priced.plain_seconds == pytest.approx(4.0)
    assert priced.verify_seconds == pytest.approx(2 * 1.4) and whole.verify_seconds == pytest.approx(2 * 1.8)
    assert priced.modelled_speedup == pytest.approx(4 / 2.8)
    assert "| priced | 2.00 |" in report.markdown() and "1.43x |" in report.markdown()


def test_replay_reports_each_category_and_their_mean_as_the_bench_does():
    costs = CostModel({PROBE_CONTEXT: {1: {d: 1.0 + 0.2 * d for d in range(9)}}}, budget=4)
    short = conversation([1, 2, 3], [[10, 11, 12, 13]], [4, 5])  # 4 tokens in 1 step: 4 / 1.8
    long = conversation([1, 2, 3], [list(range(10, 18))], [4, 5])  # 8 tokens in 2 steps: 8 / 3.6
    categories = [(short, "coding"), (long, "coding"), (short, "qa"), (long, "")]
    tasks = [replace(task, category=category) for task, category in categories]
    tasks.append(replace(short, turns=(), category="writing"))  # no turn: no step, no speedup
    oracle = Oracle(long.tokens.tolist())  # the short turn is the long one's beginning
    report = run_replay(tasks, {"oracle": oracle}, 4, progress=False, costs=costs)
    coding, qa = report.categories["coding"]["oracle"], report.categories["qa"]["oracle"]
    assert set(report.categories) == {"coding", "qa", "writing"}  # the task without one joins none
    assert (coding.tasks, coding.new_tokens, coding.steps) == (2, 12, 3) and qa.tasks == 1
    assert coding.modelled_speedup == pytest.approx(12 / 5.4)
    assert qa.modelled_speedup == pytest.approx(4 / 1.8)
    assert report.methods["oracle"].tasks == 5 and [t["category"] for t in report.tasks] == [
        "coding", "coding", "qa", "", "writing"
    ]  # fmt: skip
    text = report.markdown()
    assert "| coding | 2.22x (4.00) |" in text and "| qa | 2.22x (4.00) |" in text
    assert "| writing | - |" in text and "| **mean over categories** | 2.22x |" in text
    assert (
        "categories" in report.as_dict()
        and "By category" not in run_replay([short], {"oracle": oracle}, 4, progress=False).markdown()
    )


def test_cli_priced_replay_needs_batch_1_costs(tmp_path, tokenizer, monkeypatch, capsys):
    monkeypatch.setenv("READER_SPEC_CACHE", str(tmp_path / "cache"))
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    path = tmp_path / "tasks.jsonl.gz"
    write_tasks(path, [{"instance_id": "a", "messages": CONVERSATION}])
    costs = tmp_path / "costs.json"
    argv = ["bench", "--replay", str(path), "--model", str(tmp_path / "tokenizer"), "--costs", str(costs)]
    assert main(argv) == 2 and "no batch-1 verification costs" in capsys.readouterr().err
    costs.write_text(json.dumps({PROBE_CONTEXT: {1: {d: 0.01 + 0.001 * d for d in range(17)}}}))
    assert main([*argv, "--methods", "suffix", "reader", "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "replay.json").read_text())["settings"]["costs"] == str(costs)
    assert main(["bench", "--costs", str(costs)]) == 2 and "needs --replay" in capsys.readouterr().err


def write_tasks(path, tasks) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for task in tasks:
            f.write(json.dumps(task) + "\n")


def test_conversations_are_cached(tmp_path, tokenizer, monkeypatch):
    path = tmp_path / "tasks.jsonl.gz"
    tasks = [{"instance_id": "a", "category": "qa", "messages": CONVERSATION}, {"messages": CONVERSATION[:3]}]
    write_tasks(path, tasks)
    first = load_conversations(path, tokenizer, "fp", tmp_path / "cache")
    assert [c.id for c in first] == ["a", "2"] and [len(c.turns) for c in first] == [2, 1]
    assert [c.category for c in first] == ["qa", ""]

    def no_tokenizing(*args):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(replay, "tokenize_conversation", no_tokenizing)
    again = load_conversations(path, tokenizer, "fp", tmp_path / "cache")
    assert [(c.id, c.tokens.tolist(), c.turns, c.category) for c in again] == [
        (c.id, c.tokens.tolist(), c.turns, c.category) for c in first
    ]
    with pytest.raises(AssertionError):  # another tokenizer fingerprint is another cache entry
        load_conversations(path, tokenizer, "other", tmp_path / "cache")


def test_a_bench_recording_replays_turn_by_turn(tmp_path, tokenizer):
    question = Question(7, "coding", ("w7 w8", "w9"))
    path = tmp_path / "recording.jsonl"
    path.write_text(json.dumps(recorded(question, ["w20 w21", "w22"])) + "\n")
    (convo,) = load_conversations(path, tokenizer, "fp")
    assert (convo.id, convo.category, len(convo.turns)) == ("coding-7", "coding", 2)
    words = [tokenizer.decode(convo.tokens[a:b].tolist()).split() for a, b in convo.turns]
    assert words == [["w20", "w21", "w1"], ["w22", "w1"]]  # each answer, closed by the end of its turn


def test_malformed_recordings(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user"}]}\n')
    with pytest.raises(ReplayError, match=r"bad\.jsonl:1"):
        read_tasks(bad)
    bad.write_text("{not json\n")
    with pytest.raises(ReplayError, match="not valid JSON"):
        read_tasks(bad)
    bad.write_text(json.dumps({"category": 3, "messages": CONVERSATION}) + "\n")
    with pytest.raises(ReplayError, match="'category' must be a string"):
        read_tasks(bad)


def test_cli_replay(tmp_path, tokenizer, monkeypatch, capsys):
    monkeypatch.setenv("READER_SPEC_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "tokenizer"
    tokenizer.save_pretrained(model)
    path = tmp_path / "tasks.jsonl.gz"
    write_tasks(path, [{"instance_id": "a", "messages": CONVERSATION}] * 2)
    out = tmp_path / "out"
    argv = ["bench", "--replay", str(path), "--model", str(model), "--budget", "4", "--limit", "1"]
    assert main([*argv, "--methods", "pld,suffix", "reader", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| pld |" in printed and "| suffix |" in printed and "| reader |" in printed
    saved = json.loads((out / "replay.json").read_text())
    assert saved["settings"]["tasks"] == 1 and saved["settings"]["budget"] == 4
    assert set(saved["methods"]) == {"pld", "suffix", "reader"}
    drafters = saved["settings"]["drafters"]  # each peer is reported with its settings
    assert drafters["suffix"] == {
        "max_depth": 64,
        "max_spec_factor": 1.0,
        "max_spec_offset": 0.0,
        "min_token_prob": 0.1,
        "use_tree": True,
        "priced": False,
    }
    assert drafters["pld"] == {"num_tokens": 10, "max_ngram": 2, "min_ngram": 1, "priced": False}
    assert drafters["reader"]["sources"] == "context+history" and drafters["reader"]["max_depth"] == 16
    assert "- suffix: max_depth=64, max_spec_factor=1.0" in printed
    assert "(proposals verified whole)" in printed
    assert main([*argv, "--methods", "eagle"]) == 2
    assert "unknown replay method eagle" in capsys.readouterr().err


def test_load_tokenizer_only(tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path / "tok")
    loaded = load_tokenizer(tmp_path / "tok")
    assert loaded.name == str(tmp_path / "tok") and loaded.tokenizer.chat_template == TURN_TEMPLATE
    (tmp_path / "empty").mkdir()
    for bad in (tmp_path / "empty", tmp_path / "missing", tmp_path / "missing.gguf"):
        with pytest.raises(ModelLoadError):
            load_tokenizer(bad)


def test_cli_replay_with_a_datastore(tmp_path, tokenizer, monkeypatch, capsys):
    """--datastore reaches the replayed reader drafter; one built with another tokenizer is refused."""
    from reader_spec.drafters.retrieval.datastore import Datastore

    monkeypatch.setenv("READER_SPEC_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "tokenizer"
    tokenizer.save_pretrained(model)
    path = tmp_path / "tasks.jsonl.gz"
    write_tasks(path, [{"instance_id": "a", "messages": CONVERSATION}])
    (conversation,) = load_conversations(path, tokenizer, load_tokenizer(model).fingerprint, tmp_path / "c")
    fingerprint = load_tokenizer(model).fingerprint
    Datastore.build(tmp_path / "store", [conversation.tokens.tolist()], fingerprint=fingerprint, model="m")
    Datastore.build(tmp_path / "other", [conversation.tokens.tolist()], fingerprint="other", model="m")
    argv = ["bench", "--replay", str(path), "--model", str(model), "--budget", "4", "--methods", "reader"]
    assert main([*argv, "--datastore", str(tmp_path / "store"), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "sources=context+history+datastore" in printed
    saved = json.loads((tmp_path / "out" / "replay.json").read_text())
    assert saved["settings"]["datastore"] == str(tmp_path / "store")
    assert saved["methods"]["reader"]["accepted"] > 0  # the datastore holds the whole recording
    assert main([*argv, "--datastore", str(tmp_path / "other")]) == 2
    assert "tokenizer" in capsys.readouterr().err
