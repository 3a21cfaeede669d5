"""What the replay scripts share: a recording's command-line arguments and its tokenized tasks."""

from __future__ import annotations

import argparse

from reader_spec.bench.replay import Conversation, load_conversations
from reader_spec.files import cache_root
from reader_spec.loading import load_tokenizer


def recording_arguments(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("recording", help="JSONL (optionally .gz) of {messages: [...]}, as replay reads")
    parser.add_argument("--model", help="whose tokenizer (default: the default model's)")
    parser.add_argument("--budget", type=int, default=32, help="most draft tokens a step may verify")
    parser.add_argument("--limit", type=int, help="first N tasks")
    return parser


def recorded_tasks(args: argparse.Namespace) -> list[Conversation]:
    """The recording's tasks, tokenized by the model's tokenizer (cached as ``reader bench --replay``)."""
    loaded = load_tokenizer(args.model)
    replay_cache = cache_root() / "replay"
    return load_conversations(args.recording, loaded.tokenizer, loaded.fingerprint, replay_cache)[
        : args.limit
    ]
