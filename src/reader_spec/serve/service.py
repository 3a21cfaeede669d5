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
    """The server is stopping and takes no new requests."""


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
    :class:`QueueFull`. ``on_step`` is called in the engine thread after each step (metrics).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_queue: int = 256,
        on_step: Callable[[StepRecord], None] | None = None,
    ) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.on_step = on_step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, tuple[Stream, asyncio.AbstractEventLoop]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._accepting = True
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reader-engine", daemon=True)

    # --- event-loop side -------------------------------------------------------------------------
    def start(self) -> None:
        """Measure the costs any batch up to the engine's size needs (once per machine), then serve."""
        self.engine.calibrate(self.engine.scheduler.num_rows)
        self._thread.start()

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    @property
    def capacity(self) -> int:
        return self.engine.scheduler.num_rows + self.max_queue

    def submit(self, tokens: list[int], config: GenerationConfig) -> Stream:
        """Queue already-encoded prompt tokens; updates arrive on the returned stream's queue."""
        if not self._accepting:
            raise ShuttingDown
        loop = asyncio.get_running_loop()
        with self._lock:
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
        self._accepting = False
        deadline = time.monotonic() + grace_seconds
        while self.in_flight and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)
        with self._lock:
            left = list(self._streams.values())
            self._streams.clear()
        for stream, loop in left:
            _deliver(loop, stream, ShuttingDown("the server is shutting down"))
        self._stopping.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout=grace_seconds)

    # --- engine thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            idle = not len(engine.scheduler)
            self._drain(block=idle)
            if not len(engine.scheduler):
                continue
            started = time.perf_counter()
            try:
                updates = engine.step()
            except Exception as error:  # a bug must not leave callers waiting forever
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(error)
                continue
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
        for key in [s.key for s in engine.scheduler.running] + [r.key for r in engine.scheduler.waiting]:
            engine.cancel(key)

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
        engine = self.engine
        for key in [s.key for s in engine.scheduler.running] + [r.key for r in engine.scheduler.waiting]:
            engine.cancel(key)
        with self._lock:
            failed = list(self._streams.values())
            self._streams.clear()
        for stream, loop in failed:
            _deliver(loop, stream, error)


def _deliver(loop: asyncio.AbstractEventLoop, stream: Stream, item: object) -> None:
    with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening any more
        loop.call_soon_threadsafe(stream.updates.put_nowait, item)
