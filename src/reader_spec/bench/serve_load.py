"""The OpenAI server under load (``reader bench-serve``): speculation on and off, at several concurrencies.

For every concurrency, the server is started in this process twice, on 127.0.0.1 with a free port and a
batch as large as the concurrency: first with plain decoding (``--drafter none``), then with the READER
drafter, so that machine drift hits both alike. Each server gets a fresh engine (its response history
starts empty), calibrated and warmed up before its clients start. ``concurrency`` streaming chat
clients (greedy) then share one list of conversations, each taking the next as soon as its previous
one finished, until the list is used up. A conversation is one or more user messages, each sent
after the answer to the one before, with the conversation so far (a chat client's next turn).

Per request, over the HTTP stream as a client sees it:

* TTFT: from sending the request to the first chunk with non-empty content.
* ITL: from the first content chunk to the last, divided by the output tokens after the first
  (``usage.completion_tokens - 1``, from ``stream_options.include_usage``): the mean time per token,
  where a chunk carrying several tokens (one speculative step) counts as that many gaps. A chunk does
  not say how many tokens it carries, so the gaps are not divided chunk by chunk; this is the figure
  vLLM's benchmark calls TPOT. Requests with one output token, or one content chunk, have none.

Per run: output tokens over the seconds from the first request sent to the last response read, and
p50/p99 (linear interpolation) of TTFT and ITL over its requests (and TTFT's p50 over the later
turns of conversations alone, whose prompts the first turn's cache row mostly holds: the share of
prompt tokens found in the cache is the usage's ``cached_tokens``). Speedup is the speculative run's
tokens/s over the plain run's at the same concurrency; ``identical`` counts requests whose streamed
text is the same in both (greedy decoding must give the same output). Clients, HTTP server and engine share
one process (and its GIL): absolute latencies include the client's own parsing, alike for both.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
import uvicorn

from reader_spec.budget.costs import CostModel
from reader_spec.drafters import ReaderDrafter
from reader_spec.drafters.retrieval.datastore import Datastore
from reader_spec.engine.loop import DEFAULT_BUDGET, Engine
from reader_spec.files import write_atomic
from reader_spec.loading import LoadedModel
from reader_spec.serve.app import ServerSettings, create_app
from reader_spec.serve.service import EngineService

DEFAULT_CONCURRENCY = (1, 8, 32)
SERVER_START_SECONDS = 60.0
MODES = {False: "off", True: "on"}


class ServeLoadError(RuntimeError):
    """A request failed or the server did not start: the measurement would be meaningless."""


@dataclass
class RequestResult:
    conversation: int
    """Index into the run's list of conversations."""
    turn: int
    """Which of the conversation's messages (0: the first)."""
    ttft: float | None
    """None when no content came (the first token ended the request, its text empty)."""
    itl: float | None
    seconds: float
    """From sending the request to the end of its stream."""
    output_tokens: int
    chunks: int
    """Chunks with non-empty content."""
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens the server found in its cache (the usage's ``prompt_tokens_details``)."""
    text: str = field(repr=False)


@dataclass
class RunResult:
    speculation: bool
    concurrency: int
    seconds: float
    peak_in_flight: int
    requests: list[RequestResult]
    identical: int | None = None
    """Speculative runs: requests whose output equals the plain run's at the same concurrency."""
    speedup: float | None = None
    """Speculative runs: tokens/s over the plain run's at the same concurrency."""

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    def percentiles(self, name: str) -> tuple[float | None, float | None]:
        values = [getattr(r, name) for r in self.requests if getattr(r, name) is not None]
        if not values:
            return None, None
        p50, p99 = np.percentile(values, [50, 99])
        return float(p50), float(p99)

    def as_dict(self) -> dict:
        (ttft_p50, ttft_p99), (itl_p50, itl_p99) = self.percentiles("ttft"), self.percentiles("itl")
        later = [r.ttft for r in self.requests if r.turn > 0 and r.ttft is not None]
        chunks = sum(r.chunks for r in self.requests)
        prompt_tokens = sum(r.prompt_tokens for r in self.requests)
        return {
            "speculation": self.speculation,
            "concurrency": self.concurrency,
            "requests": len(self.requests),
            "output_tokens": self.output_tokens,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "ttft_p50": ttft_p50,
            "ttft_p99": ttft_p99,
            "itl_p50": itl_p50,
            "itl_p99": itl_p99,
            "later_turns_ttft_p50": float(np.percentile(later, 50)) if later else None,
            "cached_prompt_share": sum(r.cached_tokens for r in self.requests) / prompt_tokens
            if prompt_tokens
            else None,
            "speedup": self.speedup,
            "identical": self.identical,
            "peak_in_flight": self.peak_in_flight,
            "tokens_per_chunk": self.output_tokens / chunks if chunks else None,
            "per_request": [
                {k: v for k, v in asdict(r).items() if k != "text"}
                for r in sorted(self.requests, key=lambda r: (r.conversation, r.turn))
            ],
        }


@dataclass
class ServeLoadReport:
    environment: dict
    settings: dict
    runs: list[RunResult] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "environment": self.environment,
            "settings": self.settings,
            "runs": [run.as_dict() for run in self.runs],
        }

    def markdown(self) -> str:
        env, settings = self.environment, self.settings
        turns = settings.get("requests") != settings.get("conversations")
        lines = [
            f"# reader bench-serve: {env.get('model', '?')}",
            "",
            f"{settings.get('conversations')} Spec-Bench questions (categories interleaved), "
            f"{settings.get('requests')} requests ({'every turn' if turns else 'first turns'}) through the "
            f"OpenAI server's streamed chat completions; greedy, at most {settings.get('max_new_tokens')} "
            f"new tokens, draft budget {settings.get('budget')}; batch size = concurrency; prefix reuse "
            f"{MODES[settings.get('prefix_reuse', True)]}. "
            f"{env.get('cpu', '?')}, {env.get('threads', '?')} threads; torch {env.get('torch', '?')}; "
            f"commit {env.get('commit') or '?'}, {env.get('date', '?')}.",
            "",
            "| concurrency | speculation | requests | output tokens | seconds | tokens/s | TTFT p50 ms "
            "| TTFT p99 ms |" + (" later turns' TTFT p50 ms |" if turns else "") + " ITL p50 ms | ITL p99 ms "
            "| prompt tokens cached | speedup | identical |",
            "|---:|---|---:|---:|---:|---:|---:|---:|"
            + ("---:|" if turns else "")
            + "---:|---:|---:|---:|---:|",
        ]
        for run in self.runs:
            row = run.as_dict()
            speedup = f"{run.speedup:.2f}x" if run.speedup is not None else ""
            identical = f"{run.identical}/{len(run.requests)}" if run.identical is not None else ""
            cells = [
                str(run.concurrency),
                MODES[run.speculation],
                str(len(run.requests)),
                str(run.output_tokens),
                f"{run.seconds:.2f}",
                f"{run.tokens_per_second:.1f}",
                *(
                    _ms(row[k])
                    for k in ("ttft_p50", "ttft_p99", *(("later_turns_ttft_p50",) if turns else ()))
                ),
                *(_ms(row[k]) for k in ("itl_p50", "itl_p99")),
                f"{row['cached_prompt_share']:.0%}" if row["cached_prompt_share"] is not None else "n/a",
                speedup,
                identical,
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines += [
            "",
            "tokens/s: all output tokens over the run's wall time. TTFT: request sent to first content "
            "chunk. ITL: per request, first to last content chunk over its output tokens after the first "
            "(token counts from the stream's usage); p50/p99 over requests. prompt tokens cached: the "
            "share the server found in its cache (usage.prompt_tokens_details.cached_tokens). speedup: "
            "tokens/s over speculation off at the same concurrency. identical: outputs equal to "
            "speculation off's.",
        ]
        return "\n".join(lines)

    def save(self, directory: Path) -> list[Path]:
        """``serve.json`` and ``serve.md``, each written atomically; returns their paths."""
        files = {
            "serve.json": json.dumps(self.as_dict(), indent=1).encode(),
            "serve.md": (self.markdown() + "\n").encode(),
        }
        for name, data in files.items():
            write_atomic(Path(directory) / name, data)
        return [Path(directory) / name for name in files]


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1000:.1f}" if seconds is not None else "n/a"


def run_serve_load(
    loaded: LoadedModel,
    conversations: Sequence[Sequence[str]],
    *,
    concurrency: Sequence[int] = DEFAULT_CONCURRENCY,
    max_new_tokens: int = 128,
    budget: int = DEFAULT_BUDGET,
    datastore: Datastore | None = None,
    costs: CostModel | None = None,
    runner: str = "auto",
    reuse_prefixes: bool = True,
    environment: dict | None = None,
    progress: Callable[[str], None] | None = None,
) -> ServeLoadReport:
    """Serve ``conversations`` (each a list of user messages, sent in turn) at each concurrency,
    speculation off then on.

    ``costs`` replaces the measured verification costs (tests); ``environment`` describes the machine
    in the report; ``progress`` hears a line before each run.
    """
    levels = list(dict.fromkeys(concurrency))
    if not conversations or not levels or min(levels) < 1 or max_new_tokens < 1 or budget < 0:
        raise ValueError("need conversations, positive concurrency and max_new_tokens, and budget >= 0")
    if any(isinstance(c, str) or not c or not all(isinstance(m, str) for m in c) for c in conversations):
        raise ValueError("a conversation is a non-empty list of user messages")
    settings = (budget, datastore, costs, runner, reuse_prefixes)
    # Calibration (once per machine and model, cached) before anything is timed.
    _engine(loaded, True, max(levels), *settings).calibrate(max(levels))
    report = ServeLoadReport(
        environment=environment if environment is not None else {"model": loaded.name},
        settings={
            "concurrency": levels,
            "conversations": len(conversations),
            "requests": sum(map(len, conversations)),
            "max_new_tokens": max_new_tokens,
            "prefix_reuse": reuse_prefixes,
            "budget": budget,
            "datastore": str(datastore.path) if datastore is not None else None,
            "order": "at each concurrency: speculation off, then on",
            "ttft": "request sent to first chunk with content",
            "itl": "per request: (last content chunk - first) / (usage.completion_tokens - 1)",
            "percentiles": "over requests, linear interpolation",
        },
    )
    for level in levels:
        plain = None
        for speculation in (False, True):
            if progress is not None:
                progress(f"concurrency {level}, speculation {MODES[speculation]}")
            engine = _engine(loaded, speculation, level, *settings)
            engine.warm_up(level)
            engine.forget_prefixes()
            run = _serve(engine, speculation, loaded.name, conversations, level, max_new_tokens)
            if plain is None:
                plain = run
            else:
                reference = {(r.conversation, r.turn): r.text for r in plain.requests}
                run.identical = sum(r.text == reference[r.conversation, r.turn] for r in run.requests)
                run.speedup = (
                    run.tokens_per_second / plain.tokens_per_second if plain.tokens_per_second else None
                )
            report.runs.append(run)
    return report


def _engine(
    loaded: LoadedModel,
    speculation: bool,
    max_batch_size: int,
    budget: int,
    datastore: Datastore | None,
    costs: CostModel | None,
    runner: str,
    reuse_prefixes: bool,
) -> Engine:
    """What ``reader serve`` builds: the READER drafter (history on), or none."""
    drafter = ReaderDrafter(datastore=datastore) if speculation else None
    return Engine(
        loaded,
        drafter,
        budget=budget,
        max_batch_size=max_batch_size,
        costs=costs,
        runner=runner,
        reuse_prefixes=reuse_prefixes,
    )


def _serve(
    engine: Engine,
    speculation: bool,
    model_name: str,
    conversations: Sequence[Sequence[str]],
    concurrency: int,
    max_new_tokens: int,
) -> RunResult:
    app = create_app(EngineService(engine), ServerSettings(model_name=model_name))
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False, lifespan="on")
    )
    thread = threading.Thread(target=server.run, name="bench-serve-http", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + SERVER_START_SECONDS
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise ServeLoadError("the server did not start")
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        run = asyncio.run(_drive(url, model_name, conversations, concurrency, max_new_tokens))
        run.speculation = speculation
        return run
    finally:
        server.should_exit = True
        thread.join()


async def _drive(
    url: str, model_name: str, conversations: Sequence[Sequence[str]], concurrency: int, max_new_tokens: int
) -> RunResult:
    """``concurrency`` clients taking the next conversation until none is left."""
    pending = iter(enumerate(conversations))
    results: list[RequestResult] = []
    in_flight = peak = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:

        async def client_loop() -> None:
            nonlocal in_flight, peak
            for index, conversation in pending:  # one iterator shared by every client
                in_flight += 1
                peak = max(peak, in_flight)
                messages: list[dict[str, str]] = []
                for turn, message in enumerate(conversation):
                    messages.append({"role": "user", "content": message})
                    result = await _request(client, model_name, index, turn, messages, max_new_tokens)
                    results.append(result)
                    messages.append({"role": "assistant", "content": result.text})
                in_flight -= 1

        started = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        seconds = time.perf_counter() - started
    ordered = sorted(results, key=lambda r: (r.conversation, r.turn))
    return RunResult(False, concurrency, seconds, peak, ordered)


async def _request(
    client: httpx.AsyncClient,
    model_name: str,
    index: int,
    turn: int,
    messages: list[dict[str, str]],
    max_new_tokens: int,
) -> RequestResult:
    body = {
        "model": model_name,
        "messages": list(messages),
        "max_tokens": max_new_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    arrivals: list[float] = []
    text: list[str] = []
    usage = None
    sent = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")
            raise ServeLoadError(
                f"conversation {index}, turn {turn + 1}: the server answered {response.status_code}: {detail}"
            )
        async for line in response.aiter_lines():
            now = time.perf_counter()
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise ServeLoadError(
                    f"conversation {index}, turn {turn + 1}: {event['error'].get('message')}"
                )
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    arrivals.append(now)
                    text.append(content)
    finished = time.perf_counter()
    if usage is None:
        raise ServeLoadError(f"conversation {index}, turn {turn + 1}: the stream carried no usage")
    tokens = int(usage["completion_tokens"])
    ttft = arrivals[0] - sent if arrivals else None
    itl = (arrivals[-1] - arrivals[0]) / (tokens - 1) if tokens > 1 and len(arrivals) > 1 else None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return RequestResult(
        index,
        turn,
        ttft,
        itl,
        finished - sent,
        tokens,
        len(arrivals),
        usage["prompt_tokens"],
        cached,
        "".join(text),
    )
