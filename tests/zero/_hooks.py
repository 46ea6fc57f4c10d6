"""One way for the DDP tests to set up each (reduction, stepping) combination on a DDP model and its ZeRO."""

from __future__ import annotations

from typing import Any

from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim.hooks import allreduce_hook, hook_with_zero_step, hook_with_zero_step_interleaved, reduce_to_owners_hook

WRAPPERS = {"hook": hook_with_zero_step, "interleaved": hook_with_zero_step_interleaved}


def register(ddp: DDP, zero: Any, reduction: str, stepping: str) -> None:
    """``reduction``: "all_reduce" or "to_owners"; ``stepping``: "explicit" (``zero.step()``), "hook" or
    "interleaved" (the overlap wrappers; ``zero`` must be built with ``overlap_with_ddp=True``)."""
    inner = reduce_to_owners_hook if reduction == "to_owners" else allreduce_hook
    state = zero if reduction == "to_owners" else None
    if stepping != "explicit":
        ddp.register_comm_hook(state, WRAPPERS[stepping](inner, ddp, zero))
    elif reduction == "to_owners":
        ddp.register_comm_hook(zero, reduce_to_owners_hook)
