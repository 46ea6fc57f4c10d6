"""Host reads of tensor values: the one door through which distoptim's hot path reads a tensor on the CPU.

On a GPU such a read stalls the CPU until queued kernels have run. The hot path reads only through ``read``, which
counts the reads by reason: a test pins how many a steady-state iteration makes, so none is added unnoticed.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch import Tensor

__all__ = ["READS", "read"]

READS: Counter[str] = Counter()
"""How many host reads each reason has made in this process (instrumentation; tests take differences)."""


def read(tensor: Tensor, why: str) -> Any:
    """``tensor``'s value on the host (a Python number for a 0-d tensor, nested lists otherwise), counted as ``why``."""
    READS[why] += 1
    return tensor.tolist()
