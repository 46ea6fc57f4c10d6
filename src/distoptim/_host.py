"""The one door through which the hot path reads a tensor on the host (on a GPU, a stall): ``read`` counts the
reads by reason, and a test pins how many a steady-state iteration makes."""

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
