"""The modes that are not the library's, modelled from what they allocate: DDP and FSDP2."""

from __future__ import annotations

from collections import Counter

from distoptim.plan.figures import ModePlan, PlanConfig, RankMemory, all_reduce_bytes, dtype_name, step_cost, step_dtype
from distoptim.plan.inventory import ROOT_UNIT, Inventory

__all__ = ["ddp_plan", "fsdp2_plan"]


def ddp_plan(inventory: Inventory, config: PlanConfig) -> ModePlan:
    params, master = inventory.params, config.master_dtype
    grad_bytes = sum(p.nbytes for p in params if p.trainable)
    state = masters = 0  # a plain optimizer's state: of every parameter, frozen ones too where made at construction
    for param in params:
        dtype = step_dtype(param, master if param.trainable else None)
        cost = step_cost(param, config, dtype)
        if param.trainable or cost.at_construction:
            state += cost.bytes_for(param.numel)
        if dtype != param.dtype:  # a trainable parameter's master copy
            masters += param.numel * dtype.itemsize
    memory = RankMemory(
        params=sum(p.nbytes for p in params),
        grads=grad_bytes * (1 if config.gradient_as_bucket_view else 2),
        state=state,
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


def fsdp2_plan(inventory: Inventory, config: PlanConfig) -> ModePlan:
    """``fully_shard`` on every unit, ``reshard_after_forward=True``: each parameter cut along dim 0 into
    ``ceil(rows / N)``-row chunks, parameters and gradients padded to a full chunk, optimizer state unpadded."""
    size, master, reduce_dtype = config.world_size, config.master_dtype, config.reduce_dtype
    sharded = grads = 0  # the same on every rank (padded)
    state = [0] * size  # of each rank's own rows (unpadded), an empty shard's per-tensor state too
    gathered: Counter[int] = Counter()  # unit -> bytes of its gathered parameters (padded, in the compute dtype)
    gathered_grads: Counter[int] = Counter()  # unit -> bytes of its unsharded gradient (in the reduce dtype)
    for param in inventory.params:
        rows = param.shape[0] if param.shape else 1
        per_row = param.numel // rows if rows else 0
        chunk = -(-rows // size)
        dtype = step_dtype(param, master)
        sharded += chunk * per_row * dtype.itemsize
        gathered[param.unit] += size * chunk * per_row * param.dtype.itemsize
        cost = step_cost(param, config, dtype)
        if param.trainable or cost.at_construction:  # rank r holds rows [r chunk, (r + 1) chunk)
            for rank in range(size):
                state[rank] += cost.bytes_for(max(0, min(chunk, rows - rank * chunk)) * per_row)
        if param.trainable:
            grads += chunk * per_row * dtype.itemsize
            gathered_grads[param.unit] += size * chunk * per_row * (reduce_dtype or param.dtype).itemsize
    root = gathered[ROOT_UNIT]
    blocks = sorted((b for unit, b in gathered.items() if unit != ROOT_UNIT), reverse=True)
    held = {
        "root unit gathered (not resharded after forward)": root,
        "two largest units gathered (computing + prefetched)": sum(blocks[:2]),
        "largest unit's unsharded gradient": max(gathered_grads.values(), default=0),
    }
    other = tuple((name, nbytes) for name, nbytes in held.items() if nbytes)
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
