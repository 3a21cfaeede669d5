"""A bounded soak: 16 clients, 320 requests in two halves, a fifth of them malformed in varied ways, and
streams dropped mid-way. Good requests get exactly the engine's output, bad ones their 4xx with an OpenAI
error object, /health stays up, nothing is left in the engine, and memory does not grow."""

from __future__ import annotations

import gc
import json
import os
import random
import re
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest

from reader_spec.config import GenerationConfig
from tests.serve.conftest import MODEL, live_server, make_engine

API_KEY = "soak-key"
CLIENTS = 16
HALF = 160
"""Requests per half, a fifth of them malformed."""
DROPPED = 8
"""Streams per half that the client closes after their first chunk."""
MAX_RSS_GROWTH = 25 * 2**20

CHAT_PATH, COMPLETION_PATH = "/v1/chat/completions", "/v1/completions"
LONG_PROMPT = " ".join(["w5"] * 2100)  # the tiny model's context is 2,048 tokens


@dataclass(frozen=True)
class Good:
    path: str
    body: dict
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Bad:
    name: str
    path: str
    body: dict | bytes
    status: int
    param: str | None
    kind: str = "invalid_request_error"
    headers: dict = field(default_factory=lambda: {"Authorization": f"Bearer {API_KEY}"})
    code: str | None = None


def good_requests(reference) -> list[Good]:
    """Chat and text prompts, greedy and seeded, whole and streamed, with the engine's offline outputs."""
    specs = []
    for i in range(8):
        rng = random.Random(1000 + i)
        words = " ".join(f"w{rng.randrange(2, 93)}" for _ in range(rng.randint(2, 10)))
        chat = i % 2 == 0
        sampling = {"temperature": 0.0} if i % 4 < 2 else {"temperature": 0.9, "seed": i}
        body = {"model": MODEL, "max_tokens": 4 + i % 5, **sampling}
        if chat:
            body["messages"] = [{"role": "user", "content": words}]
        else:
            body["prompt"] = words
        if i % 3 == 0:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        if i == 5:
            body["stop"] = ["w50"]
        specs.append((CHAT_PATH if chat else COMPLETION_PATH, body, body.get("messages", words)))
    configs = [
        GenerationConfig(
            max_new_tokens=body["max_tokens"],
            temperature=body["temperature"],
            seed=body.get("seed"),
            stop_strings=tuple(body.get("stop", ())),
        )
        for _, body, _ in specs
    ]
    outputs = reference.generate([prompt for *_, prompt in specs], configs, batch_size=4)
    return [
        Good(
            path,
            body,
            output.text,
            "length" if output.finish_reason == "length" else "stop",
            len(reference.encode(prompt)),
            len(output.tokens),
        )
        for (path, body, prompt), output in zip(specs, outputs, strict=True)
    ]


def bad_requests() -> list[Bad]:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 4}
    text = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 4}
    return [
        Bad("invalid JSON", COMPLETION_PATH, b'{"model": "tiny-llama", "prompt": ', 400, None),
        Bad("not an object", CHAT_PATH, b"[1, 2]", 400, None),
        Bad("max_tokens a string", COMPLETION_PATH, {**text, "max_tokens": "ten"}, 400, "max_tokens"),
        Bad("max_tokens a float", CHAT_PATH, {**chat, "max_tokens": 4.5}, 400, "max_tokens"),
        Bad("temperature a string", CHAT_PATH, {**chat, "temperature": "hot"}, 400, "temperature"),
        Bad("messages a string", CHAT_PATH, {**chat, "messages": "w5 w6"}, 400, "messages"),
        Bad("prompt a number", COMPLETION_PATH, {**text, "prompt": 5}, 400, "prompt"),
        Bad("stream a string", COMPLETION_PATH, {**text, "stream": "yes"}, 400, "stream"),
        Bad("negative max_tokens", COMPLETION_PATH, {**text, "max_tokens": -5}, 400, "max_tokens"),
        Bad("huge max_tokens", CHAT_PATH, {**chat, "max_tokens": 10**9}, 400, "max_tokens"),
        Bad(
            "zero max_completion_tokens",
            CHAT_PATH,
            {**chat, "max_completion_tokens": 0},
            400,
            "max_completion_tokens",
        ),
        Bad(
            "unknown model",
            COMPLETION_PATH,
            {**text, "model": "gpt-4o"},
            404,
            "model",
            code="model_not_found",
        ),
        Bad("no model", CHAT_PATH, {k: v for k, v in chat.items() if k != "model"}, 400, "model"),
        Bad("empty messages", CHAT_PATH, {**chat, "messages": []}, 400, "messages"),
        Bad(
            "unknown role",
            CHAT_PATH,
            {**chat, "messages": [{"role": "bot", "content": "w5"}]},
            400,
            "messages",
        ),
        Bad("over-long prompt", COMPLETION_PATH, {**text, "prompt": LONG_PROMPT}, 400, "prompt"),
        Bad(
            "over-long chat",
            CHAT_PATH,
            {**chat, "messages": [{"role": "user", "content": LONG_PROMPT}]},
            400,
            "messages",
        ),
        Bad("token outside the vocabulary", COMPLETION_PATH, {**text, "prompt": [5, 96]}, 400, "prompt"),
        Bad("n=0", CHAT_PATH, {**chat, "n": 0}, 400, "n"),
        Bad("n a string", COMPLETION_PATH, {**text, "n": "two"}, 400, "n"),
        Bad("best_of=2", COMPLETION_PATH, {**text, "best_of": 2}, 400, "best_of"),
        Bad("logprobs 21", COMPLETION_PATH, {**text, "logprobs": 21}, 400, "logprobs"),
        Bad(
            "top_logprobs -1", CHAT_PATH, {**chat, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"
        ),
        Bad("top_logprobs without logprobs", CHAT_PATH, {**chat, "top_logprobs": 2}, 400, None),
        Bad("logit_bias 101", CHAT_PATH, {**chat, "logit_bias": {"5": 101}}, 400, "logit_bias"),
        Bad("logit_bias not an id", CHAT_PATH, {**chat, "logit_bias": {"w5": 1}}, 400, "logit_bias"),
        Bad(
            "logit_bias past the vocabulary",
            COMPLETION_PATH,
            {**text, "logit_bias": {"96": -100}},
            400,
            "logit_bias",
        ),
        Bad("an empty prompt among several", COMPLETION_PATH, {**text, "prompt": ["w5", ""]}, 400, "prompt"),
        Bad("prompts times n past 128", COMPLETION_PATH, {**text, "prompt": [[5]] * 3, "n": 50}, 400, None),
        Bad("five stop strings", CHAT_PATH, {**chat, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        Bad("negative seed", COMPLETION_PATH, {**text, "seed": -1}, 400, "seed"),
        Bad("top_p zero", CHAT_PATH, {**chat, "top_p": 0}, 400, "top_p"),
        Bad("presence_penalty 2.5", CHAT_PATH, {**chat, "presence_penalty": 2.5}, 400, "presence_penalty"),
        Bad(
            "frequency_penalty a string",
            COMPLETION_PATH,
            {**text, "frequency_penalty": "x"},
            400,
            "frequency_penalty",
        ),
        Bad("no API key", CHAT_PATH, chat, 401, None, "authentication_error", {}),
        Bad(
            "wrong API key",
            COMPLETION_PATH,
            text,
            401,
            None,
            "authentication_error",
            {"Authorization": "Bearer not-the-key"},
        ),
    ]


@dataclass(frozen=True)
class Drop:
    """A long stream the client closes after its first chunk."""

    path: str
    body: dict


def dropped_streams(count: int) -> list[Drop]:
    drops = []
    for i in range(count):
        if i % 2:
            body = {"model": MODEL, "prompt": f"w{20 + i} w{30 + i}", "max_tokens": 1500, "stream": True}
            drops.append(Drop(COMPLETION_PATH, {**body, "temperature": 0}))
        else:
            messages = [{"role": "user", "content": f"w{40 + i} w7"}]
            body = {
                "model": MODEL,
                "messages": messages,
                "max_tokens": 1500,
                "stream": True,
                "temperature": 0,
            }
            drops.append(Drop(CHAT_PATH, body))
    return drops


def read_events(response: httpx.Response) -> tuple[list[dict], bool]:
    """A server-sent event stream's JSON events, and whether it ended with ``[DONE]``."""
    events, done = [], False
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            done = True
            break
        events.append(json.loads(data))
    return events, done


def check_good(client: httpx.Client, job: Good) -> str | None:
    chat = job.path == CHAT_PATH
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if job.body.get("stream"):
        with client.stream("POST", job.path, json=job.body, headers=headers) as response:
            if response.status_code != 200:
                return f"{job.body}: status {response.status_code} {response.read()!r}"
            events, done = read_events(response)
        choices = [e["choices"][0] for e in events if e["choices"]]
        text = "".join((c["delta"].get("content") or "") if chat else c["text"] for c in choices)
        reasons = [c["finish_reason"] for c in choices if c["finish_reason"]]
        usage = events[-1].get("usage") if events else None
        reason = reasons[-1] if len(reasons) == 1 else f"reasons {reasons}"
        if not done:
            return f"{job.body}: the stream did not end with [DONE]"
    else:
        response = client.post(job.path, json=job.body, headers=headers)
        if response.status_code != 200:
            return f"{job.body}: status {response.status_code} {response.text}"
        reply = response.json()
        choice = reply["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        reason, usage = choice["finish_reason"], reply.get("usage")
    want = {
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": job.completion_tokens,
        "total_tokens": job.prompt_tokens + job.completion_tokens,
    }
    if usage is not None:  # what earlier requests left in the cache, at most all but the last prompt token
        cached = usage.pop("prompt_tokens_details", {}).get("cached_tokens")
        if not isinstance(cached, int) or not 0 <= cached < job.prompt_tokens:
            return f"{job.body}: {cached} cached prompt tokens of {job.prompt_tokens}"
    if (text, reason, usage) != (job.text, job.finish_reason, want):
        return f"{job.body}: got {(text, reason, usage)}, want {(job.text, job.finish_reason, want)}"
    return None


def check_bad(client: httpx.Client, job: Bad) -> str | None:
    if isinstance(job.body, bytes):
        headers = {**job.headers, "Content-Type": "application/json"}
        response = client.post(job.path, content=job.body, headers=headers)
    else:
        response = client.post(job.path, json=job.body, headers=job.headers)
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"{job.name}: status {response.status_code}, no OpenAI error object: {response.text[:200]}"
    if (
        response.status_code != job.status
        or error.get("param") != job.param
        or error.get("type") != job.kind
        or not isinstance(error.get("message"), str)
        or not error["message"]
        or error.get("code", "absent") != job.code
    ):
        return f"{job.name}: status {response.status_code}, {error}"
    return None


def check_drop(client: httpx.Client, job: Drop) -> str | None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with client.stream("POST", job.path, json=job.body, headers=headers) as response:
        if response.status_code != 200:
            return f"dropped stream: status {response.status_code}"
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # leaving the block closes the connection mid-stream
    return None


def check_health(client: httpx.Client) -> str | None:
    response = client.get("/health")
    if response.status_code != 200 or response.json().get("status") != "ok":
        return f"/health: {response.status_code} {response.text}"
    return None


def run_half(url: str, jobs: list, seed: int) -> list[str]:
    """Every job once, spread over the clients; the failures, described."""
    random.Random(seed).shuffle(jobs)
    shares = [jobs[i::CLIENTS] for i in range(CLIENTS)]
    start = threading.Barrier(CLIENTS)

    def client_run(share) -> list[str]:
        failures = []
        with httpx.Client(base_url=url, timeout=60) as client:
            start.wait(timeout=30)
            for count, job in enumerate(share):
                if isinstance(job, Good):
                    failure = check_good(client, job)
                elif isinstance(job, Bad):
                    failure = check_bad(client, job)
                else:
                    failure = check_drop(client, job)
                if count % 4 == 0:
                    failure = failure or check_health(client)
                if failure:
                    failures.append(failure)
        return failures

    with ThreadPoolExecutor(CLIENTS) as pool:
        return [failure for failures in pool.map(client_run, shares) for failure in failures]


def resident_bytes() -> int:
    gc.collect()
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def request_counts(live) -> Counter:
    """``reader_requests_total`` by status, as /metrics shows it."""
    response = httpx.get(f"{live.url}/metrics", headers=live.headers)
    assert response.status_code == 200
    pattern = re.compile(r'^reader_requests_total\{status="(\d+)"\} ([0-9.e+]+)$', re.MULTILINE)
    return Counter({status: int(float(value)) for status, value in pattern.findall(response.text)})


@pytest.fixture(scope="module")
def guarded(tiny):
    with live_server(make_engine(tiny), api_key=API_KEY) as live:
        yield live


def test_soak_with_malformed_requests_and_dropped_streams(guarded, tiny):
    good, bad = good_requests(make_engine(tiny)), bad_requests()
    bad_count = HALF // 5
    half = [good[i % len(good)] for i in range(HALF - bad_count)] + [
        bad[i % len(bad)] for i in range(bad_count)
    ]
    statuses = Counter()
    rss = []
    for number in range(2):
        jobs = [*half, *dropped_streams(DROPPED)]
        failures = run_half(guarded.url, jobs, seed=number)
        assert failures == [], f"{len(failures)} failures, the first ones: {failures[:5]}"
        statuses.update(str(job.status) if isinstance(job, Bad) else "200" for job in jobs)
        assert guarded.wait_until_idle(10), "requests were left in the engine or the service"
        rss.append(resident_bytes())

    engine = guarded.engine
    assert len(engine.scheduler) == 0
    assert engine.scheduler.free_rows == list(range(engine.scheduler.num_rows))
    assert guarded.service.in_flight == 0
    assert httpx.get(f"{guarded.url}/health").status_code == 200
    assert request_counts(guarded) == statuses
    growth = rss[1] - rss[0]
    assert growth < MAX_RSS_GROWTH, f"resident memory grew by {growth / 2**20:.1f} MiB in the second half"
