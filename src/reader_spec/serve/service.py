"""One thread owns the engine: requests join its running batch between steps and stream back out.

The HTTP side never touches the model. It submits a request and reads that request's updates from an
asyncio queue; the engine thread adds waiting requests, runs :meth:`Engine.step` while anything runs,
and hands each update to the event loop. Cancelling (a client went away) frees the request's cache
row before the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from reader_spec.config import GenerationConfig
from reader_spec.engine.loop import Engine, Update

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """More requests than running slots plus the waiting queue hold."""


class ShuttingDown(Exception):
    """The server is stopping, or its engine thread has stopped, and takes no new requests."""


@dataclass
class Stream:
    """One request's updates, in order; ``None`` after the last (or an ``Exception`` on failure)."""

    key: int
    prompt_tokens: int
    updates: asyncio.Queue = field(default_factory=asyncio.Queue)


@dataclass
class StepRecord:
    """What the service tells its observers after every engine step."""

    seconds: float
    running: int
    waiting: int
    updates: list[Update]


class EngineService:
    """Runs an :class:`Engine` in a background thread for many concurrent callers.

    ``max_queue`` requests may wait beyond the engine's running batch; more are refused with
    :class:`QueueFull`.
    """

    def __init__(self, engine: Engine, *, max_queue: int = 256) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.on_step: Callable[[StepRecord], None] | None = None
        """Called in the engine thread after each step; the app sets it to record its metrics."""
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, tuple[Stream, asyncio.AbstractEventLoop]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._closed: str | None = None
        """Why no new request is taken (shutting down, or the engine thread stopped); None while open."""
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reader-engine", daemon=True)

    # --- event-loop side -------------------------------------------------------------------------
    def start(self) -> None:
        """Measure the costs any batch up to the engine's size needs (once per machine), then serve."""
        self.engine.calibrate(self.engine.scheduler.num_rows)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs; it stops on shutdown, or when even failing requests failed."""
        return self._thread.is_alive()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    @property
    def capacity(self) -> int:
        return self.engine.scheduler.num_rows + self.max_queue

    def submit(self, tokens: list[int], config: GenerationConfig) -> Stream:
        """Queue already-encoded prompt tokens; updates arrive on the returned stream's queue."""
        loop = asyncio.get_running_loop()
        with self._lock:  # the engine thread closes under the lock, so that no request slips in after
            if self._closed is not None:
                raise ShuttingDown(self._closed)
            if len(self._streams) >= self.capacity:
                raise QueueFull
            stream = Stream(next(self._ids), len(tokens))
            self._streams[stream.key] = (stream, loop)
        self._inbox.put(("add", stream.key, tokens, config))
        return stream

    def cancel(self, key: int) -> None:
        """Drop a request wherever it is; its stream gets no more updates."""
        with self._lock:
            known = self._streams.pop(key, None) is not None
        if known:
            self._inbox.put(("cancel", key))

    def stop(self, grace_seconds: float = 10.0) -> None:
        """Refuse new requests, let running ones finish for up to ``grace_seconds``, cancel the rest."""
        reason = "the server is shutting down"
        self._closed = reason
        deadline = time.monotonic() + grace_seconds
        while self.in_flight and time.monotonic() < deadline and self.alive:
            time.sleep(0.05)
        self._close(reason)
        self._stopping.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout=grace_seconds)

    # --- engine thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    self._turn()
                except Exception as error:  # a bug must not leave callers waiting forever
                    log.exception("the engine failed; failing the requests in flight")
                    self._fail_all(error)
            self._cancel_in_engine()
        except Exception:  # failing them failed too: the thread ends, /health says so, no request waits
            log.exception("the engine thread stopped")
            self._close("the engine stopped after an error; restart the server")

    def _turn(self) -> None:
        """Take the commands queued (waiting for one when idle), then step once if anything runs."""
        engine = self.engine
        self._drain(block=not len(engine.scheduler))
        if not len(engine.scheduler):
            return
        started = time.perf_counter()
        updates = engine.step()
        record = StepRecord(
            time.perf_counter() - started,
            len(engine.scheduler.running),
            len(engine.scheduler.waiting),
            updates,
        )
        for update in updates:
            self._publish(update)
        if self.on_step is not None:
            self.on_step(record)

    def _drain(self, block: bool) -> None:
        """Apply every queued command; wait for one first when the engine has nothing to do."""
        try:
            command = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: tuple) -> None:
        kind, *args = command
        if kind == "add":
            key, tokens, config = args
            with self._lock:
                wanted = key in self._streams
            if wanted:  # not cancelled while it waited in the inbox
                try:
                    self.engine.add_request(tokens, config, request_id=key)
                except ValueError as error:  # checked before submitting; a last guard for the thread
                    self._finish_with(key, error)
        elif kind == "cancel":
            self.engine.cancel(self._engine_key(args[0]))

    def _engine_key(self, stream_key: int) -> int:
        for seq in self.engine.scheduler.running:
            if seq.request_id == stream_key:
                return seq.key
        for request in self.engine.scheduler.waiting:
            if request.request_id == stream_key:
                return request.key
        return -1

    def _publish(self, update: Update) -> None:
        with self._lock:
            entry = self._streams.get(update.request_id)
            if entry is not None and update.output is not None:
                del self._streams[update.request_id]
        if entry is not None:
            stream, loop = entry
            _deliver(loop, stream, update)
            if update.output is not None:
                _deliver(loop, stream, None)

    def _finish_with(self, key: int, error: Exception) -> None:
        with self._lock:
            entry = self._streams.pop(key, None)
        if entry is not None:
            _deliver(entry[1], entry[0], error)

    def _fail_all(self, error: Exception) -> None:
        """Every caller hears of the failure first; then the engine drops their requests."""
        self._fail_streams(error)
        self._cancel_in_engine()

    def _close(self, reason: str) -> None:
        """Take no new request, and fail those still waiting with ``ShuttingDown(reason)``."""
        with self._lock:
            self._closed = self._closed or reason
        self._fail_streams(ShuttingDown(reason))

    def _fail_streams(self, error: Exception) -> None:
        with self._lock:
            failed = list(self._streams.values())
            self._streams.clear()
        for stream, loop in failed:
            _deliver(loop, stream, error)

    def _cancel_in_engine(self) -> None:
        engine = self.engine
        for key in [s.key for s in engine.scheduler.running] + [r.key for r in engine.scheduler.waiting]:
            engine.cancel(key)


def _deliver(loop: asyncio.AbstractEventLoop, stream: Stream, item: object) -> None:
    with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening any more
        loop.call_soon_threadsafe(stream.updates.put_nowait, item)
