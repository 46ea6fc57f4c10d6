"""Gradient-norm clipping over a sharded gradient: each rank measures what it owns (the owned fragments tile the
trainable parameters once), one scalar collective adds up, and each rank scales its own fragments."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from distoptim import _host
from distoptim.comm import collectives as comm
from distoptim.comm.averaging import group_by_device
from distoptim.zero.amp import once_each

if TYPE_CHECKING:
    from distoptim.zero.shard import LocalShard

__all__ = ["IN_OVERLAP_MODE", "clip_shard"]

IN_OVERLAP_MODE = (
    "ZeroRedundancyOptimizer(overlap_with_ddp=True) cannot clip: its step already ran inside DDP's backward, so "
    "clip_grad_norm_ would clip gradients the step has used and report a norm as if it had worked. Build it with "
    "overlap_with_ddp=False (with ShardedDataParallel for ZeRO-2) to clip"
)


def clip_shard(
    shard: LocalShard,
    whole_params: Sequence[Tensor],
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    group: comm.Group,
    device: torch.device,
    grad_scale: float | Tensor | None,
) -> Tensor:
    """Scale ``shard``'s owned gradient pieces, and every rank's ``.grad`` of ``whole_params`` whole, so that the total
    norm is at most ``max_norm``; returns the total norm (float32, on every rank)."""
    grads = shard.owned_grads()  # first: it may lay a gradient out anew, and the new one is what gets scaled
    wholes = [p.grad for p in whole_params if p.grad is not None]
    scaled = list(dict.fromkeys(wholes)) if shard.source is None else once_each(wholes, grads)  # DDP: pieces view them
    norm_type = float(norm_type)
    op = "max" if norm_type == math.inf else "min" if norm_type == -math.inf else "sum"
    local = _local_term(grads, norm_type, device)
    total = comm.all_reduce_(local, group, op)
    if op == "sum" and norm_type not in (0.0, 1.0):
        total = total.pow(1.0 / norm_type)
    if grad_scale is not None and norm_type != 0.0:  # a norm is homogeneous: |g / s| = |g| / s
        if not isinstance(grad_scale, Tensor):  # a float filled there: no copy from the host
            grad_scale = torch.full((), grad_scale, dtype=torch.float32, device=total.device)
        total = total / grad_scale.to(total.device, torch.float32)
    if error_if_nonfinite and not _host.read(torch.isfinite(total), "clip_grad_norm_(error_if_nonfinite=True)"):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so they cannot be "
            "clipped; pass error_if_nonfinite=False to clip anyway (the step will then see non-finite values)"
        )
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for device_grads in group_by_device(scaled):
        torch._foreach_mul_(device_grads, coefficient.to(device_grads[0].device))
    return total


def _local_term(grads: Sequence[Tensor], norm_type: float, device: torch.device) -> Tensor:
    """This rank's share: ``sum |g|^p`` (``p`` 0 or 1: the plain sum of norms), or the max / min of ``|g|``."""
    if not grads:
        neutral = {math.inf: 0.0, -math.inf: math.inf}.get(norm_type, 0.0)
        return torch.full((), neutral, dtype=torch.float32, device=device)  # filled there: no copy from the host
    norms = torch.stack([_norm(g, norm_type).to(device) for g in grads])
    if math.isinf(norm_type):
        return norms.amax() if norm_type > 0 else norms.amin()
    if norm_type in (0.0, 1.0):
        return norms.sum()
    return norms.pow(norm_type).sum()


def _norm(grad: Tensor, norm_type: float) -> Tensor:
    """``grad``'s norm in float32: accumulated in float32, or for a wider gradient (float64) in its own dtype."""
    wide = grad.dtype.itemsize > 4
    norm: Tensor = torch.linalg.vector_norm(grad, norm_type, dtype=None if wide else torch.float32)
    return norm.float()
