"""The end of a backward pass, as the autograd engine knows it.

DDP's comm hooks are told which bucket DDP thinks comes last (``bucket.is_last()``), but in DDP's static-graph first
iteration every bucket arrives as bucket 0 and none as the last: anything keyed to it is lost or lands a backward
late. A callback queued on the engine runs once the current backward has finished, whatever DDP did (after DDP's own
finalisation when queued from inside it, as in that static-graph iteration).
"""

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
