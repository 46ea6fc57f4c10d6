"""Where a ZeroRedundancyOptimizer's parameters live: the partition plan, and everything built from it (the local
shard and its optimizer's param groups, the parameter sync, the overlap stepper), rebuilt when the plan changes.

The plan changes at construction, in ``add_param_group``, when a parameter becomes trainable (gradual unfreezing),
and when ``ShardedDataParallel`` re-cuts an even partition into buckets; the views are rebuilt, with the plan
unchanged, when parameters got new storage (``param.data = ...``, ``model.to(...)`` copying). Parameters that
already have an owner keep it, and their state, even when frozen since (a frozen parameter has no gradient, so its
owner skips it as a plain optimizer would).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from distoptim.zero.buckets import BucketViewSync, StagedSync
from distoptim.zero.layouts import layouts_from_plan
from distoptim.zero.partition import UNOWNED, partition_parameters
from distoptim.zero.shard import LocalShard, complete_hyperparameters

if TYPE_CHECKING:
    from distoptim.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["repartition", "repartition_if_changed", "use_regions"]


def repartition(zero: ZeroRedundancyOptimizer, fresh: bool = False, in_place: bool = False) -> None:
    """Place the parameters that have no owner yet (all of them, ``fresh``) and rebuild what depends on the plan.
    ``in_place``: bucket views move within their buffers (only where no autograd graph can hold views of them)."""
    params = zero.global_params
    zero._trainability = tuple(p.requires_grad for p in params)
    zero._plan = partition_parameters(
        [p.numel() for p in params],
        list(zero._trainability),
        zero.world_size,
        previous=None if fresh else zero._plan,
        mode=zero.partition,
        keys=[(p.device, p.dtype) for p in params],
        region_numel=zero._region_numel,
    )
    zero._unowned = [
        p
        for p, owner, trainable in zip(params, zero._plan.owners, zero._trainability)
        if owner == UNOWNED and not trainable
    ]
    if zero._sync is not None:
        zero._sync.finish()
    layouts = layouts_from_plan(zero._plan.layouts, zero._plan.fragments, params)
    if zero.parameters_as_bucket_view:  # before the shard's views are made: bucket views move the parameters
        within = zero._sync if in_place else None
        zero._sync = BucketViewSync(layouts, zero.process_group, zero.collectives, move_within=within)
    else:
        zero._sync = StagedSync(layouts, zero.process_group, zero.collectives)
    zero._routes.clear()
    previous, zero._shard = zero._shard, LocalShard(zero._plan, zero.param_groups, zero.rank, zero.master_dtype)
    local_groups = zero._shard.param_groups(zero.param_groups)
    if zero.optim is None:
        zero.optim = zero._optimizer_class(local_groups, **zero._defaults)
    else:
        zero._shard.move_state(zero.optim.state, previous)  # kept for every fragment that stays here
        for local_group, group in zip(zero.optim.param_groups, local_groups):
            local_group["params"] = group["params"]
        for new_group in local_groups[len(zero.optim.param_groups) :]:
            zero.optim.add_param_group(new_group)
    complete_hyperparameters(zero.param_groups, zero.optim.param_groups)
    zero._push_hyperparameters()  # the local groups kept their old settings: the global ones are the truth
    if zero.overlap_stepper is not None:
        zero.overlap_stepper.rebuild(zero.optim, zero._shard, zero._plan, params, zero.param_groups)
    zero._bound = _storages(zero)
    for listener in zero._plan_listeners:
        listener()


def repartition_if_changed(zero: ZeroRedundancyOptimizer) -> None:
    """Before a step: gradual unfreezing (a parameter made trainable since the last step gets an owner; detected
    locally, as torch does: every rank must change ``requires_grad`` alike, before the same step, which the step's
    agreement checks), and parameters given new storage since the plan was bound: fragment views and bucket views
    would otherwise step and sync the old memory. Master copies then take the values of parameters written outside
    the optimizer (``model.load_state_dict(...)``), which they would otherwise overwrite with their own."""
    if tuple(p.requires_grad for p in zero.global_params) != zero._trainability or _storages(zero) != zero._bound:
        repartition(zero)
    zero.local_shard.reseed_masters()  # and master copies of parameters written since (a repartition kept them)


def use_regions(zero: ZeroRedundancyOptimizer, region_numel: dict[Hashable, int]) -> None:
    """Cut the even partition into regions of at most ``region_numel[key]`` elements, each split evenly
    (``ShardedDataParallel``'s buckets). Only before the optimizer has state: the fragments change."""
    if region_numel == zero._region_numel or zero.partition != "even":
        return
    if any(zero.local_optimizer.state.values()):
        raise RuntimeError(
            "ShardedDataParallel re-cuts an even partition into buckets, which moves its fragments: wrap the model "
            "before the optimizer has any state (before the first step() and before loading a checkpoint)"
        )
    zero._region_numel = region_numel
    repartition(zero, fresh=True, in_place=True)  # at wrapping, before any forward through the wrapper


def _storages(zero: ZeroRedundancyOptimizer) -> tuple[int, ...]:
    return tuple(p.data_ptr() for p in zero.global_params)
