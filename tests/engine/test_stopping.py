from reader_spec.engine.stopping import StopCriteria

from .conftest import make_tiny_tokenizer

TOKENIZER = make_tiny_tokenizer()


def criteria(max_new=10, eos=(), stops=()):
    return StopCriteria(max_new, frozenset(eos), stops, TOKENIZER)


def test_no_limit_keeps_everything():
    assert criteria().clip([5, 6], [7, 8]) == ([7, 8], None)


def test_length_cuts_at_the_limit():
    assert criteria(max_new=4).clip([5, 6], [7, 8, 9]) == ([7, 8], "length")


def test_eos_is_kept_and_ends():
    assert criteria(eos=(1,)).clip([], [7, 1, 9]) == ([7, 1], "eos")


def test_stop_string_ends_at_the_token_that_completes_it():
    stop = criteria(stops=("w8 w9",))
    assert stop.clip([7], [8, 9, 10]) == ([8, 9], "stop")
    # The stop string may span earlier output and the newly accepted tokens.
    assert stop.clip([7, 8], [9, 10]) == ([9], "stop")
    assert stop.final_text([7, 8, 9]) == "w7 "


def test_final_text_without_stop():
    assert criteria().final_text([7, 1, 8]) == "w7 w8"
