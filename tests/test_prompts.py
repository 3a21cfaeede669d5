import gzip
import json

import pytest

from reader_spec.prompts import PromptError, encode_prompt, read_jsonl

from .conftest import make_tiny_tokenizer

ALTERNATING_TEMPLATE = (
    "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}<{{ m['role'] }}> {{ m['content'] }} "
    "{% endfor %}<assistant>"
)
"""A chat template that, as many real ones do, refuses two messages of one role in a row."""


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


def test_text_messages_and_ids(tokenizer):
    assert encode_prompt(tokenizer, "w5 w6") == [5, 6]
    assert encode_prompt(tokenizer, [5, 6]) == [5, 6]
    chat = encode_prompt(tokenizer, [{"role": "user", "content": "w5"}])
    assert chat == [
        tokenizer.convert_tokens_to_ids("<user>"),
        5,
        tokenizer.convert_tokens_to_ids("<assistant>"),
    ]


@pytest.mark.parametrize(
    "prompt", ["", [], [5, "w6"], [{"role": "user"}], [10_000], [-1], {"role": "user", "content": "x"}]
)
def test_bad_prompts(tokenizer, prompt):
    with pytest.raises(PromptError):
        encode_prompt(tokenizer, prompt)


def test_chat_needs_a_template(tokenizer):
    plain = make_tiny_tokenizer()
    plain.chat_template = None
    with pytest.raises(PromptError, match="chat template"):
        encode_prompt(plain, [{"role": "user", "content": "w5"}])


def test_a_template_that_refuses_the_messages_is_a_prompt_error():
    strict = make_tiny_tokenizer()
    strict.chat_template = ALTERNATING_TEMPLATE
    messages = [{"role": "user", "content": "w5"}, {"role": "user", "content": "w6"}]
    with pytest.raises(PromptError, match="chat template refused the messages: roles must alternate"):
        encode_prompt(strict, messages)
    assert encode_prompt(strict, messages[:1]) == encode_prompt(make_tiny_tokenizer(), messages[:1])


@pytest.mark.parametrize("name", ["p.jsonl", "p.jsonl.gz"])
def test_read_jsonl(tmp_path, name):
    path = tmp_path / name
    text = json.dumps({"id": "x", "prompt": "hi"}) + "\n\n"
    text += json.dumps({"messages": [{"role": "user", "content": "a"}]})
    with (gzip.open if name.endswith(".gz") else open)(path, "wt") as f:
        f.write(text)
    records = list(read_jsonl(path))
    assert [r.id for r in records] == ["x", 3]
    assert records[1].prompt == [{"role": "user", "content": "a"}]


@pytest.mark.parametrize("line", ["{oops", "[1, 2]", '{"id": 1}', '{"messages": [1]}', '{"prompt": 5}'])
def test_read_jsonl_rejects_bad_lines(tmp_path, line):
    path = tmp_path / "p.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(PromptError, match=r"p\.jsonl:1"):
        list(read_jsonl(path))
