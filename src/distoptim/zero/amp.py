"""Loss scaling: ``torch.amp.GradScaler`` drives a ``ZeroRedundancyOptimizer`` through torch's
``_step_supports_amp_scaling`` protocol.

For such an optimizer ``scaler.step(zero)`` checks the (still scaled) gradients for inf/nan itself, then hands the
optimizer its verdict (``found_inf``) and the scale (``grad_scale``; None once ``scaler.unscale_(zero)`` has
unscaled them already) and calls ``zero.step()``. The step skips on a verdict of inf/nan and otherwise unscales
only what it steps: its owned gradient fragments, upcast into the master dtype first when it keeps master
weights, so fp16 gradients are unscaled in fp32 (torch's own ``unscale_`` refuses fp16 gradients).

Every rank must reach the same verdict, or the ranks' scales drift apart. With gradients all-reduced every rank
checks the same gradients. With ``reduce_to_owners_hook`` a rank holds averaged values only where it owns them;
the hook therefore agrees at the end of each backward on whether any owner saw a non-finite value and, if one did,
makes one visible to every rank (``grad_sharding``), so that the scaler's local check says the same everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["refuse_in_overlap_mode", "unscale_or_skip"]


def unscale_or_skip(optimizer: Any, grads: Sequence[Tensor]) -> bool:
    """Whether to step: False when a ``GradScaler`` found inf/nan; otherwise ``grads`` are unscaled in place."""
    found_inf: Tensor | None = getattr(optimizer, "found_inf", None)
    if found_inf is not None and bool(found_inf.item()):
        return False
    grad_scale: Tensor | None = getattr(optimizer, "grad_scale", None)
    if grad_scale is not None:
        inverse = grad_scale.double().reciprocal().float()  # as GradScaler.unscale_ computes it
        by_device: dict[torch.device, list[Tensor]] = {}
        for grad in grads:
            by_device.setdefault(grad.device, []).append(grad)
        for device, device_grads in by_device.items():
            torch._foreach_mul_(device_grads, inverse.to(device))
    return True


def refuse_in_overlap_mode(optimizer: Any) -> None:
    """``overlap_with_ddp`` steps inside the backward, before a scaler could unscale the gradients or skip."""
    if getattr(optimizer, "found_inf", None) is not None:
        raise RuntimeError(
            "torch.amp.GradScaler cannot drive a ZeroRedundancyOptimizer with overlap_with_ddp=True: its step runs "
            "inside the backward, before the scaler can unscale the gradients or skip the step; build it with "
            "overlap_with_ddp=False (optionally with reduce_to_owners_hook for ZeRO-2) and call scaler.step(zero)"
        )
