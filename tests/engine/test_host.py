"""A pass's small index tensors are built through numpy, with torch.tensor's result."""

from __future__ import annotations

import numpy as np
import torch

from reader_spec.engine.host import longs


def test_longs_are_what_torch_tensor_makes_of_the_ints():
    for values in ([3, -1, 7], [2**40], np.array([4, 5], dtype=np.int32)):
        made = longs(values)
        assert made.dtype == torch.long and made.device.type == "cpu"
        assert torch.equal(made, torch.tensor(np.asarray(values).tolist()))
    assert longs([]).shape == (0,) and longs([]).dtype == torch.long
    assert longs([1, 2], torch.device("cpu")).tolist() == [1, 2]
