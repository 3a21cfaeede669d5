"""How many tokens per step retrieval could reach on recorded conversations, in hindsight.

At every step of every assistant turn, the ceiling follows the single earlier occurrence of the last
token whose continuation predicts the most of the recording (up to ``--budget`` tokens), then emits
those tokens plus the bonus token, as a replayed step would. Searched: the request's own text, or the
text and every earlier response (as ``reader``'s history holds them). No drafter can choose the
best occurrence in hindsight, so this bounds a single chain drafted from those sources; compare with
``reader bench --replay`` on the same tasks.

    .venv/bin/python scripts/replay_ceiling.py ../shared/data/agentic/deepseek_chat_test_1-100.jsonl.gz
"""

from __future__ import annotations

import numpy as np
from recordings import recorded_tasks, recording_arguments

SEPARATOR = -1
"""Ends each response in the searched history: never a token, so no run crosses it."""


def best_run(text: np.ndarray, recording: np.ndarray, start: int, end: int, budget: int) -> int:
    """Most recorded tokens from ``start`` that follow an occurrence of ``recording[start - 1]``."""
    ends = np.flatnonzero(text[:-1] == recording[start - 1])
    run = 0
    while len(ends) and run < budget and start + run < end:
        after = ends + 1 + run
        ends = ends[(after < len(text)) & (text[np.minimum(after, len(text) - 1)] == recording[start + run])]
        run += bool(len(ends))
    return run


def main() -> None:
    args = recording_arguments(__doc__.split("\n\n")[0]).parse_args()
    conversations = recorded_tasks(args)
    totals = {"text": [0, 0], "text and history": [0, 0]}  # steps, emitted tokens
    history = np.array([SEPARATOR], dtype=np.int64)
    for conversation in conversations:
        tokens = conversation.tokens.astype(np.int64)
        for context_end, end in conversation.turns:
            for name, total in totals.items():
                at = context_end
                while at < end:
                    run = best_run(tokens[:at], tokens, at, end, args.budget)
                    if name == "text and history":
                        searched = np.concatenate([history, tokens[context_end:at]])
                        run = max(run, best_run(searched, tokens, at, end, args.budget))
                    emitted = min(run + 1, end - at)
                    total[0] += 1
                    total[1] += emitted
                    at += emitted
            history = np.concatenate([history, tokens[context_end:end], [SEPARATOR]])
    print(f"{len(conversations)} tasks, budget {args.budget}")
    for name, (steps, emitted) in totals.items():
        print(f"ceiling from the {name}: {emitted / steps:.3f} tokens/step ({steps} steps)")


if __name__ == "__main__":
    main()
