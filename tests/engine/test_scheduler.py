"""Which row a request takes: the one whose held prefix saves it the most, never the prompt's root."""

from __future__ import annotations

import pytest

from reader_spec.config import GenerationConfig
from reader_spec.engine.scheduler import Request, Scheduler, common_prefix
from reader_spec.engine.sequence import DecodingSequence, RequestStats


def request(key: int, tokens: list[int]) -> Request:
    return Request(key, key, tokens, GenerationConfig())


def run_and_finish(scheduler: Scheduler, key: int, tokens: list[int], held: list[int]) -> int:
    """Admit a request alone, then finish it holding ``held``; returns its row."""
    scheduler.add(request(key, tokens))
    (admission,) = scheduler.admit()
    row, prompt_length = admission.row, len(tokens)
    seq = DecodingSequence(key, key, row, list(tokens), prompt_length, None, None, RequestStats(), 0.0)
    scheduler.start(seq)
    scheduler.finish(seq, held)
    return admission.row


@pytest.mark.parametrize(
    ("a", "b", "shared"),
    [([], [1], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2), ([5, 2], [1, 2], 0),
     (list(range(1000)), [*range(617), -1], 617)],
)  # fmt: skip
def test_common_prefix(a, b, shared):
    assert common_prefix(a, b) == shared == common_prefix(b, a)


def test_a_request_takes_the_row_holding_its_prefix_but_never_its_root():
    scheduler = Scheduler(3)
    first = run_and_finish(scheduler, 0, [1, 2, 3], held=[1, 2, 3, 4, 5])
    other = run_and_finish(scheduler, 1, [9, 9], held=[9, 9, 8])
    assert first != other
    scheduler.add(request(2, [1, 2, 3, 4, 5, 6, 7]))
    scheduler.add(request(3, [9, 9, 8]))  # the whole held text: its last token is the first root
    admitted = scheduler.admit()
    assert [(a.row, a.reused) for a in admitted] == [(first, 5), (other, 2)]
    assert scheduler.held == {}


def test_a_request_sharing_only_a_rows_beginning_gets_it_copied_into_an_empty_row():
    """Another question about the same document: the conversation's row stays for its next turn."""
    scheduler = Scheduler(2)
    held = run_and_finish(scheduler, 0, [7, 7, 1], held=[7, 7, 1, *range(20, 40)])
    scheduler.add(request(1, [7, 7, 1, 2, 3]))
    (admission,) = scheduler.admit()
    assert admission.row != held and (admission.reused, admission.source) == (3, held)
    assert list(scheduler.held) == [held]
    scheduler.add(request(2, [7, 7, 5, 6]))
    (admission,) = scheduler.admit()  # no empty row left: the held row goes, its shared prefix serves
    assert (admission.row, admission.reused, admission.source) == (held, 2, None)


def test_without_a_shared_prefix_an_empty_row_then_the_one_freed_longest_ago():
    scheduler = Scheduler(3)
    older = run_and_finish(scheduler, 0, [1], held=list(range(100, 140)))
    newer = run_and_finish(scheduler, 1, [2], held=list(range(200, 205)))
    scheduler.add(request(2, [3, 3, 3]))
    scheduler.add(request(3, [4, 4, 4]))
    scheduler.add(request(4, [5, 5, 5]))
    rows = [(a.row, a.reused, a.source) for a in scheduler.admit()]
    assert rows == [(2, 0, None), (older, 0, None), (newer, 0, None)]


def test_a_request_copies_the_prompt_of_a_running_or_starting_request():
    """The choices of one request, or clients sharing a system prompt: a prompt is prefilled once."""
    scheduler = Scheduler(5)
    prompt = [5, 6, 7, 8, 9]
    for key in range(3):
        scheduler.add(request(key, prompt))
    first, second, third = scheduler.admit()
    assert (first.reused, first.source) == (0, None)
    assert [(a.reused, a.source) for a in (second, third)] == [(4, first.row)] * 2
    for admission in (first, second, third):
        key = admission.request.key
        scheduler.start(
            DecodingSequence(key, key, admission.row, [*prompt, 1, 2], 5, None, None, RequestStats(), 0.0)
        )
    scheduler.add(request(3, [5, 6, 7, 1]))  # its answer's tokens are not the running rows' prompt
    scheduler.add(request(4, [1, 2]))
    fourth, fifth = scheduler.admit()
    assert (fourth.reused, fourth.source) == (3, first.row)
    assert (fifth.reused, fifth.source) == (0, None)
    off = Scheduler(2, reuse_prefixes=False)
    off.add(request(0, prompt))
    off.add(request(1, prompt))
    assert [(a.reused, a.source) for a in off.admit()] == [(0, None)] * 2


def test_nothing_is_held_without_reuse_after_forgetting_or_for_a_cancelled_request():
    off = Scheduler(1, reuse_prefixes=False)
    run_and_finish(off, 0, [1, 2], held=[1, 2])
    assert off.held == {}
    scheduler = Scheduler(1)
    run_and_finish(scheduler, 0, [1, 2], held=[1, 2])
    scheduler.forget_prefixes()
    scheduler.add(request(1, [1, 2, 3]))
    assert scheduler.admit()[0].reused == 0
    scheduler.start(DecodingSequence(1, 1, 0, [1, 2, 3], 3, None, None, RequestStats(), 0.0))
    scheduler.cancel(1)
    assert scheduler.held == {} and scheduler.free_rows == [0]
