"""Overlap with DDP: the ZeRO step runs inside DDP's backward, through a DDP communication hook.

``hook_with_zero_step`` steps every owned parameter once the last bucket is reduced, then syncs;
``hook_with_zero_step_interleaved`` steps (and starts syncing) each bucket's owned parameters while the next bucket
is being reduced. Both work from the first backward: ownership comes from ZeRO's own partition plan, never from
DDP's buckets, so DDP rebuilding its buckets after the first iteration changes nothing.

Everything runs on the thread that calls the hooks (no collective is issued from a future's callback, which is
what deadlocks gloo); a hook returns an already completed future for the buckets it waited on.
"""

# No `from __future__ import annotations`: DDP checks the hooks' annotations against the real classes.
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import Tensor
from torch._C._distributed_c10d import GradBucket
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from distoptim.functional import FunctionalOptimizer
from distoptim.zero import comm
from distoptim.zero.buckets import StagedSync, build_layouts

if TYPE_CHECKING:
    from distoptim.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["OverlapStepper", "hook_with_zero_step", "hook_with_zero_step_interleaved"]

CommHook = Callable[[Any, GradBucket], Future[Tensor]]


class OverlapStepper:
    """The overlap-mode step of one ZeroRedundancyOptimizer: functional optimizers over the local param groups.

    They share the local ``torch.optim`` optimizer's ``state`` (so consolidation and loading work unchanged) and
    read the global ``param_groups`` at every step (so schedulers work).
    """

    def __init__(self, zero: "ZeroRedundancyOptimizer", functional_cls: type[FunctionalOptimizer]) -> None:
        self.zero = zero
        self.functional_cls = functional_cls
        self.functionals: list[FunctionalOptimizer] = []
        self.hooked = False
        self.stepped = False
        self._grad_seen: tuple[int, int] | None = None
        self._bucket_syncs: dict[tuple[int, ...], StagedSync] = {}
        self._group_of: dict[int, int] = {}  # owned parameter id -> index of its local group

    def rebuild(self) -> None:
        """(Re)create one functional optimizer per local param group (after construction or add_param_group)."""
        local_groups = self.zero.local_optimizer.param_groups
        for group in local_groups[len(self.functionals) :]:
            options = {k: v for k, v in group.items() if k in self.functional_cls.spec.defaults}
            self.functionals.append(self.functional_cls(group["params"], **options, _allow_empty_param_list=True))
        self._group_of = {id(p): index for index, f in enumerate(self.functionals) for p in f.param_group["params"]}
        self._bucket_syncs.clear()

    def step(self, grads: dict[int, Tensor]) -> None:
        """Step the owned parameters whose id is in ``grads`` with those gradients."""
        state = self.zero.local_optimizer.state
        for index in sorted({self._group_of[key] for key in grads if key in self._group_of}):
            functional, group = self.functionals[index], self.zero.param_groups[index]
            functional.state = state  # load_state_dict may have replaced the local optimizer's state
            functional.param_group.update((k, group[k]) for k in functional.defaults if k in group)
            functional.step([grads.get(id(p)) for p in functional.param_group["params"]])
        self.stepped = True

    def bucket_sync(self, params: list[Tensor]) -> StagedSync:
        """The staged broadcast of one DDP bucket's trainable parameters from their owners (cached per bucket)."""
        key = tuple(map(id, params))
        if key not in self._bucket_syncs:
            owners = {id(p): o for p, o in zip(self.zero._params, self.zero.plan.owners)}
            by_rank = [[p for p in params if owners[id(p)] == r] for r in range(self.zero.world_size)]
            stage_bytes = sum(p.numel() * p.element_size() for p in params)
            self._bucket_syncs[key] = StagedSync(build_layouts(by_rank), self.zero.process_group, stage_bytes)
        return self._bucket_syncs[key]

    def check_stepped(self) -> None:
        """Called by ``zero_grad``: gradients arrived since the last call but no hook stepped -> say so."""
        seen = self._grad_marker()
        if seen is not None and seen != self._grad_seen and not self.stepped:
            raise RuntimeError(
                "ZeroRedundancyOptimizer(overlap_with_ddp=True) has gradients but no optimizer step ran: register "
                "hook_with_zero_step(allreduce_hook, ddp, zero) (or the interleaved one) with "
                "ddp.register_comm_hook(None, ...) so that DDP's backward steps the optimizer"
            )
        self.stepped = False

    def record_grads(self) -> None:
        self._grad_seen = self._grad_marker()

    def _grad_marker(self) -> tuple[int, int] | None:
        """Identity and version of one trainable parameter's gradient: changes whenever a backward wrote it."""
        grad = next((p.grad for p in self.zero._params if p.requires_grad), None)
        return None if grad is None else (id(grad), grad._version)


@dataclass
class _Pending:
    """Buckets of the current backward whose reduction started but whose step has not run yet."""

    buckets: list[tuple[list[Tensor], Future[Tensor]]] = field(default_factory=list)
    syncs: list[Any] = field(default_factory=list)
    direct: list[Any] = field(default_factory=list)


def _reduced_grads(bucket_params: list[Tensor], reduced: Tensor) -> dict[int, Tensor]:
    """Views of a reduced bucket tensor for the parameters that require grad, keyed by parameter id.

    Offsets count every parameter of the bucket: one frozen after DDP was built keeps its slot in the buffer.
    """
    grads, offset = {}, 0
    for param in bucket_params:
        if param.requires_grad:
            grads[id(param)] = reduced[offset : offset + param.numel()].view_as(param)
        offset += param.numel()
    return grads


def _checked_stepper(ddp: DistributedDataParallel, zero: "ZeroRedundancyOptimizer") -> OverlapStepper:
    stepper = zero.overlap_stepper
    if stepper is None:
        raise ValueError(
            "this hook steps a ZeroRedundancyOptimizer built with overlap_with_ddp=True; rebuild it with "
            "ZeroRedundancyOptimizer(..., overlap_with_ddp=True) or drop the hook and call zero.step()"
        )
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"ddp must be a DistributedDataParallel model, got {type(ddp).__name__}")
    if stepper.hooked:
        raise ValueError("a ZeRO overlap hook is already registered for this ZeroRedundancyOptimizer")
    stepper.hooked = True
    return stepper


def hook_with_zero_step(
    hook: CommHook, ddp: DistributedDataParallel, zero: "ZeroRedundancyOptimizer", shard_buckets: bool = False
) -> CommHook:
    """Wrap ``hook`` so that once the last bucket is reduced, ZeRO steps its shard and syncs all parameters.

    ``shard_buckets`` is accepted for compatibility: parameters are always sharded by ZeRO's own plan.
    """
    stepper = _checked_stepper(ddp, zero)
    pending = _Pending()

    def hook_with_zero_step(state: Any, bucket: GradBucket) -> Future[Tensor]:
        params = bucket.parameters()
        future = hook(state, bucket)
        pending.buckets.append((params, future))
        if not bucket.is_last():
            return future
        grads: dict[int, Tensor] = {}
        for bucket_params, bucket_future in pending.buckets:
            grads.update(_reduced_grads(bucket_params, bucket_future.wait()))
        pending.buckets.clear()
        stepper.step(grads)
        zero._sync_parameters()
        return future

    return hook_with_zero_step


def hook_with_zero_step_interleaved(
    hook: CommHook, ddp: DistributedDataParallel, zero: "ZeroRedundancyOptimizer", shard_buckets: bool = False
) -> CommHook:
    """Wrap ``hook`` so that each bucket's owned parameters are stepped, and their sync started, as soon as that
    bucket is reduced (checked when the next bucket arrives), overlapping with the remaining reductions.

    ``shard_buckets`` is accepted for compatibility: parameters are always sharded by ZeRO's own plan.
    """
    stepper = _checked_stepper(ddp, zero)
    pending = _Pending()

    def step_and_launch(params: list[Tensor], future: Future[Tensor]) -> None:
        stepper.step(_reduced_grads(params, future.wait()))
        sync = stepper.bucket_sync([p for p in params if p.requires_grad])
        pending.direct.extend(sync.launch_direct())
        pending.syncs.extend((sync, sync.launch(round_)) for round_ in sync.rounds)

    def hook_with_zero_step_interleaved(state: Any, bucket: GradBucket) -> Future[Tensor]:
        params = bucket.parameters()
        future = hook(state, bucket)
        for earlier in pending.buckets:
            step_and_launch(*earlier)
        pending.buckets[:] = [(params, future)]
        if bucket.is_last():
            step_and_launch(params, future)
            pending.buckets.clear()
            for sync, flight in pending.syncs:
                sync.land(flight)
            comm.wait_all(pending.direct)
            pending.syncs.clear()
            pending.direct.clear()
        return future

    return hook_with_zero_step_interleaved
