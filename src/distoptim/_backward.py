"""The end of a backward pass, as the autograd engine knows it (in DDP's static-graph first iteration no bucket
arrives as ``bucket.is_last()``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd import Variable

__all__ = ["at_end_of_backward", "in_backward"]


def in_backward() -> bool:
    """Whether this thread is running a backward pass (DDP's join hook runs comm hooks outside of any)."""
    return bool(torch._C._current_graph_task_id() != -1)


def at_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the autograd engine has finished the current backward (on its thread)."""
    Variable._execution_engine.queue_callback(callback)
