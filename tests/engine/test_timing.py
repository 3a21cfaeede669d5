import time

from reader_spec.engine.timing import best_times


def test_rounds_alternate_their_order_after_a_warm_up(monkeypatch):
    order = []
    clock = iter(range(1000))
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    times = best_times([lambda: order.append(1), lambda: order.append(2)], rounds=3)
    assert order == [2, 1, 1, 2, 2, 1, 1, 2]  # warm-up round first, then alternating
    assert times == [1, 1]


def test_each_call_keeps_its_fastest_round(monkeypatch):
    """A burst of load slows some rounds; a call's own cost is its fastest one, not the median."""
    # warm-up (2, 1), then rounds (1, 2), (2, 1), (1, 2), (2, 1):
    # call 1 takes 5, 7, 7, 8 and call 2 takes 1, 6, 6, 6
    durations = iter([9, 9, 5, 1, 6, 7, 7, 6, 6, 8])
    now = [0.0]

    def call():
        now[0] += next(durations)

    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    assert best_times([call, call], rounds=4) == [5, 1]  # the medians would be 7 and 6
