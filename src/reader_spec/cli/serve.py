"""``reader serve``: the OpenAI-compatible server, speculation on every request."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os

from reader_spec.cli.common import (
    add_drafting_options,
    add_model_option,
    add_prefix_reuse_option,
    build_engine,
    load_target,
)

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"

log = logging.getLogger("reader_spec.serve")


def add_parser(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve the OpenAI API (completions, chat completions) with speculative decoding",
        description="An OpenAI-compatible HTTP server: /v1/completions and /v1/chat/completions (streamed "
        "or not), /v1/models, /health and /metrics. Requests join the running batch at the next step and "
        "leave it the step they finish; output equals plain decoding token for token.",
    )
    add_model_option(serve)
    serve.add_argument(
        "--served-model-name", help=f"model id clients send (default: --model or {DEFAULT_MODEL_ID})"
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    serve.add_argument("--max-batch-size", type=int, default=8, help="requests decoded together (default 8)")
    serve.add_argument(
        "--max-queue", type=int, default=256, help="requests that may wait beyond the batch (256)"
    )
    add_drafting_options(serve)
    add_prefix_reuse_option(serve)
    serve.add_argument(
        "--api-key",
        default=os.environ.get("READER_API_KEY"),
        help="require 'Authorization: Bearer KEY' on "
        "every endpoint but /health (default: $READER_API_KEY; none: open)",
    )
    serve.add_argument(
        "--max-body-bytes", type=int, default=4 * 1024 * 1024, help="largest request body (4 MiB)"
    )
    serve.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
        raise ValueError("reader serve needs the serve extra: pip install 'reader-spec[serve]'")
    if (
        min(args.max_batch_size, args.max_queue + 1, args.port + 1, args.max_body_bytes) < 1
        or args.budget < 0
    ):
        raise ValueError(
            "--max-batch-size, --max-body-bytes must be positive; --max-queue, --port, --budget >= 0"
        )
    import uvicorn

    from reader_spec.serve.app import ServerSettings, create_app
    from reader_spec.serve.service import EngineService

    loaded = load_target(args)
    engine = build_engine(args, loaded, max_batch_size=args.max_batch_size)
    engine.warm_up(args.max_batch_size)
    settings = ServerSettings(
        model_name=args.served_model_name or args.model or DEFAULT_MODEL_ID,
        api_key=args.api_key or None,
        max_body_bytes=args.max_body_bytes,
    )
    app = create_app(EngineService(engine, max_queue=args.max_queue), settings)
    log.info(
        "serving %s on http://%s:%d/v1 (batch %d)",
        settings.model_name,
        args.host,
        args.port,
        args.max_batch_size,
    )
    # On shutdown uvicorn first waits this long for open requests, then cancels them (which frees their
    # engine rows), and only then runs the app's own stop: uvicorn's wait is the grace running requests get.
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=settings.shutdown_grace_seconds,
    )
    return 0
