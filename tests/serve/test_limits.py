"""The server's guards and bookkeeping: API key, body size, queue overflow, metrics, clients that go
away (their cache row is freed, not decoded to the end), an engine that fails, and shutdown."""

from __future__ import annotations

import hmac
import json
import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from reader_spec.cli import build_parser
from reader_spec.cli import serve as serve_command
from reader_spec.serve.app import ServerSettings
from tests.serve.conftest import MODEL, ErrorRecords, ThrottledEngine, live_server, make_engine, wait_for

API_KEY = "secret"
BODY_LIMIT = 2048
LONG = {"model": MODEL, "prompt": "w5 w6 w7", "max_tokens": 2000, "temperature": 0}
"""A request that decodes for ~190 steps on the tiny model (its greedy output never ends early)."""


def metric(live, name: str, **labels) -> float:
    """The sum of a metric's samples with these labels, as /metrics shows it."""
    response = httpx.get(f"{live.url}/metrics", headers=live.headers)
    assert response.status_code == 200
    total = 0.0
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def assert_error(response: httpx.Response, status: int, kind: str, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == kind
    assert error["param"] == param
    assert isinstance(error["message"], str) and error["message"]
    return error


@pytest.fixture(scope="module")
def guarded(tiny):
    with live_server(make_engine(tiny), api_key=API_KEY, max_body_bytes=BODY_LIMIT) as live:
        yield live


@pytest.fixture(scope="module")
def slow(tiny):
    """A server whose engine steps take 50 ms: a long request is still decoding seconds later."""
    engine = make_engine(tiny, max_batch_size=2, engine_class=ThrottledEngine, step_delay=0.05)
    with live_server(engine) as live:
        yield live


def test_health_needs_no_key_but_the_api_does(guarded):
    health = httpx.get(f"{guarded.url}/health")
    assert health.status_code == 200
    assert health.json()["status"] == "ok"

    assert_error(httpx.get(f"{guarded.url}/v1/models"), 401, "authentication_error")
    wrong = {"Authorization": "Bearer not-the-key"}
    assert_error(httpx.get(f"{guarded.url}/v1/models", headers=wrong), 401, "authentication_error")
    assert_error(httpx.get(f"{guarded.url}/metrics"), 401, "authentication_error")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="not-the-key", max_retries=0).models.list()

    assert httpx.get(f"{guarded.url}/v1/models", headers=guarded.headers).status_code == 200
    assert httpx.get(f"{guarded.url}/metrics", headers=guarded.headers).status_code == 200
    with guarded.client() as client:
        reply = client.completions.create(model=MODEL, prompt="w5 w6", max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens == 3


def test_the_api_key_is_compared_in_constant_time(guarded, monkeypatch):
    compared = []
    compare = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append((a, b)) or compare(a, b))
    wrong = {"Authorization": "Bearer not-the-key"}
    assert_error(httpx.get(f"{guarded.url}/v1/models", headers=wrong), 401, "authentication_error")
    assert compared == [(b"Bearer not-the-key", f"Bearer {API_KEY}".encode())]


def test_body_over_the_limit_gets_413(guarded):
    url = f"{guarded.url}/v1/completions"
    body = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 3, "temperature": 0}
    small = json.dumps(body).encode()
    fits = small[:-1] + b" " * (BODY_LIMIT - len(small)) + b"}"
    over = small[:-1] + b" " * (BODY_LIMIT + 1 - len(small)) + b"}"
    headers = {**guarded.headers, "Content-Type": "application/json"}
    assert len(fits) == BODY_LIMIT and len(over) == BODY_LIMIT + 1

    assert httpx.post(url, content=fits, headers=headers).status_code == 200
    assert_error(httpx.post(url, content=over, headers=headers), 413, "invalid_request_error")

    def chunked():  # no Content-Length: the limit holds for the bytes as they arrive
        for start in range(0, len(over), 512):
            yield over[start : start + 512]

    assert_error(httpx.post(url, content=chunked(), headers=headers), 413, "invalid_request_error")
    assert guarded.wait_until_idle()


def test_queue_overflow_gets_429_with_retry_after(tiny):
    engine = make_engine(tiny, max_batch_size=1, engine_class=ThrottledEngine)
    with live_server(engine, max_queue=1) as live:
        url = f"{live.url}/v1/completions"
        body = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 5, "temperature": 0}
        engine.gate.clear()  # no step runs: the first two requests hold the batch row and the queue
        try:
            with ThreadPoolExecutor(5) as pool:
                replies = [pool.submit(httpx.post, url, json=body, timeout=30) for _ in range(5)]
                assert wait_for(lambda: sum(r.done() for r in replies) == 3)
                assert live.service.in_flight == 2
                with pytest.raises(openai.RateLimitError) as refused, live.client() as client:
                    client.completions.create(model=MODEL, prompt="w5", max_tokens=2, temperature=0)
                assert refused.value.response.headers["retry-after"] == "1"
                engine.gate.set()
                statuses = sorted(r.result().status_code for r in replies)
        finally:
            engine.gate.set()
        assert statuses == [200, 200, 429, 429, 429]
        for reply in (r.result() for r in replies):
            if reply.status_code == 429:
                assert reply.headers["retry-after"] == "1"
                assert_error(reply, 429, "rate_limit_error")
            else:
                assert reply.json()["usage"]["completion_tokens"] == 5
        assert live.wait_until_idle()
        assert httpx.post(url, json=body, timeout=30).status_code == 200  # capacity is back


def test_metrics_count_requests_tokens_and_accepted_drafts(server):
    before = metric(server, "reader_generated_tokens_total")
    cached_before = metric(server, "reader_cached_prompt_tokens_total")
    ok_before = metric(server, "reader_requests_total", status="200")
    generated = cached = 0
    with server.client() as client:
        for prompt in ["w5 w6 w7 w5 w6 w7", "w9 w8 w9 w8 w9 w8", "w9 w8 w9 w8 w9 w8 w7"]:
            reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
            generated += reply.usage.completion_tokens
            cached += reply.usage.prompt_tokens_details.cached_tokens
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="w5", max_tokens=2)

    # an engine step publishes its updates first and records its metrics right after
    assert wait_for(lambda: metric(server, "reader_generated_tokens_total") == before + generated)
    assert cached >= 6  # the last prompt begins with the one before it
    assert metric(server, "reader_cached_prompt_tokens_total") == cached_before + cached
    assert metric(server, "reader_requests_total", status="200") == ok_before + 3
    assert metric(server, "reader_requests_total", status="404") >= 1
    assert metric(server, "reader_draft_tokens_accepted_total") > 0  # the output loops: drafts hit


def test_metrics_help_says_what_each_counts(server):
    response = httpx.get(f"{server.url}/metrics")
    helps = {family.name: family.documentation for family in text_string_to_metric_families(response.text)}
    assert helps["reader_draft_tokens_proposed"] == "Draft tokens proposed"
    assert helps["reader_draft_tokens_accepted"] == "Draft tokens accepted, by source"


def open_raw_request(port: int, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    connection = socket.create_connection(("127.0.0.1", port))
    connection.sendall(head.encode() + data)
    return connection


@pytest.mark.parametrize("choices", [1, 2])
def test_client_going_away_frees_its_rows(slow, choices):
    running = slow.engine.scheduler.running
    generated = metric(slow, "reader_generated_tokens_total")
    went_away = metric(slow, "reader_requests_total", status="499")

    connection = open_raw_request(slow.port, "/v1/completions", {**LONG, "n": choices})
    try:
        assert wait_for(lambda: len(running) == choices)
        time.sleep(0.2)  # a few steps
        assert len(running) == choices
    finally:
        connection.close()
    closed = time.monotonic()
    assert wait_for(lambda: not running, timeout=3)
    assert time.monotonic() - closed < 2  # finishing would take ~190 steps of 50 ms
    assert slow.wait_until_idle()
    assert wait_for(lambda: metric(slow, "reader_requests_total", status="499") == went_away + 1)
    assert metric(slow, "reader_generated_tokens_total") == generated  # cancelled, never finished


@pytest.mark.parametrize("choices", [1, 2])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_dropped_stream_frees_its_rows(slow, path, choices):
    running = slow.engine.scheduler.running
    generated = metric(slow, "reader_generated_tokens_total")
    body = {**LONG, "stream": True, "n": choices}
    if path.endswith("chat/completions"):
        body = {k: v for k, v in body.items() if k != "prompt"}
        body["messages"] = [{"role": "user", "content": "w5 w6 w7"}]

    with httpx.Client(base_url=slow.url, timeout=30) as client:
        with client.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            chunks = 0
            for line in response.iter_lines():
                chunks += line.startswith("data: ")
                if chunks == choices + 1:
                    break
            assert len(running) == choices
        closed = time.monotonic()
        assert wait_for(lambda: not running, timeout=3)
        assert time.monotonic() - closed < 2
        assert client.get("/health").status_code == 200
    assert slow.wait_until_idle()
    assert metric(slow, "reader_generated_tokens_total") == generated


def test_a_failing_engine_fails_its_requests_and_a_dead_one_fails_health(tiny, monkeypatch):
    errors = ErrorRecords()  # expected here: kept from the root logger, where every live server checks
    service_log = logging.getLogger("reader_spec.serve.service")
    monkeypatch.setattr(service_log, "propagate", False)
    monkeypatch.setattr(service_log, "handlers", [errors])
    engine = make_engine(tiny, max_batch_size=2)
    with live_server(engine) as live:
        url = f"{live.url}/v1/completions"
        body = {"model": MODEL, "prompt": "w5 w6", "max_tokens": 5, "temperature": 0}

        def broken(*args):
            raise RuntimeError("broken")

        record_step, live.service.on_step = live.service.on_step, broken  # after the step: metrics fail
        assert_error(httpx.post(url, json=body, timeout=10), 500, "server_error")
        assert live.wait_until_idle()
        live.service.on_step = record_step
        assert httpx.post(url, json=body, timeout=10).status_code == 200  # the engine thread lived on
        assert httpx.get(f"{live.url}/health").status_code == 200

        monkeypatch.setattr(engine, "step", broken)
        monkeypatch.setattr(engine, "cancel", broken)  # failing the requests fails too: the thread ends
        assert_error(httpx.post(url, json=body, timeout=10), 500, "server_error")
        assert wait_for(lambda: not live.service.alive)
        assert_error(httpx.get(f"{live.url}/health"), 503, "server_error")
        assert_error(httpx.post(url, json=body, timeout=10), 503, "server_error")
    assert [record.getMessage() for record in errors.records] == [
        "the engine failed; failing the requests in flight",
        "the engine failed; failing the requests in flight",
        "the engine thread stopped",
    ]


def test_uvicorn_gives_running_requests_the_servers_grace_on_shutdown(monkeypatch):
    engine = SimpleNamespace(
        warm_up=lambda batch: None, scheduler=SimpleNamespace(num_rows=2), tokenizer=None
    )
    monkeypatch.setattr(serve_command, "load_target", lambda args: None)
    monkeypatch.setattr(serve_command, "build_engine", lambda args, loaded, max_batch_size: engine)
    options = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: options.update(kwargs))
    assert serve_command.run(build_parser().parse_args(["serve"])) == 0
    assert options["timeout_graceful_shutdown"] == ServerSettings(MODEL).shutdown_grace_seconds
