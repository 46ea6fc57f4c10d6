"""A ZeroRedundancyOptimizer's ``step()``: the local part on every rank, agreed, then the parameter sync.

Before the sync the ranks agree (one small all-reduce on the control plane) that the local part succeeded
everywhere, with the same parameters trainable and the same hyperparameters: if it raised on one rank, or a setting
was changed on one rank only, every rank raises instead of waiting in the sync or stepping with other settings.
Under a ``torch.amp.GradScaler`` the same agreement carries each rank's inf/nan flag, and the local optimizer steps
after it (agreed once more) only when no rank found one: every rank skips the same steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from distoptim import _agreement as agreement
from distoptim.zero import amp, validation

if TYPE_CHECKING:
    from distoptim.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["agreed", "agreed_step", "step"]

_T = TypeVar("_T")
Prepared = tuple[float | None, amp.Verdict | None]  # a step's loss, and its GradScaler verdict if any


def step(
    zero: ZeroRedundancyOptimizer, closure: Callable[[], float] | None, grad_scaler: Any, kwargs: dict[str, Any]
) -> float | None:
    """``zero.step()`` outside the overlap mode (collective)."""
    zero.sync_finished()
    try:
        (loss, verdict), scaled, found_inf = agreed_step(
            zero, lambda: _prepare_and_step(zero, closure, kwargs, grad_scaler)
        )
        if verdict is not None:
            verdict.record(found_inf)
        if scaled and not found_inf:  # a GradScaler's step, and no rank's owned gradient held an inf or nan
            agreed(zero, lambda: None if verdict is None else _step_local_optimizer(zero, None, kwargs))
    finally:
        zero.local_shard.detach_grads()  # no stale gradient piece outlives the step
    zero._pull_hyperparameters()
    zero.sync_parameters()
    zero._consolidated = None
    return loss


def agreed_step(zero: ZeroRedundancyOptimizer, action: Callable[[], Prepared]) -> tuple[Prepared, bool, bool]:
    """``action()`` (the local part, or nothing on a joined rank), agreed; then whether any rank steps under a
    GradScaler, and whether any of those found an inf or nan (every rank then skips)."""
    prepared, (scaled, found_inf) = agreement.run_step_agreed(
        action,
        lambda: fingerprint(zero),
        zero.agreement_groups,
        flags=lambda done: (False, False) if done is None or done[1] is None else (True, done[1].found_here),
    )
    return prepared, scaled, found_inf


def agreed(zero: ZeroRedundancyOptimizer, action: Callable[[], _T]) -> _T:
    """``action()`` on this rank, then the step's agreement (collective; a joined rank agrees on doing nothing)."""
    return agreement.run_step_agreed(action, lambda: fingerprint(zero), zero.agreement_groups)[0]


def fingerprint(zero: ZeroRedundancyOptimizer) -> agreement.Fingerprint:
    """What every rank must step with alike: which parameters are trainable, and every hyperparameter."""
    return validation.step_fingerprint(zero._trainability, zero.param_groups)


def _prepare_and_step(
    zero: ZeroRedundancyOptimizer, closure: Callable[[], float] | None, kwargs: dict[str, Any], grad_scaler: Any
) -> Prepared:
    """Everything a step does locally; with a ``grad_scaler``, everything but the local optimizer's step, which
    waits for the ranks' verdict on inf/nan."""
    zero._accumulation.check()  # inside the agreement: every rank raises if one does
    zero._repartition_if_changed()
    loss: float | None = None
    shard = zero.local_shard
    # torch.optim's order, the closure's backward first, wherever the step does not read the parameters' own .grad
    # (pieces and master copies take .grad when attached; ShardedDataParallel's owned gradient is attached likewise)
    if closure is not None and (shard.detached or shard.source is not None):
        with torch.enable_grad():
            loss, closure = closure(), None
    validation.check_unowned_have_no_grad(zero._unowned)
    zero._push_hyperparameters()
    zero.local_shard.attach_grads()
    sharded_in_memory = zero._gradient_store is not None
    verdict = amp.check_and_unscale(grad_scaler, zero, zero.local_shard.step_grads, sharded_in_memory)
    if verdict is None:
        local_loss = _step_local_optimizer(zero, closure, kwargs)
        loss = loss if closure is None else local_loss
    return loss, verdict


def _step_local_optimizer(
    zero: ZeroRedundancyOptimizer, closure: Callable[[], float] | None, kwargs: dict[str, Any]
) -> float | None:
    loss: float | None = zero.local_optimizer.step(closure, **kwargs)
    zero.local_shard.write_back()
    return loss
