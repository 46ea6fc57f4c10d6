"""One way for the DDP tests to set up each (reduction, stepping) combination on a DDP model and its ZeRO."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim.hooks import allreduce_hook, hook_with_zero_step, hook_with_zero_step_interleaved, reduce_to_owners_hook

WRAPPERS = {"hook": hook_with_zero_step, "interleaved": hook_with_zero_step_interleaved}


def register(ddp: DDP, zero: Any, reduction: str, stepping: str) -> None:
    """``reduction``: "all_reduce" or "to_owners"; ``stepping``: "explicit" (``zero.step()``), "hook" or
    "interleaved" (the overlap wrappers; ``zero`` must be built with ``overlap_with_ddp=True``)."""
    inner = reduce_to_owners_hook if reduction == "to_owners" else allreduce_hook
    state = zero if reduction == "to_owners" else None
    if stepping != "explicit":  # these tests compare with DDP + a plain optimizer from the first backward
        ddp.register_comm_hook(state, WRAPPERS[stepping](inner, ddp, zero, step_from_first_backward=True))
    elif reduction == "to_owners":
        ddp.register_comm_hook(zero, reduce_to_owners_hook)


def lockstep(
    ddp: DDP, zero: Any, stepping: str, reference_ddp: DDP, plain: torch.optim.Optimizer, x: torch.Tensor, what: str
) -> None:
    """One iteration of DDP + ``zero`` and of DDP + the plain optimizer on one batch; every parameter must agree."""
    zero.zero_grad()
    ddp(x).square().mean().backward()
    if stepping == "explicit":
        zero.step()
    plain.zero_grad()
    reference_ddp(x).square().mean().backward()
    plain.step()
    model: nn.Module = ddp.module
    for index, (param, want) in enumerate(zip(model.parameters(), reference_ddp.module.parameters())):
        label = f"{what} parameter {index}"
        torch.testing.assert_close(param, want, rtol=1e-5, atol=1e-6, msg=lambda m, x=label: f"{x}: {m}")
