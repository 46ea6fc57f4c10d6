"""The modes that are not the library's, modelled from what they allocate: DDP and FSDP2."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from distoptim.plan.figures import (
    ModePlan,
    PlanConfig,
    RankMemory,
    all_reduce_bytes,
    dtype_name,
    mastered,
    step_cost,
    step_dtype,
)
from distoptim.plan.inventory import ROOT_UNIT, Inventory, ParamSpec

__all__ = ["ddp_plan", "fsdp2_plan"]


def ddp_plan(inventory: Inventory, config: PlanConfig) -> ModePlan:
    params, master = inventory.params, config.master_dtype
    trainable = [p for p in params if p.trainable]
    grad_bytes = sum(p.nbytes for p in trainable)
    masters = sum(p.numel * master.itemsize for p in trainable if mastered(p, master)) if master else 0
    memory = RankMemory(
        params=sum(p.nbytes for p in params),
        grads=grad_bytes * (1 if config.gradient_as_bucket_view else 2),
        state=plain_state(params, config),
        master=masters,
        other=(("master gradients during step", masters),) if masters else (),
    )
    notes = [
        "gradients: DDP's buckets, which .grad views (gradient_as_bucket_view=True)"
        if config.gradient_as_bucket_view
        else "gradients: DDP's buckets and a separate .grad, each the full gradient (gradient_as_bucket_view=False, "
        "DDP's default)"
    ]
    if master:
        notes.append(
            f"master weights: a {dtype_name(master)} copy of every trainable parameter, which the optimizer steps"
        )
    sends = (("all-reduce of gradients", all_reduce_bytes(grad_bytes, config.world_size)),)
    return ModePlan("ddp", "DDP", (memory,) * config.world_size, sends, tuple(notes))


def plain_state(params: Sequence[ParamSpec], config: PlanConfig) -> int:
    """A plain optimizer's state over every parameter (frozen ones too where made at construction)."""
    total = 0
    for param in params:
        cost = step_cost(param, config, step_dtype(param, config.master_dtype if param.trainable else None))
        if param.trainable or cost.at_construction:
            total += cost.bytes_for(param.numel)
    return total


def fsdp2_plan(inventory: Inventory, config: PlanConfig) -> ModePlan:
    """``fully_shard`` on every unit, ``reshard_after_forward=True``: each parameter cut along dim 0 into
    ``ceil(rows / N)``-row chunks, parameters and gradients padded to a full chunk, optimizer state unpadded."""
    size, master, reduce_dtype = config.world_size, config.master_dtype, config.reduce_dtype
    sharded = grads = empty = 0  # the same on every rank (padded); state every rank has, even for an empty shard
    steps = [0] * (size + 1)  # state bytes beyond ``empty``, as differences between neighbouring ranks
    gathered: dict[int, int] = {}  # unit -> bytes of its gathered parameters (padded, in the compute dtype)
    gathered_grads: dict[int, int] = {}  # unit -> bytes of its unsharded gradient (in the reduce dtype)
    for param in inventory.params:
        rows = param.shape[0] if param.shape else 1
        per_row = param.numel // rows if rows else 0
        chunk = -(-rows // size)
        dtype = step_dtype(param, master)
        sharded += chunk * per_row * dtype.itemsize
        gathered[param.unit] = gathered.get(param.unit, 0) + size * chunk * per_row * param.dtype.itemsize
        cost = step_cost(param, config, dtype)
        if param.trainable or cost.at_construction:  # ranks [0, full) hold a full chunk, rank full the rest
            full, rest = divmod(rows, chunk) if chunk else (0, 0)
            steps[0] += cost.bytes_for(chunk * per_row) - cost.bytes_for(0)
            steps[full] += cost.bytes_for(rest * per_row) - cost.bytes_for(chunk * per_row)
            steps[min(full + 1, size)] -= cost.bytes_for(rest * per_row) - cost.bytes_for(0)
            empty += cost.bytes_for(0)
        if param.trainable:
            grads += chunk * per_row * dtype.itemsize
            grad_bytes = size * chunk * per_row * (reduce_dtype or param.dtype).itemsize
            gathered_grads[param.unit] = gathered_grads.get(param.unit, 0) + grad_bytes
    root = gathered.get(ROOT_UNIT, 0)
    blocks = sorted((b for unit, b in gathered.items() if unit != ROOT_UNIT), reverse=True)
    other = tuple(
        (name, size_)
        for name, size_ in (
            ("root unit gathered (not resharded after forward)", root),
            ("two largest units gathered (computing + prefetched)", sum(blocks[:2])),
            ("largest unit's unsharded gradient", max(gathered_grads.values(), default=0)),
        )
        if size_
    )
    state = list(itertools.accumulate(steps[:size], initial=empty))[1:]
    ranks = tuple(RankMemory(sharded, grads, state[rank], 0, other) for rank in range(size))
    all_gathered = sum(gathered.values())
    sends = (
        ("all-gather of parameters, forward", (size - 1) * all_gathered // size),
        ("all-gather of parameters, backward", (size - 1) * (all_gathered - root) // size),
        ("reduce-scatter of gradients", (size - 1) * sum(gathered_grads.values()) // size),
    )
    notes = [
        "fully_shard on each unit and the root, reshard_after_forward=True; parameters sharded along dim 0, "
        "padded per parameter; unsharded units modelled (FSDP2's own prefetching decides the real peak)"
    ]
    if master:
        notes.append(
            f"sharded parameters are the {dtype_name(master)} master weights (MixedPrecisionPolicy(param_dtype))"
        )
    return ModePlan("fsdp2", "FSDP2 (ZeRO-3)", ranks, sends, tuple(notes))
