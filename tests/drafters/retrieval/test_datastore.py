"""The datastore: lookups against a brute-force reference, document boundaries, on-disk safety, CLI."""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from reader_spec.bench.spec_bench import default_suite
from reader_spec.cli import main
from reader_spec.config import GenerationConfig
from reader_spec.drafters.retrieval import datastore as ds_module
from reader_spec.drafters.retrieval import native
from reader_spec.drafters.retrieval.corpus import (
    file_documents,
    read_documents,
    read_prompts,
    tokenize_documents,
)
from reader_spec.drafters.retrieval.datastore import (
    META_FILE,
    SEPARATOR,
    SUFFIX_ARRAY_FILE,
    TOKENS_FILE,
    Datastore,
    DatastoreError,
)
from reader_spec.drafters.retrieval.tries import build_continuation_trie
from reader_spec.engine.loop import Engine
from reader_spec.loading import load_tokenizer
from reader_spec.prompts import PromptError, encode_prompt
from tests.conftest import make_tiny_tokenizer

BIG = [3, 70_001, 70_002, 123_456, 4_000_000_000, SEPARATOR - 1]
"""A small alphabet (so matches are long and frequent) of ids far beyond 16 bits."""


def build(path: Path, documents, fingerprint: str = "fp") -> Datastore:
    return Datastore.build(path, documents, fingerprint=fingerprint, model="test-model")


def reference(documents, context, max_suffix, max_depth):
    """Longest matching suffix by brute force: (length, occurrences, Counter of continuations)."""
    query = list(context)[-max_suffix:]
    length, ends = 0, []
    for m in range(1, len(query) + 1):
        pattern = query[len(query) - m :]
        found = [
            (d, i + m - 1)
            for d, doc in enumerate(documents)
            for i in range(len(doc) - m + 1)
            if doc[i : i + m] == pattern
        ]
        if not found:
            break
        length, ends = m, found
    follow = Counter(
        tuple(documents[d][e + 1 : e + 1 + max_depth]) for d, e in ends if e + 1 < len(documents[d])
    )
    return length, len(ends), follow


@pytest.fixture(scope="module")
def random_corpus(tmp_path_factory):
    rng = random.Random(7)
    documents = [[rng.choice(BIG) for _ in range(rng.randint(1, 60))] for _ in range(120)]
    documents += [documents[0][:20]] * 3 + [[]]  # repeats, and an empty document that is skipped
    store = build(tmp_path_factory.mktemp("random") / "store", documents)
    return store, [d for d in documents if d]


def random_contexts(documents, rng: random.Random, n: int):
    """Mostly pieces of the corpus with a random token in front (so the match ends), some pure noise."""
    for _ in range(n):
        doc = rng.choice(documents)
        start = rng.randrange(len(doc))
        piece = doc[start : start + rng.randint(1, 12)]
        noise = [rng.choice(BIG) for _ in range(rng.randint(0, 6))]
        yield noise + piece if rng.random() < 0.8 else noise


@pytest.mark.parametrize(
    "scan_below", [None, 0, 40, 10**9], ids=["compiled", "bisect-only", "mixed", "scan-only"]
)
def test_lookup_equals_brute_force(random_corpus, monkeypatch, scan_below):
    store, documents = random_corpus
    if scan_below is None:
        assert native.core() is not None, "the compiled retrieval core must build here (make builds it)"
        scan_below = 0
    else:
        monkeypatch.setattr(native, "core", lambda: None)
        monkeypatch.setattr(ds_module, "_SCAN_BELOW", scan_below)
    assert len(store.tokens) > 1000  # the bisect path has a large range to narrow
    rng = random.Random(scan_below)
    for context in random_contexts(documents, rng, 300):
        max_suffix, max_depth = rng.randint(1, 16), rng.randint(1, 8)
        length, occurrences, follow = reference(documents, context, max_suffix, max_depth)
        got = store.lookup(context, max_suffix=max_suffix, max_occurrences=10**6, max_depth=max_depth)
        assert (got.match_length, got.occurrences) == (length, occurrences), context
        assert got.sampled == occurrences
        assert dict(got.continuations) == dict(follow)
        counts = [c for _, c in got.continuations]
        assert counts == sorted(counts, reverse=True)


def test_compiled_and_pure_lookups_are_identical(random_corpus, monkeypatch):
    """Sampled continuations in the same order, and 64-bit suffix arrays (streams past 2**31 tokens)
    read like 32-bit ones."""
    store, documents = random_corpus
    assert native.core() is not None, "the compiled retrieval core must build here (make builds it)"
    wide = Datastore(store.path, store.meta, store.tokens, store.suffix_array.astype("<i8"))
    rng = random.Random(2)
    cases = [
        (c, rng.randint(1, 12), rng.choice([1, 3, 10, 64]), rng.randint(1, 8))
        for c in random_contexts(documents, rng, 300)
    ]
    compiled = [s.lookup(c, m, o, d) for c, m, o, d in cases for s in (store, wide)]
    monkeypatch.setattr(native, "core", lambda: None)
    pure = [s.lookup(c, m, o, d) for c, m, o, d in cases for s in (store, wide)]
    assert compiled == pure
    assert sum(found.sampled < found.occurrences for found in pure) > 50


def test_sampled_occurrences_are_real_and_counted(random_corpus):
    store, documents = random_corpus
    context = [BIG[0]]
    length, occurrences, follow = reference(documents, context, 4, 3)
    got = store.lookup(context, max_suffix=4, max_occurrences=10, max_depth=3)
    assert got.match_length == length == 1 and got.occurrences == occurrences > 10
    assert got.sampled == 10 and sum(c for _, c in got.continuations) <= 10
    for continuation, count in got.continuations:
        assert count <= follow[continuation]


def test_longest_suffix_and_counts(tmp_path):
    store = build(tmp_path / "s", [[1, 2, 3, 9], [7, 2, 3, 8, 4], [5, 5, 2, 3, 8, 6], [2, 3, 8, 6]])
    only = store.lookup([7, 2, 3])
    assert (only.match_length, only.occurrences, only.continuations) == (3, 1, (((8, 4), 1),))
    assert store.lookup([7, 2, 3], max_suffix=2).match_length == 2
    shorter = store.lookup([0, 2, 3], max_depth=2)
    assert (shorter.match_length, shorter.occurrences) == (2, 4)
    assert shorter.continuations == (((8, 6), 2), ((9,), 1), ((8, 4), 1))
    trie = build_continuation_trie(shorter.continuations)
    assert trie.weights[0] == 4 and trie.weights[trie.children[0][8]] == 3
    assert store.lookup([42]) == ds_module.NO_LOOKUP and store.lookup([]) == ds_module.NO_LOOKUP


def test_documents_never_join(tmp_path):
    store = build(tmp_path / "s", [[1, 2, 3], [4, 5, 6], [3, 4, 7]])
    across = store.lookup([2, 3, 4])  # occurs only across the first boundary
    assert across.match_length == 2 and across.continuations == (((7,), 1),)
    assert store.lookup([1, 2]).continuations == (((3,), 1),)  # not (3, 4, 5, 6)
    at_end = store.lookup([5, 6])
    assert (at_end.match_length, at_end.occurrences, at_end.continuations) == (2, 1, ())
    # A separator or negative id in the context is a barrier, never a match of the separators.
    assert store.lookup([3, SEPARATOR, 4]).match_length == 1
    assert store.lookup([3, -1, 4]).match_length == 1


def test_tokens_are_32_bit_and_checked(tmp_path):
    store = build(tmp_path / "s", [[70_000, 70_001, 4_000_000_000]])
    assert store.tokens.dtype == np.dtype("<u4")
    assert store.lookup([70_000]).continuations == (((70_001, 4_000_000_000), 1),)
    for bad in ([SEPARATOR], [-1], [[1, 2]]):
        with pytest.raises(DatastoreError):
            build(tmp_path / "bad", [bad])
    with pytest.raises(DatastoreError, match="no tokens"):
        build(tmp_path / "empty", [[], []])


@pytest.fixture
def store_dir(tmp_path):
    path = tmp_path / "store"
    build(path, [[1, 2, 3, 4], [5, 6, 7]])
    return path


def test_reopen_and_meta(store_dir):
    store = Datastore.open(store_dir, fingerprint="fp", verify=True)
    meta = store.meta
    assert (meta.tokens, meta.documents, meta.model, meta.format_version) == (7, 2, "test-model", 1)
    assert meta.files[TOKENS_FILE].length == 10 and meta.built
    assert store.disk_bytes == sum(p.stat().st_size for p in store_dir.iterdir())
    assert store.lookup([2, 3]).continuations == (((4,), 1),)


def test_wrong_tokenizer(store_dir):
    with pytest.raises(DatastoreError, match="another tokenizer"):
        Datastore.open(store_dir, fingerprint="other")


@pytest.mark.parametrize("name", [TOKENS_FILE, SUFFIX_ARRAY_FILE])
def test_truncated_and_missing_files(store_dir, name):
    array = store_dir / name
    array.write_bytes(array.read_bytes()[:-4])
    with pytest.raises(DatastoreError, match=rf"{name} is truncated"):
        Datastore.open(store_dir)
    array.unlink()
    with pytest.raises(DatastoreError, match=f"{name} is missing"):
        Datastore.open(store_dir)


def test_checksum_only_with_verify(store_dir):
    sa = store_dir / SUFFIX_ARRAY_FILE
    data = bytearray(sa.read_bytes())
    data[0] ^= 1
    sa.write_bytes(bytes(data))
    Datastore.open(store_dir)  # sizes still agree
    with pytest.raises(DatastoreError, match="checksum"):
        Datastore.open(store_dir, verify=True)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda meta: {**meta, "format_version": meta["format_version"] + 1}, "format version 2"),
        (lambda meta: {**meta, "format": "something else"}, "not a reader-spec datastore"),
        (lambda meta: {k: v for k, v in meta.items() if k != "tokens"}, "damaged"),
        (lambda meta: [1, 2], "not a reader-spec datastore"),
        (lambda meta: {**meta, "files": {**meta["files"], TOKENS_FILE: {}}}, "damaged"),
        (lambda meta: _set_length(meta, TOKENS_FILE, 0), "damaged"),
    ],
)
def test_bad_meta(store_dir, edit, message):
    path = store_dir / META_FILE
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    with pytest.raises(DatastoreError, match=message):
        Datastore.open(store_dir)


def _set_length(meta: dict, name: str, length: int) -> dict:
    files = {**meta["files"], name: {**meta["files"][name], "length": length, "bytes": 0}}
    return {**meta, "files": files}


def test_missing_or_garbage_meta(store_dir, tmp_path):
    with pytest.raises(DatastoreError, match="no datastore"):
        Datastore.open(tmp_path / "nowhere")
    (store_dir / META_FILE).write_text("{not json")
    with pytest.raises(DatastoreError, match="damaged"):
        Datastore.open(store_dir)
    (store_dir / META_FILE).unlink()
    with pytest.raises(DatastoreError, match=r"no meta\.json"):
        Datastore.open(store_dir)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_interrupted_build_keeps_the_old_index(store_dir, monkeypatch, error):
    def fail(stream):
        raise error("interrupted")

    monkeypatch.setattr(ds_module, "_suffix_array", fail)
    with pytest.raises(error):
        build(store_dir, [[9, 9, 9]])
    assert sorted(p.name for p in store_dir.parent.iterdir()) == ["store"]  # no leftovers
    assert Datastore.open(store_dir, verify=True).meta.tokens == 7
    with pytest.raises(error):
        build(store_dir.parent / "fresh", [[9, 9, 9]])
    with pytest.raises(DatastoreError, match="no datastore"):
        Datastore.open(store_dir.parent / "fresh")


def test_rebuild_replaces_but_never_clobbers_other_data(store_dir, tmp_path):
    assert build(store_dir, [[8, 8]]).meta.tokens == 2
    assert Datastore.open(store_dir).lookup([8]).continuations == (((8,), 1),)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(DatastoreError, match="not a datastore"):
        build(precious, [[1]])
    assert (precious / "notes.txt").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert build(empty, [[1]]).meta.tokens == 1


def test_a_corrupt_suffix_array_is_refused_at_open(store_dir):
    sa = store_dir / SUFFIX_ARRAY_FILE
    sa.write_bytes(np.random.default_rng(0).bytes(sa.stat().st_size))
    with pytest.raises(DatastoreError, match=rf"{SUFFIX_ARRAY_FILE} is corrupt"):
        Datastore.open(store_dir)


def test_tokens_without_end_separators_are_refused_at_open(store_dir):
    tokens = store_dir / TOKENS_FILE
    stream = np.fromfile(tokens, dtype="<u4")
    stream[-1] = 5
    stream.tofile(tokens)
    with pytest.raises(DatastoreError, match=rf"{TOKENS_FILE} is corrupt"):
        Datastore.open(store_dir)


def _corrupt_arrays(store: Datastore) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens, suffix array) pairs that open's checks would refuse, each read outside the stream."""
    size = len(store.tokens)
    sa = store.suffix_array
    garbage = np.frombuffer(np.random.default_rng(1).bytes(4 * size), dtype="<i4")
    no_front_separator = np.array(store.tokens)
    no_front_separator[0] = BIG[0]
    return [
        (store.tokens, garbage),
        (store.tokens, np.full_like(sa, size)),
        (store.tokens, np.full_like(sa, -1)),
        (no_front_separator, np.zeros_like(sa)),  # back from position 0 would read before the stream
    ]


@pytest.mark.parametrize("scan_below", [0, 256, 10**9], ids=["bisect-only", "mixed", "scan-only"])
def test_lookups_on_a_corrupt_suffix_array_raise(random_corpus, retrieval_path, monkeypatch, scan_below):
    """A datastore damaged after opening (or opened by other means) raises instead of crashing."""
    store, _ = random_corpus
    monkeypatch.setattr(ds_module, "_SCAN_BELOW", scan_below)
    for tokens, sa in _corrupt_arrays(store):
        damaged = Datastore(store.path, store.meta, tokens, sa)
        with pytest.raises(DatastoreError, match=rf"{SUFFIX_ARRAY_FILE} is corrupt"):
            damaged.lookup_batch([[BIG[0], BIG[0]], [BIG[1]]])
    assert store.lookup([BIG[0]]).match_length == 1


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def _leftover(parent: Path, name: str, mtime: float | None = None) -> Path:
    path = parent / name
    path.mkdir()
    (path / TOKENS_FILE).write_bytes(b"half")
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def test_a_build_sweeps_what_killed_builds_left(store_dir):
    parent, dead = store_dir.parent, _dead_pid()
    stale = [
        _leftover(parent, f".store.building-{dead}-abc"),
        _leftover(parent, f".store.old-{dead}-def"),
        _leftover(parent, ".store.building-q1w2e3r4", mtime=time.time() - 3600),  # before pids were named
    ]
    kept = [
        _leftover(parent, f".store.building-{os.getpid()}-ghi"),  # a live build
        _leftover(parent, f".other.building-{dead}-jkl"),  # another output's
        _leftover(parent, ".store.building-z9x8c7v6", mtime=time.time() + 3600),  # started after this one
    ]
    build(store_dir, [[8, 8]])
    assert not any(p.exists() for p in stale)
    assert all(p.exists() for p in kept)


def test_a_kill_between_the_install_renames_loses_nothing(store_dir, monkeypatch):
    """The old index waits in an .old- sibling; the next build puts it back before anything else."""
    parent, dead = store_dir.parent, _dead_pid()
    os.replace(store_dir, parent / f".store.old-{dead}-abc")
    _leftover(parent, f".store.building-{dead}-def")
    with pytest.raises(DatastoreError, match="no datastore"):
        Datastore.open(store_dir)

    def fail(stream):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(ds_module, "_suffix_array", fail)
    with pytest.raises(RuntimeError):
        build(store_dir, [[9, 9, 9]])
    assert sorted(p.name for p in parent.iterdir()) == ["store"]
    assert Datastore.open(store_dir, verify=True).meta.tokens == 7


def test_install_syncs_the_directories_it_renames_in(store_dir, directory_fsyncs):
    synced = directory_fsyncs
    build(store_dir, [[8, 8]])
    assert store_dir.stat().st_ino in synced  # the staged directory's entries, before it moves in
    assert store_dir.parent.stat().st_ino in synced  # the rename itself


# --- corpus -----------------------------------------------------------------------------------------
def test_read_documents_formats(tmp_path):
    lines = [
        {"text": "w5 w6"},
        {"messages": [{"role": "user", "content": "w7"}, {"role": "assistant", "content": "w8"}]},
        {"prompt": "w9"},
        {"turns": ["w20", "w21"]},
    ]
    jsonl = tmp_path / "a.jsonl.gz"
    with gzip.open(jsonl, "wt") as f:
        f.write("\n".join(json.dumps(line) for line in lines) + "\n\n")
    text = tmp_path / "b.txt"
    text.write_text("w22\nw23")
    docs = list(read_documents(jsonl)) + list(read_documents(text))
    assert docs == ["w5 w6", lines[1]["messages"], "w9", "w20\n\nw21", "w22\nw23"]
    tokenizer = make_tiny_tokenizer()
    ids = list(tokenize_documents(tokenizer, docs, batch_size=2))
    user, assistant = (tokenizer.convert_tokens_to_ids(t) for t in ("<user>", "<assistant>"))
    assert ids == [[5, 6], [user, 7, assistant, 8, assistant], [9], [20, 21], [22, 23]]
    assert list(file_documents(tokenizer, [jsonl, text])) == ids


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not valid JSON"),
        ('{"other": 1}', "needs a 'text'"),
        ('{"messages": [{"role": "user"}]}', "role"),
    ],
)
def test_bad_corpus_lines(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "w1"}\n' + line + "\n")
    with pytest.raises(PromptError, match=f"bad.jsonl:2: .*{message}"):
        list(read_documents(path))


def test_a_cut_off_gzip_corpus_is_a_one_line_error_naming_the_line(tmp_path):
    data = gzip.compress(b"".join(b'{"text": "w%d w5"}\n' % i for i in range(5000)))
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(PromptError, match=r"cut\.jsonl\.gz:\d+: the gzip data is cut short"):
        list(read_documents(path))


def test_read_prompts_formats_and_parity(tmp_path):
    odd = read_prompts(default_suite(), "odd")
    assert odd and all(r.id % 2 == 1 for r in odd)
    assert len(odd) + len(read_prompts(default_suite(), "even")) == len(read_prompts(default_suite()))
    assert odd[0].prompt[0]["role"] == "user"
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": 1, "prompt": "w1"}\n{"prompt": "w2"}\n{"id": 4, "prompt": "w4"}\n')
    assert [r.id for r in read_prompts(path, "even")] == [2, 4]  # a missing id is the line number
    path.write_text('{"id": "a", "prompt": "w1"}\n')
    with pytest.raises(PromptError, match="not an integer"):
        read_prompts(path, "odd")


def test_read_prompts_reads_gzipped_questions_and_prompts(tmp_path):
    assert default_suite().name.endswith(".jsonl.gz")
    questions = tmp_path / "q.jsonl"
    with gzip.open(default_suite(), "rt") as suite:
        questions.write_text(suite.read())
    odd = read_prompts(default_suite(), "odd")
    assert odd == read_prompts(questions, "odd") and len(odd) == 240
    prompts = tmp_path / "p.jsonl.gz"
    with gzip.open(prompts, "wt") as f:
        f.write('{"id": 3, "prompt": "w3"}\n')
    assert [(r.id, r.prompt) for r in read_prompts(prompts, "odd")] == [(3, "w3")]


def test_load_tokenizer_fingerprint_matches_the_model(tiny, tiny_llama_dir):
    assert load_tokenizer(tiny_llama_dir).fingerprint == tiny.fingerprint


# --- command line -----------------------------------------------------------------------------------
@pytest.fixture
def isolated_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("READER_SPEC_CACHE", str(tmp_path / "cache"))


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_build_and_info(capsys, tiny, tiny_llama_dir, tmp_path, isolated_cache):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "w5 w6 w7"}\n{"messages": [{"role": "user", "content": "w5 w6 w8"}]}\n')
    notes = tmp_path / "notes.txt"
    notes.write_text("w5 w6 w9 w90")
    out_dir = tmp_path / "index"
    code, out, _ = run(
        capsys, "index", "build", "--model", tiny_llama_dir, "--input", corpus, notes, "--output", out_dir
    )
    assert code == 0 and "tokens: 12 in 3 documents" in out
    store = Datastore.open(out_dir, fingerprint=tiny.fingerprint)
    assistant = tiny.tokenizer.convert_tokens_to_ids("<assistant>")
    assert dict(store.lookup([5, 6]).continuations) == {(7,): 1, (8, assistant): 1, (9, 90): 1}
    assert [s["path"] for s in store.meta.sources] == [str(corpus.resolve()), str(notes.resolve())]
    code, out, _ = run(capsys, "index", "info", out_dir, "--verify")
    assert code == 0
    for expected in ("tokens: 12 in 3 documents", tiny.fingerprint, "checksums: verified", "notes.txt"):
        assert expected in out


@pytest.mark.parametrize("runner", ["auto", "transformers"])
def test_cli_build_from_model_answers(capsys, tiny, tiny_llama_dir, tmp_path, isolated_cache, runner):
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"id": i, "messages": [{"role": "user", "content": f"w{i + 4} w{i + 5}"}]} for i in (1, 2, 3)]
    prompts.write_text("\n".join(json.dumps(line) for line in lines))
    out_dir = tmp_path / "answers"
    code, out, _ = run(
        capsys, "index", "build", "--model", tiny_llama_dir, "--from-model", prompts,
        "--question-ids", "odd", "--max-new-tokens", "6", "--output", out_dir, "--runner", runner,
    )  # fmt: skip
    assert code == 0 and "in 2 documents" in out
    store = Datastore.open(out_dir, fingerprint=tiny.fingerprint)
    odd = [lines[0]["messages"], lines[2]["messages"]]
    greedy = Engine(tiny, runner=runner).generate(odd, GenerationConfig(max_new_tokens=6))  # plain greedy
    expected = [SEPARATOR]
    for prompt, output in zip(odd, greedy, strict=True):
        expected += encode_prompt(tiny.tokenizer, prompt) + output.tokens + [SEPARATOR]
    assert store.tokens.tolist() == expected
    assert store.meta.sources[0]["kind"] == "model answers" and store.meta.sources[0]["prompts"] == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["index", "info", "/no/such/index"], "no datastore"),
        (["index", "build", "--output", "/tmp/x"], "nothing to index"),
        (["index", "build", "--input", "/no/such/file.txt", "--output", "/tmp/x"], "no such input file"),
    ],
)
def test_cli_errors_are_one_line(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and message in err and err.count("\n") == 1 and not out


def test_generate_drafts_from_a_datastore_and_refuses_another_tokenizers(
    capsys, tiny, tiny_llama_dir, tmp_path, isolated_cache
):
    prompt = "w5 w6 w7 w8"
    answer = Engine(tiny).generate([prompt], GenerationConfig(max_new_tokens=12, eos_token_ids=()))[0]
    tokens = tiny.tokenizer(prompt)["input_ids"] + answer.tokens
    store = Datastore.build(tmp_path / "ok", [tokens], fingerprint=tiny.fingerprint, model=tiny.name)
    # A fixed budget: the adaptive one prices drafts by this machine's timings of the tiny model, and
    # a noisy minute can make it draft next to nothing (a CI run accepted one token in 11 steps).
    code, out, _ = run(
        capsys, "generate", "--model", tiny_llama_dir, "--prompt", prompt, "--max-new-tokens", 12,
        "--datastore", store.path, "--fixed-budget", "--json",
    )  # fmt: skip
    request = json.loads(out)["requests"][0]
    assert code == 0 and request["tokens"] == answer.tokens[: len(request["tokens"])]
    assert request["stats"]["accepted_by_source"].get("datastore", 0) > 0
    other = Datastore.build(tmp_path / "other", [tokens], fingerprint="another-tokenizer", model="x")
    code, out, err = run(
        capsys, "generate", "--model", tiny_llama_dir, "--prompt", "w5", "--datastore", other.path
    )
    assert code == 2 and "another tokenizer" in err and err.count("\n") == 1 and not out
