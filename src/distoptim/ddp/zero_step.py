"""Overlap with DDP: the ZeRO step runs inside DDP's backward through a communication hook, at its end or bucket by
bucket. No collective runs from a future's callback (that deadlocks gloo). Details: ``docs/guides/internals.md``."""

# No `from __future__ import annotations`: DDP checks the hooks' annotations against the real classes.
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import GradBucket
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from distoptim import _host
from distoptim._backward import at_end_of_backward, in_backward
from distoptim._flat import view_like
from distoptim._text import few
from distoptim.comm import collectives as comm
from distoptim.ddp.post_local_sgd import averaged_ranks
from distoptim.ddp.reduce_to_owners import check_ddp_group, reduce_to_owners_hook
from distoptim.zero import validation
from distoptim.zero.overlap import buckets_final

if TYPE_CHECKING:
    from distoptim.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["hook_with_zero_step", "hook_with_zero_step_interleaved"]

CommHook = Callable[[Any, GradBucket], Future[Tensor]]


class _UsedFlags:
    """Which of ``params`` some rank has a gradient for: a MAX over DDP's group (not ZeRO's: replicas step alike)."""

    def __init__(self, params: list[Tensor], ddp: DistributedDataParallel) -> None:
        device = comm.comm_device(ddp.process_group, [p.device for p in params])
        self.flags = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device=device)
        self.work = comm.all_reduce_async(self.flags, ddp.process_group, "max")

    def wait(self) -> list[bool]:
        comm.wait_all([self.work])
        return [bool(flag) for flag in _host.read(self.flags, "which parameters some rank used")]


def _finds_unused(ddp: DistributedDataParallel) -> bool:
    return bool(ddp.find_unused_parameters or ddp.static_graph)


@dataclass
class _BucketReduction:
    """One DDP bucket of the current backward: its parameters, its reduction and its used flags, in flight."""

    params: list[Tensor]
    reduced: Future[Tensor]
    used: _UsedFlags | None = None

    def grads(self, used: list[bool] | None = None) -> dict[Tensor, Tensor | None]:
        """The parameters' averaged gradients, None where no rank ``used`` one: as torch.optim, a parameter frozen
        after DDP was built is stepped while it holds a .grad (DDP averages it into the bucket, leaves .grad as is)."""
        reduced = self.reduced.wait()
        used = [True] * len(self.params) if used is None else used
        grads: dict[Tensor, Tensor | None] = {}
        offset = 0
        for param, param_used in zip(self.params, used, strict=True):
            grads[param] = view_like(reduced, offset, param) if param_used else None
            offset += param.numel()
        return grads


def _check_same_parameters(ddp: DistributedDataParallel, zero: "ZeroRedundancyOptimizer") -> None:
    """The hook steps ZeRO's parameters with DDP's gradients: refuse parameters only one side has (never updated)."""
    named = ((name, p) for name, p in ddp.module.named_parameters() if name not in ddp.parameters_to_ignore)
    unheld, not_in_ddp = validation.unmatched_parameters(named, zero)
    if unheld:
        raise ValueError(
            f"the DDP model trains parameters this ZeroRedundancyOptimizer does not hold: {few(unheld)}; the hook "
            "steps only ZeRO's parameters, so these would never be updated. Give ZeRO all of the DDP model's "
            "trainable parameters (ddp.module.parameters()), or wrap only the part ZeRO manages in DDP"
        )
    if not_in_ddp:
        raise ValueError(
            f"this ZeroRedundancyOptimizer holds trainable parameters that are not in the DDP model: "
            f"{few(not_in_ddp)} (or are in its parameters_to_ignore); the hook only sees the gradients DDP reduces, "
            "so these would never be updated. Build ZeRO over the DDP model's parameters (ddp.module.parameters()) "
            "and step any others with another optimizer"
        )


def _check_post_local_group(zero: "ZeroRedundancyOptimizer", state: Any) -> None:
    """Refuse ZeRO sharded over ranks whose gradients a post-local-SGD hook stops averaging after its warm-up."""
    averaged = averaged_ranks(state)
    sharded = dist.get_process_group_ranks(zero.process_group)
    if averaged is None or set(sharded) <= set(averaged):
        return
    raise ValueError(
        f"this ZeroRedundancyOptimizer shards over ranks [{few(sorted(sharded), 8)}], but after its warm-up "
        f"post_localSGD_hook averages this rank's gradients over ranks [{few(sorted(averaged), 8)}] only "
        f"(post_local_gradient_allreduce={state.post_local_gradient_allreduce}): each owner would step its shard "
        "with gradients the rest of ZeRO's group does not share and broadcast it to them, unlike DDP + the hook + the "
        "plain optimizer. Build ZeRO over the hook's subgroup, ZeroRedundancyOptimizer(..., process_group="
        "state.subgroup), with post_local_gradient_allreduce=True, or step a plain optimizer"
    )


class _Backward:
    """An overlap hook's checked stepper and its backward: buckets so far, end scheduled, warm-up (no step) or not."""

    def __init__(
        self,
        hook: CommHook,
        ddp: DistributedDataParallel,
        zero: "ZeroRedundancyOptimizer",
        step_from_first_backward: bool,
    ) -> None:
        if not hasattr(zero, "overlap_stepper"):  # duck-typed: this module does not import the optimizer at run time
            raise TypeError(
                f"zero must be a ZeroRedundancyOptimizer, got {type(zero).__name__}; "
                "the arguments are (hook, ddp, zero)"
            )
        stepper = zero.overlap_stepper
        if stepper is None:
            raise ValueError(
                "this hook steps a ZeroRedundancyOptimizer built with overlap_with_ddp=True; rebuild it with "
                "ZeroRedundancyOptimizer(..., overlap_with_ddp=True) or drop the hook and call zero.step()"
            )
        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"ddp must be a DistributedDataParallel model, got {type(ddp).__name__}")
        _check_same_parameters(ddp, zero)
        validation.refuse_sparse_gradients(
            ddp.module, "the overlap hook", "build the optimizer without overlap_with_ddp and call zero.step()"
        )
        if hook is reduce_to_owners_hook:
            check_ddp_group(zero, ddp)
        stepper.attach_hook(step_from_first_backward)
        self.stepper, self.ddp, self.zero = stepper, ddp, zero
        self.state: Any = None  # the hook's state, as DDP passes it at the first bucket
        self.buckets_final = buckets_final(ddp)
        self.pending: list[_BucketReduction] = []
        self.scheduled = self.checked = self.warmup = False

    def start(self, state: Any, bucket: GradBucket, finish: Callable[[], None]) -> bool:
        """At each bucket; True at a backward's first, which schedules ``finish`` at its end (a joined rank: none)."""
        if not self.checked:
            self.state = state  # registered on another model, the hook would step ZeRO with foreign gradients
            known = set(self.ddp.module.parameters())
            if not all(p in known for p in bucket.parameters()):
                raise ValueError(
                    "this ZeRO overlap hook was built for another DistributedDataParallel model than the one running "
                    "it: build it with the model you register it on, hook_with_zero_step(hook, ddp, zero) then "
                    "ddp.register_comm_hook(state, the_hook) with the same ddp"
                )
            self.checked = True
        if self.scheduled:
            return False
        self.scheduled = True
        self.warmup = self.stepper.begin_backward(self.buckets_final)
        if in_backward():
            at_end_of_backward(finish)
        return True

    def agreed(self, action: Callable[[], None] = lambda: None) -> None:
        """Run ``action`` once the ranks agree (ZeRO's step agreement, after placing): every rank raises if one does,
        as for ZeRO sharded wider than ``post_localSGD_hook`` averages after its warm-up."""

        def checked() -> None:
            _check_post_local_group(self.zero, self.state)  # a post-local-SGD hook's, however wrapped
            action()

        self.zero.agreed_after_placing(checked)

    def end_of_shadow(self, bucket: GradBucket, finish: Callable[[], None]) -> None:
        """A joined rank's end of backward, at DDP's join hook's last bucket (under find_unused: ZeRO's join hook)."""
        if in_backward() or not bucket.is_last():
            return
        if self.ddp.find_unused_parameters:
            self.stepper.defer_finish(finish)
        else:
            finish()

    def end(self) -> list[_BucketReduction] | None:
        """The backward's buckets, at its end (the next backward starts afresh); None for a warm-up one."""
        pending, self.pending, self.scheduled = self.pending, [], False
        if self.warmup:
            self.stepper.skip_step()
            return None
        return pending


def hook_with_zero_step(
    hook: CommHook,
    ddp: DistributedDataParallel,
    zero: "ZeroRedundancyOptimizer",
    shard_buckets: bool = False,
    *,
    step_from_first_backward: bool = False,
) -> CommHook:
    """Wrap ``hook`` so that ZeRO steps inside DDP's backward once every bucket is reduced, and the updated
    parameters are broadcast from their owners (``docs/guides/overlap.md``).

    Args:
        hook: the DDP communication hook averaging a bucket (``allreduce_hook``, or any returning a future of it).
        ddp: the ``DistributedDataParallel`` model whose backward runs the hook.
        zero: a ``ZeroRedundancyOptimizer(..., overlap_with_ddp=True)`` over exactly the DDP model's trainable
            parameters and over DDP's process group.
        shard_buckets: accepted for compatibility with torch (default False); ZeRO's own plan shards.
        step_from_first_backward: step from the first backward (default False: not in torch's warm-up backwards).

    Raises:
        TypeError: ``ddp`` is not a DDP model or ``zero`` not a ZeroRedundancyOptimizer (arguments swapped).
        ValueError: ``zero`` lacks ``overlap_with_ddp``, already has a hook, or holds other parameters than DDP
            trains; at the first backward, if the hook runs on another DDP model than ``ddp``.

    Example:
        ```python
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, overlap_with_ddp=True, lr=1e-3)
        ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
        loss_fn(ddp(batch)).backward()  # steps the optimizer (after the warm-up); zero.step() is optional
        ```
    """
    backward = _Backward(hook, ddp, zero, step_from_first_backward)

    def finish() -> None:
        pending = backward.end()
        if pending is None:
            return
        params = [p for earlier in pending for p in earlier.params]
        used = _UsedFlags(params, ddp).wait() if _finds_unused(ddp) else [True] * len(params)  # one collective
        grads: dict[Tensor, Tensor | None] = {}
        for earlier in pending:
            grads.update(earlier.grads(used[: len(earlier.params)]))
            used = used[len(earlier.params) :]
        backward.agreed(lambda: backward.stepper.step(grads))
        zero.sync_parameters()

    def hook_with_zero_step(state: Any, bucket: GradBucket) -> Future[Tensor]:
        backward.start(state, bucket, finish)
        reduction = _BucketReduction(bucket.parameters(), hook(state, bucket))
        if not backward.warmup:
            backward.pending.append(reduction)
        backward.end_of_shadow(bucket, finish)
        return reduction.reduced

    return hook_with_zero_step


def hook_with_zero_step_interleaved(
    hook: CommHook,
    ddp: DistributedDataParallel,
    zero: "ZeroRedundancyOptimizer",
    shard_buckets: bool = False,
    *,
    step_from_first_backward: bool = False,
) -> CommHook:
    """As :func:`hook_with_zero_step`, but ZeRO steps each bucket once it is reduced and starts broadcasting its
    parameters while later buckets are reduced.

    Args:
        hook: the DDP communication hook that averages a bucket (``allreduce_hook``).
        ddp: the ``DistributedDataParallel`` model whose backward runs the hook.
        zero: a ``ZeroRedundancyOptimizer(..., overlap_with_ddp=True)`` over the DDP model's trainable parameters.
        shard_buckets: accepted for compatibility with torch (default False).
        step_from_first_backward: as in :func:`hook_with_zero_step` (default False: torch's warm-up backwards).

    Raises:
        TypeError: as :func:`hook_with_zero_step`.
        ValueError: as :func:`hook_with_zero_step`.

    Example:
        ```python
        ddp.register_comm_hook(None, hook_with_zero_step_interleaved(allreduce_hook, ddp, zero))
        ```
    """
    backward = _Backward(hook, ddp, zero, step_from_first_backward)
    stepper = backward.stepper
    syncs: list[Any] = []
    direct: list[Any] = []

    def step_and_launch(reduction: _BucketReduction) -> None:
        stepper.step(reduction.grads(None if reduction.used is None else reduction.used.wait()))
        sync = stepper.bucket_sync(reduction.params)
        direct.extend(sync.launch_direct())
        syncs.extend((sync, sync.launch(round_)) for round_ in sync.rounds)

    def finish() -> None:
        pending = backward.end()
        if pending is None:
            return
        for earlier in pending:
            step_and_launch(earlier)
        for sync, flight in syncs:
            sync.land(flight)
        comm.wait_all(direct)
        syncs.clear()
        direct.clear()
        stepper.synced()

    def hook_with_zero_step_interleaved(state: Any, bucket: GradBucket) -> Future[Tensor]:
        if backward.start(state, bucket, finish) and not backward.warmup:  # before any step
            backward.agreed()
        if backward.warmup:
            reduced = hook(state, bucket)
            backward.end_of_shadow(bucket, finish)
            return reduced
        params = bucket.parameters()
        used = _UsedFlags(params, ddp) if _finds_unused(ddp) else None  # read when this bucket is stepped
        reduction = _BucketReduction(params, hook(state, bucket), used)
        for earlier in backward.pending:
            step_and_launch(earlier)
        backward.pending[:] = [reduction]
        backward.end_of_shadow(bucket, finish)
        return reduction.reduced

    return hook_with_zero_step_interleaved
