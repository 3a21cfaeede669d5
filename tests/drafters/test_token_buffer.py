import numpy as np

from reader_spec.drafters.token_buffer import TokenBuffer


def test_appends_grow_the_buffer_and_keep_the_spare_fill_after_the_last_token():
    buffer = TokenBuffer([-1], fill=-1, spare=1)
    expected = [-1]
    for step in range(200):  # past several doublings
        chunk = list(range(step, step + step % 5))
        buffer.extend(chunk)
        expected += chunk
        assert buffer.view().tolist() == expected
        assert len(buffer.buffer) >= len(buffer) + 1 and buffer.buffer[len(buffer)] == -1
    assert buffer.view().dtype == np.int32


def test_a_buffer_starts_from_its_tokens_and_the_view_reads_in_place():
    buffer = TokenBuffer(range(100))
    assert len(buffer) == 100 and buffer.view().tolist() == list(range(100))
    assert np.shares_memory(buffer.view(), buffer.buffer)
    buffer.extend(np.array([7, 8]))
    assert buffer.view()[-2:].tolist() == [7, 8]
