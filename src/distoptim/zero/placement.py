"""Where a ZeroRedundancyOptimizer's parameters live: the partition plan and what is built from it (the local shard,
its optimizer, the parameter sync). Parameters that have an owner keep it, and their state, even when frozen since."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from distoptim.comm import collectives as comm
from distoptim.zero.buckets import BucketViewSync, ParameterSync, StagedSync
from distoptim.zero.layouts import layouts_from_plan
from distoptim.zero.local_optimizer import CompositeOptimizer, build_local_optimizer, kind_of, whole_tensor_weights
from distoptim.zero.partition import UNOWNED, PartitionPlan, partition_parameters
from distoptim.zero.shard import LocalShard, slice_entry
from distoptim.zero.state_formats import StateFormats, block_sizes, needs_formats

__all__ = ["Placement", "PlacementSettings", "bind_local_optimizer", "install_kept", "is_stale", "place"]

Signature = tuple[bool, int, torch.Size, tuple[int, ...]]  # requires_grad, storage, shape, strides


@dataclass(frozen=True)
class PlacementSettings:
    """What a placement depends on besides the parameters, fixed at construction."""

    group: comm.Group
    rank: int
    world_size: int
    partition: str
    master_dtype: torch.dtype | None
    bucket_view: bool
    collectives: comm.Collectives


@dataclass(frozen=True)
class Placement:
    """A plan, what is built from it, and each parameter's ``Signature`` when made (to tell when it is stale)."""

    plan: PartitionPlan
    shard: LocalShard
    sync: ParameterSync
    trainable: tuple[int, ...]  # the indices of the parameters that required grad when placed
    unowned: list[Tensor]  # frozen parameters nobody owns: a gradient on one is refused
    keys: tuple[tuple[torch.device, torch.dtype], ...]  # each parameter's layout key when placed
    signature: list[Signature]  # each parameter's (requires_grad, storage, shape, strides) when placed
    index: dict[int, int]  # each parameter's global index, by id


def place(
    params: Sequence[Tensor],
    param_groups: Sequence[dict[str, Any]],
    settings: PlacementSettings,
    optimizer_class: type[Optimizer],
    *,
    previous: PartitionPlan | None,
    region_numel: Mapping[Hashable, int] | None,
    moving_within: ParameterSync | None = None,
) -> Placement:
    """Place the parameters ``previous`` has no owner for and build the shard and the sync (``moving_within``: bucket
    views move within that sync's buffers). The caller finishes any sync in flight first."""
    trainability = tuple(p.requires_grad for p in params)
    keys = tuple((p.device, p.dtype) for p in params)
    whole, costs = whole_tensor_weights(param_groups, optimizer_class)
    plan = partition_parameters(
        [p.numel() for p in params],
        list(trainability),
        settings.world_size,
        previous=previous,
        mode=settings.partition,
        keys=keys,
        region_numel=region_numel,
        whole=whole,
        costs=costs,
        align=block_sizes(param_groups),
    )
    unowned = [
        p for p, owner, trainable in zip(params, plan.owners, trainability) if owner == UNOWNED and not trainable
    ]
    layouts = layouts_from_plan(plan.layouts, plan.fragments, params)
    sync: ParameterSync
    if settings.bucket_view:  # before the shard's views are made: bucket views move the parameters
        sync = BucketViewSync(layouts, settings.group, settings.collectives, move_within=moving_within)
    else:
        sync = StagedSync(layouts, settings.group, settings.collectives)
    shard = LocalShard(plan, param_groups, settings.rank, settings.master_dtype)
    index = {id(p): i for i, p in enumerate(params)}
    trainable = tuple(i for i, flag in enumerate(trainability) if flag)
    return Placement(plan, shard, sync, trainable, unowned, keys, _signature(params), index)


def bind_local_optimizer(
    optim: Optimizer | None,
    optimizer_class: type[Optimizer],
    defaults: dict[str, Any],
    shard: LocalShard,
    previous_shard: LocalShard | None,
    param_groups: Sequence[dict[str, Any]],
) -> Optimizer:
    """The local optimizer over ``shard``: a new one, or ``optim`` given the new shard's tensors (its state kept for
    every fragment that stays; a composite where groups differ in kind), stepping through the formats if any."""
    local_groups = shard.param_groups(param_groups)
    if optim is None:
        optim = build_local_optimizer(local_groups, optimizer_class, defaults)
    else:
        shard.move_state(optim.state, previous_shard)
        kinds = {kind_of(group, optimizer_class) for group in local_groups}
        if (len(kinds) > 1 or needs_formats(local_groups)) and not isinstance(optim, CompositeOptimizer):
            composite = build_local_optimizer(local_groups, optimizer_class, defaults)
            for old, new in zip(optim.param_groups, composite.param_groups):  # settings the old groups hold
                new.update((k, v) for k, v in old.items() if k != "params")
            composite.state.update(optim.state)
            optim = composite
        else:
            for local_group, group in zip(optim.param_groups, local_groups):
                local_group["params"] = group["params"]
            for new_group in local_groups[len(optim.param_groups) :]:
                optim.add_param_group(new_group)
    if isinstance(optim, CompositeOptimizer) and needs_formats(param_groups):
        optim.formats = StateFormats(shard, param_groups)  # construction's state: encoded at a first step
    return optim


def is_stale(placement: Placement, params: Sequence[Tensor]) -> bool:
    """Whether ``placement`` must be made again: a parameter made trainable, given new storage, shape or strides."""
    return _signature(params) != placement.signature


def layout_change(placement: Placement, params: Sequence[Tensor]) -> str | None:
    """What changed since ``placement`` was made that its pieces cannot follow (ranges in the old memory order), or
    None: a dtype or device, or the shape or memory order of a parameter some rank owns."""
    retyped = [i for i, (p, key) in enumerate(zip(params, placement.keys)) if (p.device, p.dtype) != key]
    owned = [(i, p, placement.signature[i]) for i, p in enumerate(params) if placement.plan.owners[i] != UNOWNED]
    reshaped = [i for i, p, (*_, shape, _) in owned if p.shape != shape]
    moved = [i for i, p, (*_, shape, was) in owned if p.shape == shape and _order(p, was) != _order(p, p.stride())]
    for changed, what in ((retyped, "dtype or device"), (reshaped, "shape"), (moved, "memory format (strides)")):
        if changed:
            (device, dtype), (*_, shape, strides) = placement.keys[changed[0]], placement.signature[changed[0]]
            param = params[changed[0]]
            return (
                f"{len(changed)} parameter(s) changed {what} after the ZeroRedundancyOptimizer was built (parameter "
                f"{changed[0]}: {dtype} on {device}, shape {tuple(shape)}, strides {strides}; now {param.dtype} on "
                f"{param.device}, shape {tuple(param.shape)}, strides {param.stride()}; model.to(...), .double() or "
                f"p.data = ... since): {_CONVERT_FIRST}"
            )
    return None


_CONVERT_FIRST = (
    "its partition, master copies and optimizer state were made for the old ones. Convert the model before building "
    "the optimizer (dtype, device and memory_format, before any ShardedDataParallel too), or build a new optimizer "
    "after converting (and load a checkpoint into it to keep the optimizer state)"
)


def _signature(params: Sequence[Tensor]) -> list[Signature]:
    """What a placement depends on of each parameter, read in one pass (every step: 0.3 us a parameter)."""
    return [(p.requires_grad, p.data_ptr(), p.shape, p.stride()) for p in params]


def _order(param: Tensor, strides: Sequence[int]) -> tuple[int, ...]:
    """``param``'s memory order under ``strides``: those of its dimensions longer than 1 (size-1 ones order nothing)."""
    return tuple(s for s, n in zip(strides, param.shape) if n > 1)


def install_kept(kept: dict[int, dict[str, Any]], placement: Placement, optim: Optimizer) -> bool:
    """Move the entries whose parameters have an owner now into the owners' local state, as a load; whether any."""
    placed = {index for index in kept if placement.plan.owners[index] != UNOWNED}
    if not placed:
        return False
    formats = getattr(optim, "formats", None)
    for local in [local for local in placement.shard.locals if local.index in placed]:
        entry = {k: _as_loaded(local.tensor, k, v) for k, v in slice_entry(kept[local.index], local).items()}
        if formats is not None:
            formats.encode_entry(local.tensor, entry)
        optim.state[local.tensor] = entry
    for index in placed:
        del kept[index]
    return True


def _as_loaded(tensor: Tensor, key: Any, value: Any) -> Any:
    """``value`` cast as ``Optimizer.load_state_dict`` casts it for ``tensor`` (``step`` kept as it is)."""
    if not isinstance(value, Tensor) or key == "step":
        return value
    if not torch.is_floating_point(value):
        return value.to(tensor.device)
    return value.to(tensor.device, tensor.dtype)
