"""A pass's small index tensors, built on the host through numpy.

A pass's bookkeeping runs after its weights have swept every cache, where each PyTorch call costs
many times a numpy one (its code and data evicted), and building a tensor through numpy beats
``torch.tensor`` (docs/runner.md, "the host's bookkeeping around a pass and a step, cut further").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def longs(values: Sequence[int] | np.ndarray, device: torch.device | None = None) -> torch.Tensor:
    """``torch.tensor(values, device=device)`` for ints: a long tensor, made on the CPU."""
    tensor = torch.from_numpy(np.asarray(values, dtype=np.int64))
    return tensor if device is None or device.type == "cpu" else tensor.to(device)
