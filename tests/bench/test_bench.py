"""``reader bench`` on the tiny model: metric definitions, methods, multi-turn prompts, files, CLI."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

import reader_spec.bench.runner as bench
from reader_spec.bench.methods import METHODS, BenchSetup, Generation, MethodSpec, engine_method, generate
from reader_spec.bench.results import (
    BatchResult,
    PromptResult,
    batch_speedup,
    category_means,
    markdown,
    pooled_mean_accepted,
    question_speed,
    source_shares,
    summarize,
)
from reader_spec.bench.runner import recorded, run_bench, turn_messages
from reader_spec.bench.spec_bench import Question, load_questions
from reader_spec.cli import main
from reader_spec.config import SAMPLING_FIELDS, GenerationConfig
from reader_spec.drafters import DRAFTERS
from reader_spec.engine.loop import Engine
from reader_spec.engine.runner import forward_fingerprint
from reader_spec.loading import LoadedModel, tokenizer_fingerprint
from reader_spec.prompts import PromptError, encode_prompt
from tests.conftest import make_tiny_llama

QUESTIONS = [
    Question(1, "coding", ("w5 w6 w7 w5 w6 w7 w5 w6", "w8 w9 w8 w9 w8")),
    Question(2, "rag", ("w20 w21 w22 w20 w21 w22 w20",)),
    Question(3, "math_reasoning", ("w30 w31 w30 w31 w30 w31",)),
]
TURNS = 4
MAX_NEW = 16


@pytest.fixture(scope="module", autouse=True)
def isolated_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("READER_SPEC_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


class CountingBar:
    """Stands in for tqdm: records the announced total and every update."""

    def __init__(self, total, **kwargs):
        self.total, self.n = total, 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


@pytest.fixture(scope="module")
def bench_run(tiny):
    """The report of one small run, and the progress bars it drew."""
    bars = []

    def make_bar(total, **kwargs):
        bars.append(CountingBar(total))
        return bars[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench, "tqdm", make_bar)
        # Every step proposes a whole tree of the run's budget: on the tiny model drafting rarely pays
        # for itself, so trees sized from measured costs are small or none, as the host's load has it
        # (a CI run accepted no context token), and the report's accounting of drafts is what these
        # tests check.
        fixed = dataclasses.replace(DRAFTERS["reader"], adaptive=False)
        patch.setitem(METHODS, "reader", engine_method(fixed))
        report = run_bench(
            tiny, QUESTIONS, ["ar", "reader", "hf", "hf-pld"], max_new_tokens=MAX_NEW, batch_sizes=[1, 2]
        )
    return report, bars


@pytest.fixture(scope="module")
def report(bench_run):
    return bench_run[0]


def result(
    question=1, category="a", turn=0, method="ar", seconds=1.0, new_tokens=10, lengths=None, same=True
):
    lengths = [1] * new_tokens if lengths is None else lengths
    return PromptResult(
        question, category, turn, method, seconds, 5, new_tokens, lengths, 0, 0.0, seconds, same, 100.0
    )


# --- metric definitions ------------------------------------------------------------------------------
def test_mean_accepted_counts_the_bonus_token():
    assert pooled_mean_accepted([[3, 1], [2]]) == 2.0  # 6 tokens in 3 steps
    assert pooled_mean_accepted([[1] * 7, [1] * 3]) == 1.0  # plain decoding
    assert pooled_mean_accepted([]) == 1.0


def test_speedup_averages_per_question_speeds_like_spec_bench():
    results = [
        result(1, "a", 0, "ar", seconds=2.0),
        result(1, "a", 0, "m", seconds=0.5),
        result(2, "b", 0, "ar", seconds=1.0),  # two turns: 20 tokens in 4 s = 5 tokens/s
        result(2, "b", 1, "ar", seconds=3.0),
        result(2, "b", 0, "m", seconds=1.0),  # 20 tokens in 2 s = 10 tokens/s
        result(2, "b", 1, "m", seconds=1.0, same=False),
    ]
    rows = {(r.category, r.method): r for r in summarize(results)}
    assert rows["a", "m"].speedup == pytest.approx(2.0 / 0.5)  # one question: ar seconds / method seconds
    assert rows["b", "m"].speedup == pytest.approx(2.0)
    assert question_speed(r for r in results if r.method == "m") == pytest.approx((20 + 10) / 2)
    assert rows["overall", "m"].speedup == pytest.approx(15 / 5)  # not total tokens / total time (2.4)
    assert rows["overall", "ar"].speedup == 1.0
    assert rows["b", "m"].identical == 0.5 and rows["a", "m"].identical == 1.0
    assert rows["overall", "m"].identical == pytest.approx(2 / 3)
    assert rows["overall", "m"].questions == 2 and rows["overall", "m"].prompts == 3


def test_the_mean_over_categories_weighs_categories_alike():
    """Three questions 4x faster in one category and one question level in another: 2.5x in the mean
    over categories, 2.8x overall (per-question speeds averaged over the four questions)."""
    results = [result(q, "a", 0, "ar", seconds=2.0) for q in (1, 2, 3)]
    results += [result(q, "a", 0, "m", seconds=0.5) for q in (1, 2, 3)]
    results += [result(4, "b", 0, "ar", seconds=1.0), result(4, "b", 0, "m", seconds=1.0)]
    rows = summarize(results)
    assert category_means(rows) == {"ar": 1.0, "m": pytest.approx(2.5)}
    overall = {r.method: r for r in rows if r.category == "overall"}
    assert overall["m"].speedup == pytest.approx(17.5 / 6.25)
    assert "| **mean over categories** |  | 2.50x |" in markdown({}, {}, results, [])


def test_batch_speedup_pairs_each_repeat_with_ar_run_next_to_it():
    def batch(method, run_seconds, new_tokens=100):
        seconds = sorted(run_seconds)[len(run_seconds) // 2]
        return BatchResult(
            method=method,
            batch_size=8,
            seconds=seconds,
            requests=4,
            identical=4,
            peak_rss_mib=1.0,
            steps=new_tokens,
            new_tokens=new_tokens,
            drafted=0,
            run_seconds=tuple(run_seconds),
        )

    # The host ran fast for the first pair, slow for the last two: each run 10% under ar's beside it.
    ar, method = batch("ar", [10.0, 20.0, 20.0]), batch("m", [9.0, 18.0, 18.0])
    assert batch_speedup(method, [ar, method]) == pytest.approx(10 / 9)
    # The median runs alone (20 s and 18 s) agree here; with the drift inside one pair they would not.
    ar, method = batch("ar", [10.0, 20.0, 20.0]), batch("m", [9.0, 9.5, 22.0])
    assert batch_speedup(method, [ar, method]) == pytest.approx(10 / 9)  # ratios 1.11, 2.11, 0.91
    assert method.tokens_per_second / ar.tokens_per_second == pytest.approx(20 / 9.5)
    single = batch("m", [5.0], new_tokens=50)  # one run: throughput over ar's
    assert batch_speedup(single, [batch("ar", [10.0])]) == pytest.approx(1.0)


def test_time_shares_add_up():
    mine = result(method="ar", seconds=2.0)
    mine.draft_seconds, mine.verify_seconds = 0.5, 1.0
    (row,) = [r for r in summarize([mine]) if r.category == "overall"]
    assert (row.draft_share, row.verify_share, row.other_share) == (0.25, 0.5, 0.25)


# --- methods -----------------------------------------------------------------------------------------
def test_turn_messages_carry_earlier_answers():
    q = Question(9, "writing", ("first?", "second?"))
    assert turn_messages(q, 0, []) == [{"role": "user", "content": "first?"}]
    assert turn_messages(q, 1, ["answer one"]) == [
        {"role": "user", "content": "first?"},
        {"role": "assistant", "content": "answer one"},
        {"role": "user", "content": "second?"},
    ]


def eos_model(tiny, prompt):
    """The tiny model whose tokenizer (not model config) names a token ``ar`` emits early as eos.

    ``transformers`` reads only the model's generation config, so equal stopping needs the bench to pass
    the engine's end-of-sequence ids explicitly.
    """
    (plain,) = Engine(tiny).generate([prompt])
    eos = plain.tokens[4]
    model = make_tiny_llama()  # same seed, same weights as ``tiny``
    model.generation_config.eos_token_id = None
    tokenizer = copy.deepcopy(tiny.tokenizer)
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    return LoadedModel(model, tokenizer, "tiny-eos", tokenizer_fingerprint(tokenizer)), eos


@pytest.mark.parametrize("name", ["hf", "hf-pld", "hf-assisted"])
def test_transformers_methods_equal_ar_and_stop_at_eos(tiny, name):
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [20, 21, 22, 20, 21, 22, 20, 21, 22, 23], [9, 10, 9, 10]]
    loaded, eos = eos_model(tiny, prompts[0])
    setup = BenchSetup(
        loaded, draft=LoadedModel(make_tiny_llama(), tiny.tokenizer, "draft", tiny.fingerprint)
    )
    ar, method = METHODS["ar"].build(setup), METHODS[name].build(setup)
    want = generate(ar, prompts, 30, 1, lambda: None)
    got = generate(method, prompts, 30, 1, lambda: None)
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert got[0].tokens[-1] == eos and len(got[0].tokens) <= 5  # stopped at eos, kept it
    assert any(len(g.tokens) == 30 for g in got)  # and at max_new_tokens elsewhere
    for g in got:
        assert sum(g.accept_lengths) == len(g.tokens) and min(g.accept_lengths) >= 1
        assert g.verify_seconds > 0
    if name == "hf":
        assert all(set(g.accept_lengths) == {1} and g.drafted == 0 for g in got)
        batched = generate(method, prompts, 30, 2, lambda: None)  # finished rows get padded
        assert [g.tokens for g in batched] == [w.tokens for w in want]
    elif name == "hf-pld":
        assert sum(g.drafted for g in got) > 0
    else:  # the draft model has the target's weights, so its drafts are accepted
        assert all(max(g.accept_lengths) > 1 for g in got)


def test_hf_batches_but_drafting_hf_methods_do_not(tiny):
    setup = BenchSetup(tiny)
    assert METHODS["hf"].build(setup).can_batch
    with pytest.raises(ValueError, match="batch size 1"):
        generate(METHODS["hf-pld"].build(setup), [[5, 6], [7, 8]], 4, 2, lambda: None)
    with pytest.raises(ValueError, match="--draft-model"):
        METHODS["hf-assisted"].build(setup)


def test_unknown_method_fails_before_any_work(tiny):
    with pytest.raises(ValueError, match="unknown methods"):
        run_bench(tiny, QUESTIONS, ["ar", "nope"])


class Recorder:
    """A method that records its prompts and answers one token, a prompt a step."""

    can_batch, speculative = True, False

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    def warm_up(self, batch_size):
        pass

    def reset(self):
        pass

    def reserve(self, prompts, max_new_tokens, batch_size):
        pass

    def steps(self, prompts, max_new_tokens, batch_size, on_finish):
        for prompt in prompts:
            self.prompts.append(prompt)
            on_finish()
            yield
        return [Generation([5], [1], 0, 0.0, 0.0) for _ in prompts]


class Remembering(Recorder):
    """Like a history drafter: remembers every prompt until reset, and notes any it meets again."""

    def __init__(self) -> None:
        super().__init__()
        self.remembered: list[list[int]] = []
        self.met_again = 0
        self.passes = 0

    def reset(self):
        self.remembered = []
        self.passes += 1

    def steps(self, prompts, max_new_tokens, batch_size, on_finish):
        self.met_again += sum(p in self.remembered for p in prompts)
        self.remembered += prompts
        return (yield from super().steps(prompts, max_new_tokens, batch_size, on_finish))


@pytest.mark.parametrize("batch_sizes", [[1], [2]])
def test_second_turn_carries_ar_first_answer(tiny, monkeypatch, batch_sizes):
    recorder = Recorder()
    monkeypatch.setitem(METHODS, "rec", MethodSpec(lambda setup: recorder))
    question = QUESTIONS[0]
    run_bench(tiny, [question], ["ar", "rec"], max_new_tokens=MAX_NEW, batch_sizes=batch_sizes)
    first = encode_prompt(tiny.tokenizer, turn_messages(question, 0, []))
    (answer,) = Engine(tiny).generate([first], GenerationConfig(max_new_tokens=MAX_NEW))
    words = tiny.tokenizer.decode(answer.tokens, skip_special_tokens=True)
    assert len(words.split()) > 3
    second = encode_prompt(tiny.tokenizer, turn_messages(question, 1, [words]))
    assert recorder.prompts == [first, second]
    answer_ids = tiny.tokenizer(words)["input_ids"]
    assert any(second[i : i + len(answer_ids)] == answer_ids for i in range(len(second)))


def test_an_untimed_engine_answers_the_first_turns_batches_carry(tiny, monkeypatch):
    """Without batch 1, earlier turns' answers come from an ``ar`` of their own: the timed ``ar``
    that made them ran its batches slower than its twin, which favoured the other methods."""
    built: list[Recorder] = []
    monkeypatch.setitem(METHODS, "ar", MethodSpec(lambda setup: built.append(Recorder()) or built[-1]))
    question = QUESTIONS[0]
    run_bench(tiny, [question], ["ar"], max_new_tokens=MAX_NEW, batch_sizes=[2])
    first = encode_prompt(tiny.tokenizer, turn_messages(question, 0, []))
    timed, filler = built
    assert filler.prompts == [first]
    assert timed.prompts[0] == first and len(timed.prompts) == len(question.turns)


def test_repeats_and_batch_sizes_never_see_their_own_earlier_runs(tiny, monkeypatch):
    remembering = Remembering()
    monkeypatch.setitem(METHODS, "mem", MethodSpec(lambda setup: remembering))
    report = run_bench(tiny, QUESTIONS, ["mem"], max_new_tokens=4, repeats=2, batch_sizes=[1, 2, 3])
    assert remembering.met_again == 0
    assert remembering.passes == 2 + 2 * 2  # each repeat at batch 1, and at batch 2 and 3
    assert len(remembering.prompts) == 3 * 2 * TURNS
    assert len(report.prompts) == 2 * TURNS  # medians of the repeats, for ar and mem


def test_batched_methods_take_turns(tiny, monkeypatch):
    """The machine drifts from minute to minute: at a batch size above 1 the methods take turns of
    ``TURN_SECONDS`` (each running whole pieces), in the reverse order every other round and who goes
    first alternating between repeats; each is timed over its own pieces."""
    clock = [0.0]  # advanced only by the slow method's pieces
    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(bench, "TURN_SECONDS", 0.12)
    order = []

    class Named(Recorder):
        def __init__(self, name, seconds):
            super().__init__()
            self.name, self.seconds = name, seconds

        def steps(self, prompts, max_new_tokens, batch_size, on_finish):
            for _ in prompts:
                order.append((self.name, batch_size))
                clock[0] += self.seconds
                on_finish()
                yield
            return [Generation([5], [1], 0, 0.0, 0.0) for _ in prompts]

    for name, seconds in (("slow", 0.05), ("quick", 0.0)):
        monkeypatch.setitem(METHODS, name, MethodSpec(lambda setup, n=name, s=seconds: Named(n, s)))
    report = run_bench(tiny, QUESTIONS, ["slow", "quick"], max_new_tokens=4, repeats=2, batch_sizes=[2])
    pieces = [name for name, size in order if size == 2]
    first = ["slow"] * 3 + ["quick"] * TURNS + ["slow"] * (TURNS - 3)  # ar, slow, quick; then back
    second = ["quick"] * TURNS + ["slow"] * TURNS  # quick, slow, ar
    assert pieces == first + second
    seconds = {b.method: b.run_seconds for b in report.batches}
    assert seconds["slow"] == pytest.approx((0.05 * TURNS,) * 2) and seconds["quick"] == (0.0, 0.0)


# --- the whole run -----------------------------------------------------------------------------------
def test_report_figures(report):
    assert len(report.prompts) == TURNS * 4
    assert {(r.question, r.turn) for r in report.prompts} == {(1, 0), (1, 1), (2, 0), (3, 0)}
    for r in report.prompts:
        assert sum(r.accept_lengths) == r.new_tokens and r.peak_rss_mib > 0
        assert r.identical, f"{r.method} differs from ar on question {r.question} turn {r.turn}"
    rows = {(s.category, s.method): s for s in summarize(report.prompts)}
    assert rows["overall", "ar"].mean_accepted == 1.0 and rows["overall", "hf"].mean_accepted == 1.0
    assert rows["overall", "ar"].speedup == 1.0
    assert any(max(r.accept_lengths) > 1 for r in report.prompts if r.method in ("reader", "hf-pld"))
    assert [(b.method, b.batch_size) for b in report.batches] == [("ar", 2), ("reader", 2), ("hf", 2)]
    assert all(b.identical == b.requests == TURNS for b in report.batches)
    assert report.settings["batch_1_only"] == ["hf-pld"]


def test_engine_methods_prefill_a_second_turn_past_their_first_turns_text(report):
    turns = {(r.method, r.turn): r for r in report.prompts if r.question == 1}
    for method in ("ar", "reader"):
        assert turns[method, 1].cached_tokens >= turns[method, 0].prompt_tokens
        assert turns[method, 1].cached_tokens < turns[method, 1].prompt_tokens
    assert turns["hf", 1].cached_tokens == turns["hf-pld", 1].cached_tokens == 0
    assert report.settings["prefix_reuse"] is True


def test_accepted_tokens_are_attributed_to_sources(report):
    for r in report.prompts:
        attributed = sum(r.accepted_by_source.values())
        if r.method != "reader":
            assert attributed == 0
            continue
        # Every step emits its accepted drafts plus one token of the model's, except a last step cut
        # by the length limit, which may emit only drafts.
        assert r.new_tokens - r.steps <= attributed <= r.new_tokens - r.steps + 1
        assert set(r.accepted_by_source) <= {"context", "history", "context-half", "history-half"}
    assert any(r.accepted_by_source.get("context") for r in report.prompts)
    shares = source_shares(result(method="reader") for _ in range(2))
    assert shares == {}
    mixed = [result(method="reader"), result(method="reader")]
    mixed[0].accepted_by_source, mixed[1].accepted_by_source = {"context": 3}, {"context": 1, "history": 4}
    assert source_shares(mixed) == {"context": 0.5, "history": 0.5}


def test_progress_bar_total_matches_its_updates(bench_run):
    _, [bar] = bench_run
    assert bar.total == bar.n == TURNS * 4 + TURNS * 3  # batch 1: every method; batch 2: three methods


def test_saved_files(report, tmp_path):
    written = report.save(tmp_path / "out")
    names = sorted(p.name for p in written)
    assert names == sorted(
        [
            "results.json",
            "results.md",
            "speedup_by_category.png",
            "accept_lengths.png",
            "throughput_by_batch.png",
            "recording.jsonl",
        ]
    )
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == names  # no temporary files left
    payload = json.loads((tmp_path / "out" / "results.json").read_text())
    assert {"cpu", "cores", "torch", "transformers", "model", "commit", "date"} <= set(payload["environment"])
    assert payload["environment"]["compiled_kernels"] is True  # make builds them on this machine
    assert payload["environment"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    results_md = (tmp_path / "out" / "results.md").read_text()
    assert f"{payload['environment']['cpu_capability']}), " in results_md  # which host, in every file
    assert payload["environment"]["forward"] == forward_fingerprint()
    assert len(payload["prompts"]) == TURNS * 4 and "accept_lengths" in payload["prompts"][0]
    assert {"speedup", "mean_accepted", "identical", "peak_rss_mib"} <= set(payload["summary"][0])
    means = payload["mean_over_categories"]
    assert set(means) == {"ar", "reader", "hf", "hf-pld"} and means["ar"] == 1.0
    assert f"| **mean over categories** |  | {means['reader']:.2f}x |" in results_md
    assert payload["batches"][0]["tokens_per_second"] > 0
    text = (tmp_path / "out" / "results.md").read_text()
    assert "| **overall** |" in text and "| hf-pld | 2 | n/a" in text and "| reader | 2 |" in text
    for name in names:
        if name.endswith(".png"):
            assert (tmp_path / "out" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_recording_holds_ar_answers_to_every_turn(report, tiny):
    tasks = {task["id"]: task for task in report.recording}
    assert list(tasks) == ["coding-1", "rag-2", "math_reasoning-3"]
    coding = tasks["coding-1"]
    assert coding["category"] == "coding" and [m["role"] for m in coding["messages"]] == [
        "user", "assistant", "user", "assistant"
    ]  # fmt: skip
    question, engine, config = QUESTIONS[0], Engine(tiny), GenerationConfig(max_new_tokens=MAX_NEW)
    answers = []
    for turn in range(2):
        prompt = encode_prompt(tiny.tokenizer, turn_messages(question, turn, answers))
        (output,) = engine.generate([prompt], config)
        answers.append(tiny.tokenizer.decode(output.tokens, skip_special_tokens=True))
    contents = [m["content"] for m in coding["messages"]]
    assert contents == [question.turns[0], answers[0], question.turns[1], answers[1]]
    assert recorded(question, answers) == coding


# --- command line ------------------------------------------------------------------------------------
@pytest.fixture
def suite(tmp_path):
    path = tmp_path / "suite.jsonl"
    lines = [{"question_id": q.id, "category": q.category, "turns": list(q.turns)} for q in QUESTIONS]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def test_cli_bench_writes_results(capsys, tiny_llama_dir, suite, tmp_path):
    argv = ["bench", "--model", str(tiny_llama_dir), "--suite", str(suite), "--max-new-tokens", "6"]
    code = main([*argv, "--categories", "coding,rag", "--methods", "hf", "--draft-model",
                 str(tiny_llama_dir), "--out", str(tmp_path / "out")])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "| **overall** |" in out and "results.json" in out
    payload = json.loads((tmp_path / "out" / "results.json").read_text())
    assert payload["settings"]["methods"] == ["ar", "hf"] and payload["settings"]["prompts"] == 3
    assert payload["environment"]["draft_model"] == str(tiny_llama_dir)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{oops", "not valid JSON"),
        ('{"question_id": 1, "turns": []}', "not a Spec-Bench"),
        ('{"question_id": 1, "category": "qa", "turns": []}', "not a Spec-Bench"),
        ('{"question_id": 1, "category": "qa", "turns": "one string"}', "not a Spec-Bench"),
        ('{"question_id": 1, "category": "qa", "turns": ["a", 2]}', "not a Spec-Bench"),
    ],
)
def test_bad_suite_lines_name_the_line(tmp_path, line, message):
    path = tmp_path / "suite.jsonl"
    path.write_text('{"question_id": 1, "category": "qa", "turns": ["w1"]}\n\n' + line + "\n")
    with pytest.raises(PromptError, match=f"suite.jsonl:3: {message}"):
        load_questions(path)


def test_cli_bench_selects_questions_by_id_parity(capsys, tiny_llama_dir, suite, tmp_path):
    argv = ["bench", "--model", str(tiny_llama_dir), "--suite", str(suite), "--max-new-tokens", "4"]
    assert main([*argv, "--question-ids", "odd", "--methods", "ar", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "results.json").read_text())
    asked = {p["question"] for p in payload["prompts"]}
    assert asked == {1, 3} and payload["settings"]["prompts"] == 3  # question 1 has two turns


@pytest.mark.parametrize(
    ("methods", "message"),
    [("hf-assisted", "needs a draft model (--draft-model)"), ("ar,nope", "unknown methods nope")],
)
def test_cli_method_errors_come_before_loading(capsys, suite, methods, message):
    code = main(["bench", "--model", "/no/such/model", "--suite", str(suite), "--methods", methods])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1


def test_engine_methods_pack_a_copy_and_ar_transformers_runs_the_model_as_loaded():
    from reader_spec.engine.weights import PackedLinear
    from tests.conftest import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer()
    loaded = LoadedModel(make_tiny_llama(), tokenizer, "tiny-llama", tokenizer_fingerprint(tokenizer))
    report = run_bench(
        loaded, QUESTIONS[:2], ["ar", "ar-transformers", "reader", "hf"], max_new_tokens=MAX_NEW
    )
    assert report.environment["runner"] == {"ar": "fast", "ar-transformers": "transformers", "reader": "fast"}
    assert not any(isinstance(m, PackedLinear) for m in loaded.model.modules())  # hf's model untouched
    assert all(p.identical for p in report.prompts)


def test_results_name_the_processor_by_family_and_model():
    environment = {"cpu": "AMD EPYC", "cpu_id": "family 23 model 1", "cpu_capability": "AVX2", "threads": 2}
    assert "AMD EPYC (family 23 model 1, AVX2), 2 threads" in markdown(environment, {}, [], [])
    environment |= {"cpu_id": "", "cpu_capability": None}  # results written before either was recorded
    assert "AMD EPYC, 2 threads" in markdown(environment, {}, [], [])


def test_results_say_how_tokens_were_chosen():
    def header(**changed):
        sampling = {name: getattr(GenerationConfig(), name) for name in SAMPLING_FIELDS} | changed
        return markdown({}, {"sampling": json.loads(json.dumps(sampling))}, [], [])

    assert "categories; greedy, " in header() and "categories; greedy, " in markdown({}, {}, [], [])
    assert "; greedy, repetition_penalty 1.2, " in header(repetition_penalty=1.2)
    assert "; sampling at temperature 0.7, seed 3, top_p 0.9, " in header(temperature=0.7, seed=3, top_p=0.9)
