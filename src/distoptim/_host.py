"""Host reads of tensor values: the one door through which distoptim's hot path reads a tensor on the CPU.

On a GPU, ``.item()``, ``.tolist()`` or ``bool(tensor)`` blocks the CPU until every kernel queued before it has run,
so the CPU can no longer run ahead of the GPU. The hot path (backward, step, parameter sync) reads a tensor value
only where a feature needs one (a ``GradScaler``'s skip decision, the used-parameter flags of the overlap hooks under
``find_unused_parameters``), and only through ``read``, which counts the reads by reason: a test pins how many a
steady-state iteration makes in each mode, so that a change cannot add a stall unnoticed.
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
