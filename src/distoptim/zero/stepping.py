"""The pieces of a ZeroRedundancyOptimizer's ``step()``: the agreement around its local part, the local step, and
the interface of a gradient source the step reads instead of ``.grad`` (``docs/guides/internals.md``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from distoptim.comm import agreement
from distoptim.zero import amp
from distoptim.zero.buckets import ParameterSync
from distoptim.zero.local_optimizer import CompositeOptimizer
from distoptim.zero.shard import LocalShard, LocalTensor

__all__ = ["GradientSource", "Prepared", "agreed", "agreed_step", "step_local_optimizer"]

_T = TypeVar("_T")
Prepared = tuple[float | None, amp.Verdict | None]  # a step's loss, and its GradScaler verdict if any
Fingerprint = Callable[[], agreement.Fingerprint]  # what every rank must step with alike

JOIN_WITH_SCALER = (
    "a rank has joined (Join, uneven inputs) while the others step under a torch.amp.GradScaler: the joined rank "
    "would step its shard with its .grad as it stands, which no scaler unscaled or checked for inf/nan. Give every "
    "rank the same number of batches (DistributedSampler(drop_last=True)), or step without the GradScaler under Join"
)
DIVERGED_UNDER_SCALER = (
    "the ranks' .grad differ under torch.amp.GradScaler: a rank found an inf or nan in its .grad and skipped the step "
    "while another found none and stepped its shard, so the ranks' optimizer states now differ (resume from a "
    "checkpoint). Without ShardedDataParallel each rank decides on its whole .grad, which must be the same on every "
    "rank of the optimizer's group (DDP's average): gradients reduced to their owners by hand, or left local "
    "(post-local SGD without its all-reduce, .grad changed on some ranks), are not; average them on every rank, or "
    "use ShardedDataParallel, whose ranks share the verdict before any rank steps (there: a .grad set by hand after "
    "the backward, on some ranks only, held one; set it alike on every rank)"
)
MIXED_SCALER = (
    "some ranks stepped with scaler.step(zero) and others with zero.step() (no GradScaler): the ranks would skip "
    "different steps and step on differently scaled gradients. Call scaler.step(zero) on every rank or on none"
)


class GradientSource(Protocol):
    """The gradient's one owner (``ShardedDataParallel``'s store), read by the step and clipping, not ``.grad``."""

    sync: ParameterSync  # the parameter sync the optimizer runs after each step
    replanned: Callable[[], None]  # called after each re-placement
    used: list[bool]  # which parameters this rank gave a gradient since the ranks last agreed

    def grad_of(self, local: LocalTensor) -> Tensor | None: ...  # local's piece of its parameter's gradient, or None
    def check_finished(self) -> None: ...  # refuse a gradient a backward that raised midway left (local)
    def prepare_step(self) -> bool: ...  # before the step reads (agreed): may this rank step before the ranks agree
    def overflow_found(self, scaled: bool) -> bool | None: ...  # an inf/nan in some rank's owned gradient, or None
    def agreed(self, everywhere: Sequence[bool], *, scaled: bool) -> None: ...  # the step's agreement: which were used
    def ready(self) -> None: ...  # before clip_grad_norm_ reads (collective): the same, agreed alone after a backward
    def hand_set(self) -> list[Tensor]: ...  # the parameters whose .grad was set by hand (not the store's marker)
    def clear(self, set_to_none: bool) -> None: ...  # zero_grad


def agreed_step(
    action: Callable[[], Prepared],
    fingerprint: Fingerprint,
    groups: Sequence[dist.ProcessGroup],
    joined_step: Callable[[], object] | None = None,
    extra: Callable[[Prepared | None], Sequence[bool]] = lambda done: (),
    scaler: bool = False,
) -> tuple[Prepared, bool, bool, tuple[bool, ...]]:
    """``action()`` agreed over ``groups`` (and a joined rank's ``joined_step``); then whether a GradScaler's step waits
    for the agreed verdict, whether any rank found an inf or nan, and for each of ``extra(prepared)`` whether any rank
    raised it. A rank that stepped where another found an inf raises everywhere (``docs/guides/internals.md``)."""
    joined = joined_step is not None
    flags = lambda done: (*_flags(done), joined, scaler, not scaler and not joined, *extra(done))
    prepared, (found_inf, stepped, waited, any_joined, with_scaler, without, *extras) = agreement.run_step_agreed(
        action, fingerprint, list(groups), flags=flags, joined=joined
    )
    if with_scaler and without:
        raise RuntimeError(MIXED_SCALER)
    if found_inf and stepped:
        raise RuntimeError(DIVERGED_UNDER_SCALER)
    if any_joined:
        if with_scaler:
            raise RuntimeError(JOIN_WITH_SCALER)
        agreed(joined_step or (lambda: None), fingerprint, groups, joined)
    return prepared, with_scaler and waited, found_inf, tuple(extras)


def _flags(done: Prepared | None) -> tuple[bool, bool, bool]:
    """Whether this rank found an inf or nan, stepped on its own verdict, and waits for the agreed one."""
    verdict = None if done is None else done[1]
    return (False, False, False) if verdict is None else (verdict.found, verdict.step_now, not verdict.step_now)


def agreed(
    action: Callable[[], _T], fingerprint: Fingerprint, groups: Sequence[dist.ProcessGroup], joined: bool = False
) -> _T:
    """``action()`` on this rank, then the step's agreement (collective)."""
    return agreement.run_step_agreed(action, fingerprint, list(groups), joined=joined)[0]


def step_local_optimizer(
    optim: Optimizer, shard: LocalShard, shown_groups: Sequence[dict[str, Any]], kwargs: dict[str, Any]
) -> None:
    """The local optimizer's step (the closure ran before it) and the master copies' write-back; what it sets in its
    groups goes to the global ones. From its start the shard is unsynced, even where it raised (midway, say)."""
    before = [dict(group) for group in optim.param_groups]
    if kwargs:  # a keyword the step does not take raises before any update: no mark
        _check_keywords(optim, kwargs)
    try:
        optim.step(**kwargs)  # as torch's ZeroRedundancyOptimizer calls it without a closure (a step() may take none)
    finally:  # not to be retried, until the sync (LocalShard.check_synced)
        shard.unsynced = True
    shard.write_back()
    for saved, group, shown in zip(before, optim.param_groups, shown_groups):  # what the step itself set
        shown.update((k, v) for k, v in group.items() if k != "params" and (k not in saved or saved[k] is not v))


def _check_keywords(optim: Optimizer, kwargs: dict[str, Any]) -> None:
    """Raise what ``optim.step`` (each part's, for a composite) would on keywords it does not take."""
    for part in optim.parts.values() if isinstance(optim, CompositeOptimizer) else [optim]:
        try:
            signature = inspect.signature(part.step)
        except (TypeError, ValueError):  # none to read: the step itself says
            continue
        signature.bind(**kwargs)
