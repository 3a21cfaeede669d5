"""A live ``reader serve`` app for the serve tests: the tiny model with speculation, uvicorn in a thread.

Every server listens on 127.0.0.1 on a free port and is stopped (gracefully) by its fixture.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest
import torch
import uvicorn
from fastapi import FastAPI

from reader_spec.budget.costs import CostModel
from reader_spec.drafters import ReaderDrafter
from reader_spec.engine.loop import Engine
from reader_spec.serve.app import ServerSettings, create_app
from reader_spec.serve.service import EngineService

MODEL = "tiny-llama"
"""The model id the test servers serve."""


def flat_costs() -> CostModel:
    """Verification costs the same whatever it verifies (calibration is instant): every node is verified."""
    return CostModel(measure=lambda batch, drafted, context: dict.fromkeys(drafted, 1.0))


def make_engine(tiny, max_batch_size: int = 4, engine_class: type[Engine] = Engine, **options) -> Engine:
    """The engine ``reader serve`` builds on the tiny model, warmed up as ``reader serve`` does (the
    adaptive budget needs the cost curves of every batch size the server may run)."""
    engine = engine_class(tiny, ReaderDrafter(), costs=flat_costs(), max_batch_size=max_batch_size, **options)
    engine.warm_up(max_batch_size)
    return engine


class ThrottledEngine(Engine):
    """An engine whose every step waits for ``gate`` to be open and then for ``step_delay`` seconds, so that
    a test can hold requests in the queue (gate closed) or keep one decoding long enough to watch it."""

    def __init__(self, *args, step_delay: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_delay = step_delay
        self.gate = threading.Event()
        self.gate.set()

    def step(self):
        self.gate.wait(timeout=30)
        time.sleep(self.step_delay)
        return super().step()


def wait_for(condition, timeout: float = 5.0, interval: float = 0.01) -> bool:
    """Whether ``condition()`` became true within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


@dataclass
class LiveServer:
    port: int
    engine: Engine
    service: EngineService
    app: FastAPI
    api_key: str | None
    errors: list[logging.LogRecord]
    """Every error the server logged (a stack trace from the app, the engine thread or uvicorn)."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "x", max_retries=0, **options)

    def async_client(self, **options) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=self.api_key or "x", max_retries=0, **options
        )

    def wait_until_idle(self, timeout: float = 5.0) -> bool:
        """Whether the engine and the service hold no request within ``timeout`` seconds."""
        return wait_for(lambda: self.idle, timeout)

    @property
    def idle(self) -> bool:
        scheduler = self.engine.scheduler
        return (
            len(scheduler) == 0
            and sorted(scheduler.free_rows) == list(range(scheduler.num_rows))
            and self.service.in_flight == 0
        )


@contextlib.contextmanager
def live_server(
    engine: Engine,
    *,
    max_queue: int = 256,
    api_key: str | None = None,
    max_body_bytes: int = 4 * 1024 * 1024,
) -> Iterator[LiveServer]:
    """Serve ``engine`` on 127.0.0.1 (a free port) until the block ends, which fails if the server logged
    an error (uvicorn's loggers are left to propagate to the root logger, where they are collected)."""
    service = EngineService(engine, max_queue=max_queue)
    settings = ServerSettings(model_name=MODEL, api_key=api_key, max_body_bytes=max_body_bytes)
    app = create_app(service, settings)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", log_config=None, timeout_graceful_shutdown=5
    )
    server = uvicorn.Server(config)
    errors = ErrorRecords()
    logging.getLogger().addHandler(errors)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            logging.getLogger().removeHandler(errors)
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        port = server.servers[0].sockets[0].getsockname()[1]
        yield LiveServer(port, engine, service, app, api_key, errors.records)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        logging.getLogger().removeHandler(errors)
    assert not thread.is_alive(), "the test server did not stop"
    assert not errors.records, f"the server logged errors: {[r.getMessage() for r in errors.records]}"


class ErrorRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    """The tiny model runs fastest on one thread, the more so on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def server(tiny) -> Iterator[LiveServer]:
    """An open server (no API key), batch of 4."""
    with live_server(make_engine(tiny)) as live:
        yield live
