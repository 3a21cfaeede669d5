"""A pass's small index tensors, built on the host through numpy.

A pass's bookkeeping runs after its weights have swept every cache, where each PyTorch call costs
15-60 us (its code and data evicted) and a numpy one a few: ``torch.tensor`` of 8 ints took 140 us
there, ``torch.from_numpy(numpy.array(...))`` 85 (docs/runner.md, "Session 46").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def longs(values: Sequence[int] | np.ndarray, device: torch.device | None = None) -> torch.Tensor:
    """``torch.tensor(values, device=device)`` for ints: a long tensor, made on the CPU."""
    tensor = torch.from_numpy(np.asarray(values, dtype=np.int64))
    return tensor if device is None or device.type == "cpu" else tensor.to(device)
