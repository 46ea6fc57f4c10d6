"""Loss scaling: ``torch.amp.GradScaler`` drives a ``ZeroRedundancyOptimizer`` through torch's custom-scaling protocol
(``step(grad_scaler=...)``); the step's agreement carries the inf/nan flag (``docs/guides/mixed-precision.md``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from distoptim import _host

__all__ = ["Verdict", "check_and_unscale", "nonfinite", "once_each", "refuse_in_overlap_mode"]


class Verdict:
    """This rank's half of a scaler's verdict (an inf or nan in the gradient it read), to be agreed and recorded;
    ``summed``: whether some rank's owned gradient held one at the backward's end, as every rank knows (or None)."""

    def __init__(
        self, grad_scaler: Any, optimizer: object, flag: Tensor, alike: bool, summed: bool | None, scale: Tensor
    ) -> None:
        self.grad_scaler, self.optimizer, self.flag = grad_scaler, optimizer, flag
        found, below_one = _host.read(torch.stack([flag, (scale < 1).to(flag.dtype)]), "GradScaler's skip decision")
        self.found_here, self.found = bool(found), bool(found) or bool(summed)
        # every rank read the same gradient, or knows what every other found (unscaling by 1 / scale > 1 can make a
        # finite value an inf that only this rank's check sees): steps before agreeing
        self.step_now = (alike or (summed is not None and not below_one)) and not self.found

    def record(self, found_anywhere: bool) -> None:
        """Hand the scaler the agreed verdict, the same on every rank, for ``update()`` to adjust the scale by."""
        self.flag.fill_(float(found_anywhere))
        _scaler_state(self.grad_scaler, self.optimizer)["found_inf_per_device"] = {self.flag.device: self.flag}


def check_and_unscale(
    grad_scaler: Any,
    optimizer: object,
    grads: Callable[[], Sequence[Tensor]],
    sharded_in_memory: bool,
    model_grads: Callable[[], Sequence[Tensor]] = tuple,
    alike: bool = False,
    summed: bool | None = None,
) -> Verdict | None:
    """With a scaler: check ``grads()`` (this rank's, as stepped) for inf/nan and unscale them and ``model_grads()``
    (as torch's step leaves ``.grad``) unless done (local). ``alike``: the verdict reads the whole ``.grad``, the same
    on every rank, or ``summed``: the owned gradients' verdict summed at the backward's end (ranks step at once)."""
    if grad_scaler is None:
        if getattr(optimizer, "found_inf", None) is not None:  # a scaler checked each rank's own (partial) gradients
            raise RuntimeError(
                "this GradScaler did not pass itself to ZeroRedundancyOptimizer.step (grad_scaler=...), so it checked "
                "each rank's own gradients, which under gradient sharding are partial: the ranks could skip different "
                "steps. Use torch.amp.GradScaler's scaler.step(zero) of torch 2.11-2.13, or unscale and skip by hand"
            )
        return None
    unscaled = _scaler_state(grad_scaler, optimizer)["stage"].name == "UNSCALED"
    if unscaled and sharded_in_memory:
        raise RuntimeError(
            "scaler.unscale_(zero) cannot reach a ShardedDataParallel model's gradient (the optimizer holds each "
            "rank's shard of it), so nothing was unscaled: drop it, clip with zero.clip_grad_norm_(max_norm, "
            "grad_scale=scaler.get_scale()) and call scaler.step(zero), which unscales the sharded gradient itself"
        )
    scale: Tensor = grad_scaler._scale
    one = torch.ones((), dtype=torch.float32, device=scale.device)
    inverse = one if unscaled else scale.double().reciprocal().float()
    stepped = [_dense(grad) for grad in grads()]
    held = [] if unscaled and not alike else [_dense(grad) for grad in model_grads()]
    in_held = {_address(grad) for grad in held}
    copies = [grad for grad in stepped if _address(grad) not in in_held]  # fp32 master copies, re-laid pieces
    flags = [_check_and_unscale(copies, inverse, scale), _check_and_unscale(held, inverse, scale)]
    if not alike:  # the verdict reads only what this rank steps
        flags[1] = _check_and_unscale([grad for grad in stepped if _address(grad) in in_held], one, scale)
    return Verdict(grad_scaler, optimizer, torch.stack(flags).amax(), alike, summed, scale)


def nonfinite(grads: Sequence[Tensor | None], device: torch.device) -> Tensor:
    """1 where one of ``grads`` holds an inf or nan, else 0: a 0-d tensor on ``device``, unread (torch's kernel)."""
    one = torch.ones((), dtype=torch.float32, device=device)
    return _check_and_unscale([grad for grad in grads if grad is not None], one, one)


def once_each(wholes: Sequence[Tensor], pieces: Sequence[Tensor]) -> list[Tensor]:
    """Each of ``wholes`` (whole ``.grad`` tensors) once, then each of ``pieces`` that views none of them."""
    wholes = list(dict.fromkeys(wholes))
    inside = {_address(grad) for grad in wholes}
    return [*wholes, *(piece for piece in pieces if _address(piece) not in inside)]


def _dense(grad: Tensor) -> Tensor:
    return grad._values() if grad.is_sparse else grad


def _address(grad: Tensor) -> int:
    """The storage a gradient lives in: a piece that views a ``.grad`` shares it."""
    return _dense(grad).untyped_storage().data_ptr()


def _check_and_unscale(grads: Sequence[Tensor], inverse: Tensor, scale: Tensor) -> Tensor:
    """Multiply ``grads`` by ``inverse`` in place (by kind); 1 where one held an inf or nan, else 0 (on ``scale``'s)."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for grad in grads:
        by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
    flags = [torch.zeros((), dtype=torch.float32, device=scale.device)]
    for (device, _), same_kind in by_kind.items():
        flag = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(same_kind, flag, inverse.to(device))
        flags.append(flag.to(scale.device))
    return torch.stack(flags).amax()


def _scaler_state(grad_scaler: Any, optimizer: object) -> dict[str, Any]:
    try:
        state: dict[str, Any] = grad_scaler._per_optimizer_states[id(optimizer)]
        _ = (state["stage"].name, grad_scaler._scale.device)  # the fields the protocol relies on
    except (AttributeError, KeyError, TypeError) as error:
        raise RuntimeError(
            f"ZeroRedundancyOptimizer.step(grad_scaler=...) expects torch.amp.GradScaler (torch >= 2.11), got "
            f"{type(grad_scaler).__name__} without the state it reads ({error!r}); drive it with scaler.step(zero)"
        ) from error
    return state


def refuse_in_overlap_mode(grad_scaler: Any, optimizer: object) -> None:
    """``overlap_with_ddp`` steps inside the backward, before a scaler could unscale the gradients or skip."""
    if grad_scaler is not None or getattr(optimizer, "found_inf", None) is not None:
        raise RuntimeError(
            "torch.amp.GradScaler cannot drive a ZeroRedundancyOptimizer with overlap_with_ddp=True: its step runs "
            "inside the backward, before the scaler can unscale the gradients or skip the step; build it with "
            "overlap_with_ddp=False (optionally under ShardedDataParallel for ZeRO-2) and call scaler.step(zero)"
        )
