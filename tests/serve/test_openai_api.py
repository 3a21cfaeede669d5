"""The live server through the real ``openai`` client: completions and chat completions, whole or streamed,
give exactly what the engine gives offline (``reader generate``'s path) for the same prompt and settings."""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import openai
import pytest
import torch

from reader_spec.config import GenerationConfig
from tests.serve.conftest import MODEL, make_engine

CHAT = [{"role": "system", "content": "w3 w4"}, {"role": "user", "content": "w5 w6 w7"}]
TEXT = "w10 w11 w12 w13"


@pytest.fixture(scope="module")
def reference(tiny):
    """The engine ``reader generate`` runs, its own instance, driven offline with ``Engine.generate``."""
    return make_engine(tiny)


@pytest.fixture(scope="module")
def client(server):
    with server.client() as client:
        yield client


def generation_config(max_tokens, temperature=0.0, seed=None, stop=(), top_p=1.0, top_k=0):
    """The engine settings the server builds from these OpenAI parameters."""
    return GenerationConfig(
        max_new_tokens=max_tokens,
        temperature=temperature,
        seed=seed,
        stop_strings=tuple(stop),
        top_p=top_p,
        top_k=top_k,
    )


def openai_reason(engine_reason: str) -> str:
    return "length" if engine_reason == "length" else "stop"


def chat_template_length(tokenizer, messages) -> int:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return len(ids["input_ids"] if isinstance(ids, Mapping) else ids)


def create(client, kind, prompt, **params):
    """One request of either kind; streamed ones are returned as their list of chunks."""
    if kind == "chat":
        return client.chat.completions.create(model=MODEL, messages=prompt, **params)
    return client.completions.create(model=MODEL, prompt=prompt, **params)


def text_of(response, kind) -> str:
    choice = response.choices[0]
    return choice.message.content if kind == "chat" else choice.text


def streamed_text(chunks, kind) -> str:
    if kind == "chat":
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def finish_reasons(chunks) -> list[str]:
    return [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]


PROMPTS = {"chat": CHAT, "completion": TEXT}


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_completion_equals_engine_output_and_counts_usage(client, reference, tiny):
    response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    expected = reference.generate([CHAT], generation_config(20))[0]

    assert response.object == "chat.completion"
    assert response.model == MODEL
    (choice,) = response.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == openai_reason(expected.finish_reason)
    prompt_tokens = chat_template_length(tiny.tokenizer, CHAT)
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == len(expected.tokens)
    assert response.usage.total_tokens == prompt_tokens + len(expected.tokens)


def test_completion_equals_engine_output_and_counts_usage(client, reference, tiny):
    response = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=12, temperature=0)
    expected = reference.generate([TEXT], generation_config(12))[0]

    assert response.object == "text_completion"
    (choice,) = response.choices
    assert choice.text == expected.text
    assert choice.finish_reason == openai_reason(expected.finish_reason)
    assert response.usage.prompt_tokens == len(tiny.tokenizer(TEXT)["input_ids"])
    assert response.usage.completion_tokens == len(expected.tokens) == 12
    assert response.usage.total_tokens == response.usage.prompt_tokens + 12


def test_chat_content_may_be_a_list_of_text_parts(client, reference):
    parts = [{"type": "text", "text": "w5 "}, {"type": "text", "text": "w6 w7"}]
    messages = [CHAT[0], {"role": "user", "content": parts}]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert response.choices[0].message.content == reference.generate([CHAT], generation_config(8))[0].text


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"type": "image_url", "image_url": {"url": "https://x/y.png"}}, "only text content parts"),
        ("w5", "only text content parts"),
        ({"type": "text"}, "needs a 'text' string"),
    ],
)
def test_chat_content_parts_other_than_text_are_refused(client, part, message):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": [part]}], max_tokens=2
        )
    assert refused.value.body["param"] == "messages"
    assert message in refused.value.body["message"]


def test_a_conversation_the_chat_template_refuses_is_a_400(server, client, monkeypatch):
    alternating = (
        "{% for m in messages %}{% if loop.index0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}<{{ m['role'] }}> {{ m['content'] }} "
        "{% endfor %}<assistant>"
    )
    monkeypatch.setattr(server.engine.tokenizer, "chat_template", alternating)
    twice = [{"role": "user", "content": "w5"}, {"role": "user", "content": "w6"}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=twice, max_tokens=2)
    assert refused.value.body["type"] == "invalid_request_error"
    assert refused.value.body["param"] == "messages"
    assert "roles must alternate" in refused.value.body["message"]


def test_a_chats_next_turn_prefills_only_its_new_message_and_says_so(client, reference, tiny):
    first = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    history = [*CHAT, {"role": "assistant", "content": first.choices[0].message.content}]
    later = [*history, {"role": "user", "content": "w8 w9"}]
    second = client.chat.completions.create(model=MODEL, messages=later, max_tokens=10, temperature=0)
    expected = reference.generate([later], generation_config(10))[0]
    assert second.choices[0].message.content == expected.text
    # At least the first turn's prompt was in its row (the answer too, where it reads back as generated).
    assert second.usage.prompt_tokens_details.cached_tokens >= chat_template_length(tiny.tokenizer, CHAT)
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_seeded_sample_repeats_and_equals_engine_output(client, reference, kind):
    prompt = PROMPTS[kind]
    params = {"max_tokens": 24, "temperature": 0.8, "seed": 7}
    first = create(client, kind, prompt, **params)
    second = create(client, kind, prompt, **params)
    expected = reference.generate([prompt], generation_config(24, temperature=0.8, seed=7))[0]

    assert text_of(first, kind) == text_of(second, kind) == expected.text
    assert first.usage.completion_tokens == second.usage.completion_tokens == len(expected.tokens)
    other_seed = create(client, kind, prompt, **{**params, "seed": 8})
    assert text_of(other_seed, kind) != expected.text  # the seed is what makes the sample repeat


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_presence_and_frequency_penalties_reach_the_engine(client, reference, kind):
    prompt = PROMPTS[kind]
    penalties = {"presence_penalty": 1.5, "frequency_penalty": 2.0}
    penalized = create(client, kind, prompt, max_tokens=24, temperature=0, **penalties)
    expected = reference.generate([prompt], replace(generation_config(24), **penalties))[0]
    plain = reference.generate([prompt], generation_config(24))[0]

    assert text_of(penalized, kind) == expected.text
    assert expected.tokens != plain.tokens


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_logit_bias_reaches_the_engine(client, reference, tiny, kind):
    prompt = PROMPTS[kind]
    plain = reference.generate([prompt], generation_config(12))[0]
    bias = {plain.tokens[0]: -100, plain.tokens[1]: 5}  # ban the first token, favour the second
    biased = create(
        client, kind, prompt, max_tokens=12, temperature=0, logit_bias={str(t): b for t, b in bias.items()}
    )
    expected = reference.generate([prompt], replace(generation_config(12), logit_bias=bias))[0]

    assert text_of(biased, kind) == expected.text != plain.text
    assert plain.tokens[0] not in expected.tokens


def test_echo_with_logprobs_scores_several_prompts_as_lm_eval_asks(client, reference, tiny):
    """lm-eval's loglikelihood request: token-id prompts in one request, ``echo``, ``logprobs``,
    ``max_tokens=1``; each prompt token's log-probability is the model's, the first one's None."""
    prompts = [reference.encode("w30 w31 w32 w33"), reference.encode("w20 w21 w22 w20 w21")]
    whole = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=1, temperature=0, logprobs=2, echo=True
    )
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompts, max_tokens=1, temperature=0, logprobs=2, echo=True, stream=True
        )
    )
    assert [c.index for c in whole.choices] == [0, 1]
    assert whole.usage.prompt_tokens == sum(len(p) for p in prompts)
    for choice, prompt in zip(whole.choices, prompts, strict=True):
        (expected,) = reference.generate([prompt], replace(generation_config(1), logprobs=2))
        logprobs = choice.logprobs
        assert choice.text == tiny.tokenizer.decode(prompt, skip_special_tokens=True) + expected.text
        assert len(logprobs.tokens) == len(prompt) + 1
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        scores = torch.log_softmax(tiny.model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
        in_prompt = scores.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
        assert logprobs.token_logprobs[1:-1] == [approx(v) for v in in_prompt]
        assert logprobs.token_logprobs[-1] == approx(expected.logprobs[0].logprob)
        assert all(len(top) == 2 for top in logprobs.top_logprobs[1:])
        streamed = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in streamed) == choice.text
        assert [t for c in streamed if c.logprobs for t in c.logprobs.tokens] == logprobs.tokens


@pytest.mark.parametrize("kind", ["whole", "streamed"])
def test_several_prompts_with_n_choices_each(client, reference, kind):
    prompts = [TEXT, "w30 w31 w32"]
    params = {"max_tokens": 8, "temperature": 0.9, "seed": 3, "n": 2, "echo": kind == "whole"}
    texts = ["", "", "", ""]
    if kind == "whole":
        reply = client.completions.create(model=MODEL, prompt=prompts, **params)
        for choice in reply.choices:
            texts[choice.index] = choice.text
    else:
        for chunk in client.completions.create(model=MODEL, prompt=prompts, stream=True, **params):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
    for index, text in enumerate(texts):
        prompt = prompts[index // 2]
        config = generation_config(8, temperature=0.9, seed=3 + index % 2)
        expected = reference.generate([prompt], config)[0].text
        assert text == (prompt + expected if kind == "whole" else expected)


def choice_texts(response, kind) -> list[str]:
    return [c.message.content if kind == "chat" else c.text for c in response.choices]


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_n_choices_draw_with_consecutive_seeds_and_count_the_prompt_once(client, reference, kind):
    prompt = PROMPTS[kind]
    reply = create(client, kind, prompt, max_tokens=16, temperature=0.9, seed=7, n=3)
    single = create(client, kind, prompt, max_tokens=16, temperature=0.9, seed=7)
    expected = [
        reference.generate([prompt], generation_config(16, temperature=0.9, seed=7 + i))[0] for i in range(3)
    ]

    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert choice_texts(reply, kind) == [e.text for e in expected]
    assert len({e.text for e in expected}) > 1
    assert text_of(single, kind) == expected[0].text
    assert reply.usage.completion_tokens == sum(len(e.tokens) for e in expected)
    assert reply.usage.prompt_tokens == single.usage.prompt_tokens


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_streamed_choices_equal_the_whole_reply(client, kind):
    params = {"max_tokens": 20, "temperature": 1.0, "seed": 11, "n": 4}
    whole = create(client, kind, PROMPTS[kind], **params)
    chunks = list(
        create(client, kind, PROMPTS[kind], stream=True, stream_options={"include_usage": True}, **params)
    )
    texts, reasons = [""] * 4, [None] * 4
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += (choice.delta.content or "") if kind == "chat" else choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]

    assert texts == choice_texts(whole, kind)
    assert reasons == [c.finish_reason for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def approx(value: float):
    return pytest.approx(value, abs=1e-5)


def logprob_entries(response_choices, kind) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """Each token's text, log-probability and likeliest tokens, from chat's or completions' shape."""
    entries = []
    for choice in response_choices:
        logprobs = choice.logprobs
        if kind == "chat":
            for item in logprobs.content:
                assert item.bytes == list(item.token.encode())
                entries.append((item.token, item.logprob, [(t.token, t.logprob) for t in item.top_logprobs]))
        else:
            offsets = logprobs.text_offset
            assert [b - a for a, b in itertools.pairwise(offsets)] == [len(t) for t in logprobs.tokens[:-1]]
            for token, logprob, top in zip(
                logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
            ):
                entries.append((token, logprob, list(top.items())))
    return entries


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_logprobs_are_the_engines_whole_or_streamed(client, reference, tiny, kind):
    prompt = PROMPTS[kind]
    asked = {"logprobs": True, "top_logprobs": 3} if kind == "chat" else {"logprobs": 3}
    params = {"max_tokens": 16, "temperature": 0.8, "seed": 6, **asked}
    whole = create(client, kind, prompt, **params)
    chunks = list(create(client, kind, prompt, stream=True, **params))
    expected = reference.generate(
        [prompt], replace(generation_config(16, temperature=0.8, seed=6), logprobs=3)
    )[0]

    # Texts exactly; values to float rounding (a pass's width may take other kernels: ``Engine``).
    entries = logprob_entries(whole.choices, kind)
    piece = lambda token: " " + tiny.tokenizer.decode([token])  # noqa: E731 (each word adds " w<i>")
    assert entries == [
        (piece(lp.token), approx(lp.logprob), [(piece(t), approx(p)) for t, p in lp.top])
        for lp in expected.logprobs
    ]
    assert len(entries) == 16 and "".join(e[0] for e in entries).strip() == text_of(whole, kind)
    streamed = logprob_entries([c.choices[0] for c in chunks if c.choices and c.choices[0].logprobs], kind)
    assert streamed == [(t, approx(p), [(a, approx(q)) for a, q in top]) for t, p, top in entries]
    plain = create(client, kind, prompt, max_tokens=4)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_stop_string_cuts_the_text_before_it(client, reference, kind):
    prompt = PROMPTS[kind]
    full = text_of(create(client, kind, prompt, max_tokens=20, temperature=0), kind)
    words = full.split()
    assert len(words) > 8, full
    stop = f"{words[5]} {words[6]}"  # spans two tokens: the stream must hold its start back
    cut = full[: full.index(stop)]
    expected = reference.generate([prompt], generation_config(20, stop=[stop]))[0]

    whole = create(client, kind, prompt, max_tokens=20, temperature=0, stop=[stop, "never seen"])
    chunks = list(create(client, kind, prompt, max_tokens=20, temperature=0, stop=stop, stream=True))

    assert text_of(whole, kind) == streamed_text(chunks, kind) == cut == expected.text
    assert stop not in cut
    assert whole.choices[0].finish_reason == "stop"
    assert finish_reasons(chunks) == ["stop"]
    assert whole.usage.completion_tokens == len(expected.tokens)


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "top_p": 0.9, "seed": 3}])
def test_streamed_text_equals_whole_text(client, kind, sampling):
    prompt = PROMPTS[kind]
    whole = create(client, kind, prompt, max_tokens=30, **sampling)
    chunks = list(create(client, kind, prompt, max_tokens=30, stream=True, **sampling))

    assert streamed_text(chunks, kind) == text_of(whole, kind)
    assert finish_reasons(chunks) == [whole.choices[0].finish_reason]
    assert chunks[-1].choices[0].finish_reason is not None  # the finish reason comes last
    assert len({c.id for c in chunks}) == 1
    assert all(c.usage is None for c in chunks)  # no usage unless asked for
    if kind == "chat":
        assert chunks[0].object == "chat.completion.chunk"
        assert chunks[0].choices[0].delta.role == "assistant"


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_stream_include_usage_ends_with_a_usage_chunk(client, kind):
    prompt = PROMPTS[kind]
    whole = create(client, kind, prompt, max_tokens=10, temperature=0)
    chunks = list(
        create(
            client,
            kind,
            prompt,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )

    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # not the cached ones: what the
    # earlier requests left in the cache differs
    assert [getattr(last.usage, c) for c in counts] == [getattr(whole.usage, c) for c in counts]
    assert all(c.usage is None for c in chunks[:-1])
    assert streamed_text(chunks, kind) == text_of(whole, kind)


def concurrent_cases(count: int) -> list[dict]:
    """Chat and text prompts, greedy and seeded (some with top-p or top-k), whole and streamed."""
    cases = []
    for i in range(count):
        rng = random.Random(i)
        words = " ".join(f"w{rng.randrange(2, 93)}" for _ in range(rng.randint(2, 12)))
        kind = "chat" if i % 2 == 0 else "completion"
        prompt = [{"role": "user", "content": words}] if kind == "chat" else words
        sampling = [
            {"temperature": 0.0},
            {"temperature": 0.8, "seed": i},
            {"temperature": 0.0},
            {"temperature": 1.0, "top_p": 0.9, "seed": 100 + i},
        ][i % 4]
        extra = {"top_k": 20} if i % 8 == 5 else {}
        cases.append(
            {
                "kind": kind,
                "prompt": prompt,
                "max_tokens": 8 + (i * 5) % 17,
                "sampling": sampling,
                "extra": extra,
                "stream": i % 3 == 0,
            }
        )
    return cases


@pytest.fixture(scope="module")
def concurrent(reference):
    """Sixteen requests and the outputs ``Engine.generate`` gives for them (batched its own way)."""
    cases = concurrent_cases(16)
    configs = [generation_config(case["max_tokens"], **case["sampling"], **case["extra"]) for case in cases]
    return cases, reference.generate([case["prompt"] for case in cases], configs, batch_size=4)


def request_of(case) -> dict:
    params = {"max_tokens": case["max_tokens"], **case["sampling"]}
    if case["extra"]:
        params["extra_body"] = case["extra"]
    if case["stream"]:
        params.update(stream=True, stream_options={"include_usage": True})
    method = "chat" if case["kind"] == "chat" else "completion"
    return {"messages" if method == "chat" else "prompt": case["prompt"], "model": MODEL, **params}


def summary(case, reply) -> tuple[str, str, int]:
    """Text, finish reason and completion tokens of a response or of a stream's chunks."""
    if case["stream"]:
        return (
            streamed_text(reply, case["kind"]),
            finish_reasons(reply)[-1],
            reply[-1].usage.completion_tokens,
        )
    return text_of(reply, case["kind"]), reply.choices[0].finish_reason, reply.usage.completion_tokens


def check_concurrent(cases, expected, results) -> None:
    for case, output, (text, reason, completion_tokens) in zip(cases, expected, results, strict=True):
        assert text == output.text, case
        assert reason == openai_reason(output.finish_reason), case
        assert completion_tokens == len(output.tokens), case


def test_sixteen_concurrent_threads_get_exactly_the_engine_outputs(server, concurrent):
    cases, expected = concurrent
    start = threading.Barrier(len(cases))

    def run(case):
        with server.client() as client:
            endpoint = client.chat.completions if case["kind"] == "chat" else client.completions
            start.wait(timeout=30)
            reply = endpoint.create(**request_of(case))
            return summary(case, list(reply) if case["stream"] else reply)

    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(run, cases))
    check_concurrent(cases, expected, results)
    assert server.wait_until_idle()


def test_sixteen_concurrent_async_clients_get_exactly_the_engine_outputs(server, concurrent):
    cases, expected = concurrent

    async def run(case):
        async with server.async_client() as client:
            endpoint = client.chat.completions if case["kind"] == "chat" else client.completions
            reply = await endpoint.create(**request_of(case))
            return summary(case, [chunk async for chunk in reply] if case["stream"] else reply)

    async def run_all():
        return await asyncio.gather(*(run(case) for case in cases))

    check_concurrent(cases, expected, asyncio.run(run_all()))
    assert server.wait_until_idle()
