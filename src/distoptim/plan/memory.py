"""Bytes per rank and sent per step for each mode: ZeRO's shards from the library's own ``partition_parameters``;
DDP, ``ShardedDataParallel`` and FSDP2 modelled from what they allocate (``docs/guides/planner.md``)."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import replace
from typing import cast

import torch

from distoptim.comm import relay
from distoptim.plan.figures import ModePlan, PlanConfig, RankMemory, dtype_name, step_cost, step_dtype
from distoptim.plan.inventory import ROOT_UNIT, Inventory, ParamSpec
from distoptim.sharded_data_parallel.buckets import BucketCaps, plan_buckets
from distoptim.zero.buckets import DEFAULT_DIRECT_BYTES
from distoptim.zero.partition import LayoutPlan, PartitionPlan, newton_schulz_cost, partition_parameters

__all__ = ["NS_STEPS", "newton_schulz_flops", "plan_modes", "takes_muon", "with_muon"]

NS_STEPS = 5  # torch.optim.Muon's default ns_steps
DEVICE = torch.device("meta")  # every parameter of a rank lives on its one device: the key's device part


def plan_modes(inventory: Inventory, config: PlanConfig) -> list[ModePlan]:
    """DDP, ZeRO-1, ShardedDataParallel and FSDP2 for ``inventory`` trained as ``config`` says."""
    if config.world_size < 1:
        raise ValueError(f"--world-size must be at least 1, got {config.world_size}")
    if config.muon is not None:
        inventory = with_muon(inventory)
    zero = _ZeroShards(inventory.params, _plan(inventory, config, None), config)
    # ShardedDataParallel re-cuts an even partition into buckets of its cap, each split evenly (its own plan)
    caps = BucketCaps(int(config.bucket_cap_mb * 2**20), config.reduce_dtype)
    sharded = _ZeroShards(inventory.params, _plan(inventory, config, caps), config)
    sdp = sharded.sharded_data_parallel(caps, zero.params_bytes())
    modes = [_ddp_plan(inventory, config), zero.zero1(), sdp, _fsdp2_plan(inventory, config)]
    if config.muon is None:
        return modes
    plans = {"zero1": zero.plan, "sharded_data_parallel": sharded.plan}  # else every rank
    everywhere = {
        "ddp": "Muon: every rank orthogonalizes every matrix (plain torch.optim.Muon)",
        "fsdp2": "Muon as its users run it: every rank gathers each matrix (full_tensor()) and orthogonalizes it",
    }
    owned = "Muon: each matrix whole on one rank, chosen by Newton-Schulz cost, and orthogonalized there only"
    return [
        replace(
            mode,
            newton_schulz=tuple(_newton_schulz_per_rank(inventory.params, plans.get(mode.key), config.world_size)),
            notes=(*mode.notes, everywhere.get(mode.key, owned)),
        )
        for mode in modes
    ]


def _plan(inventory: Inventory, config: PlanConfig, region_numel: Mapping[Hashable, int] | None) -> PartitionPlan:
    """The partition plan ZeroRedundancyOptimizer makes (``region_numel``: ShardedDataParallel's buckets)."""
    return partition_parameters(
        [p.numel for p in inventory.params],
        [p.trainable for p in inventory.params],
        config.world_size,
        mode=config.partition,
        keys=[(DEVICE, p.dtype) for p in inventory.params],
        region_numel=region_numel if config.partition == "even" else None,
        whole=[p.muon for p in inventory.params],
        costs=[newton_schulz_cost(p.shape) if p.muon else p.numel for p in inventory.params],
    )


class _ZeroShards:
    """What each rank owns under the partition plan, and the two modes that shard optimizer state by it."""

    def __init__(self, params: Sequence[ParamSpec], plan: PartitionPlan, config: PlanConfig) -> None:
        self.params, self.plan, self.config = params, plan, config
        self.state, self.owned = [0] * config.world_size, [0] * config.world_size  # owned: bytes of its fragments
        self.staging = 0  # StagedSync: pieces under DEFAULT_DIRECT_BYTES travel through buffers kept between steps
        for param, fragments in zip(params, plan.fragments):
            cost = step_cost(param, config, step_dtype(param, config.master_dtype), zero=True)
            for fragment in fragments:
                self.state[fragment.rank] += cost.bytes_for(fragment.length)
                piece_bytes = fragment.length * param.dtype.itemsize
                self.owned[fragment.rank] += piece_bytes
                if 0 < piece_bytes < DEFAULT_DIRECT_BYTES:
                    self.staging += piece_bytes
        self.master = self._step_casts(None)  # master copies: the owned pieces stepped in a dtype not their own

    def _moved(self, in_chunks: bool, itemsize: int | None = None) -> int:
        """Bytes one rank receives when every owned range travels to or from its owner (``in_chunks``: in equal
        chunks where a region's shares are equal)."""
        size = self.config.world_size
        scaled = 0  # size times the bytes, so that the one division is the last step
        for layout in self.plan.layouts:
            for bounds in layout.bounds:
                shares = {end - start for start, end in itertools.pairwise(bounds)}
                if in_chunks and len(shares) == 1 and 0 not in shares:  # the whole region, padding included
                    moved = bounds[-1] - bounds[0]
                else:  # the parameters whose first element lies in the region (regions hold whole parameters)
                    moved = sum(
                        self.plan.numels[index]
                        for index, position in zip(layout.params, layout.positions)
                        if bounds[0] <= position < bounds[-1]
                    )
                scaled += (size - 1) * moved * (itemsize or _itemsize(layout))
        return scaled // size

    def _ranks(
        self, params: int, grads: Sequence[int], extra: tuple[tuple[str, int], ...], cast: str, casts: list[int]
    ) -> tuple[RankMemory, ...]:
        """Each rank's figures: ``extra`` buffers, and ``casts[rank]`` bytes named ``cast`` where it has any."""
        return tuple(
            RankMemory(params, grad, state, master, (*extra, (cast, n)) if n else extra)
            for grad, state, master, n in zip(grads, self.state, self.master, casts)
        )

    def _shard_note(self) -> str:
        loads = self.plan.loads()
        largest = max(range(len(loads)), key=lambda rank: (loads[rank], -rank))
        return (
            f"optimizer state and master weights of this rank's shard only ({self.config.partition} partition; the "
            f"largest shard, rank {largest}'s, has {loads[largest]:,} of {sum(loads):,} trainable elements)"
        )

    def zero1(self) -> ModePlan:
        """ZeRO-1 (under DDP, which keeps full gradients)."""
        config, size = self.config, self.config.world_size
        grad_bytes = sum(p.nbytes for p in self.params if p.trainable)
        ddp_grads = grad_bytes * (1 if config.gradient_as_bucket_view else 2)
        staged = self.staging and not config.parameters_as_bucket_view
        staging = (("parameter sync staging", self.staging),) if staged else ()
        params = self.params_bytes()  # master gradients (below): the owned ones upcast, as large as the masters
        under_ddp = self._ranks(params, [ddp_grads] * size, staging, "master gradients during step", self.master)
        gather = ("all-gather of parameters", self._moved(config.parameters_as_bucket_view))
        ddp_note = (
            "gradients as DDP's (full buckets and .grad); parameter sync: ZeroRedundancyOptimizer's default "
            "StagedSync (pieces under 1 MiB go through staging buffers kept between steps)"
        )
        all_reduce = ("all-reduce of gradients", _all_reduce_bytes(grad_bytes, size))
        gloo = tuple(all_reduce[1] + synced for synced in self._not_owned())
        return ModePlan("zero1", "ZeRO-1", under_ddp, (all_reduce, gather), (self._shard_note(), ddp_note), gloo)

    def _not_owned(self) -> list[int]:
        """Per rank, the bytes of trainable elements (bucket views: regions, padding included) a sync brings it."""
        owned = self.owned
        if self.config.parameters_as_bucket_view:
            owned = [0] * self.config.world_size
            for layout in self.plan.layouts:
                for rank in range(self.config.world_size):
                    owned[rank] += sum(end - start for start, end in layout.ranges(rank)) * _itemsize(layout)
        return [sum(owned) - mine for mine in owned]

    def params_bytes(self) -> int:
        """Parameter storage: with ``parameters_as_bucket_view``, the flat buffers (padding and room included)."""
        if not self.config.parameters_as_bucket_view:
            return sum(p.nbytes for p in self.params)
        room = self.config.world_size - 1
        flat = sum(
            (layout.numel + room * sum(1 for i in layout.params if self.plan.numels[i])) * _itemsize(layout)
            for layout in self.plan.layouts
        )
        return flat + sum(p.nbytes for p in self.params if not p.trainable)

    def sharded_data_parallel(self, caps: Mapping[Hashable, int], params: int) -> ModePlan:
        """ShardedDataParallel over ``plan_buckets``; ``params``: the wrapped ZeroRedundancyOptimizer's storage."""
        config, reduce_dtype, size = self.config, self.config.reduce_dtype, self.config.world_size
        gather = ("all-gather of parameters", self._moved(config.parameters_as_bucket_view))
        buckets = plan_buckets(self.plan, caps)
        store = [(reduce_dtype or self.params[b.slots[0].index].dtype).itemsize for b in buckets]
        owned = [0] * size  # this rank's ranges of every bucket (the last rank's of a region with the padding)
        reduced = [0] * size  # on gloo: what each bucket's path (comm.relay) brings each rank
        for bucket, width in zip(buckets, store):
            ranges = bucket.owned_by_rank(size)
            for rank, (mine, count) in enumerate(zip(ranges, relay.received(ranges))):
                owned[rank] += width * sum(end - start for start, end in mine)
                reduced[rank] += count * width
        # held whole until it lands: at most two buckets, each of its full length (a parameter over the cap is one)
        in_flight = sum(sorted((b.numel * width for b, width in zip(buckets, store)), reverse=True)[:2])
        copied = [  # a gradient copied into its bucket (not the bucket itself) lives beside it while it is copied
            self.params[slot.index].nbytes
            for b, width in zip(buckets, store)
            for slot in b.slots
            if not (len(b.slots) == 1 and b.numel == slot.numel and width == self.params[slot.index].dtype.itemsize)
        ]
        extra: tuple[tuple[str, int], ...] = (("gradient buckets in flight (at most)", in_flight),)
        if max(copied, default=0):
            extra += (("a gradient being copied into its bucket (at most)", max(copied)),)
        staged = not (config.parameters_as_bucket_view and config.partition == "even")
        extra += (("parameter sync staging", self.staging),) if self.staging and staged else ()
        ranks = self._ranks(params, owned, extra, "gradients cast to the step's dtype", self._step_casts(reduce_dtype))
        reduce_itemsize = reduce_dtype.itemsize if reduce_dtype else None
        reduce_scatter = ("reduction of gradients to owners", self._moved(True, reduce_itemsize))  # per bucket
        notes = (
            self._shard_note(),
            f"gradients: this rank's owned ranges of every bucket in "
            f"{dtype_name(reduce_dtype) if reduce_dtype else 'their dtype'}, plus, during the backward, at most two "
            "buckets being filled or reduced (a parameter over the cap is a bucket of its own) and the gradient "
            "being copied into one",
            "parameter sync: per bucket, pieces under 1 MiB through staging kept between steps (none with "
            "parameters_as_bucket_view=True and the even partition, whose regions are gathered in place)",
        )
        gloo = tuple(mine + synced for mine, synced in zip(reduced, self._not_owned()))
        return ModePlan("sharded_data_parallel", "ShardedDataParallel", ranks, (reduce_scatter, gather), notes, gloo)

    def _step_casts(self, grad_dtype: torch.dtype | None) -> list[int]:
        """Per rank, the bytes of owned pieces cast to the step's dtype from ``grad_dtype`` (None: the parameter's)."""
        casts = [0] * self.config.world_size
        for param, fragments in zip(self.params, self.plan.fragments):
            step = step_dtype(param, self.config.master_dtype)
            if (grad_dtype or param.dtype) != step:
                for fragment in fragments:
                    casts[fragment.rank] += fragment.length * step.itemsize
        return casts


def _all_reduce_bytes(nbytes: int, world_size: int) -> int:
    return 2 * (world_size - 1) * nbytes // world_size


def _itemsize(layout: LayoutPlan) -> int:
    return cast(tuple[torch.device, torch.dtype], layout.key)[1].itemsize  # the (DEVICE, dtype) key ``_plan`` gives


def _ddp_plan(inventory: Inventory, config: PlanConfig) -> ModePlan:
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
    grads = grad_bytes * (1 if config.gradient_as_bucket_view else 2)
    other = (("master gradients during step", masters),) if masters else ()
    memory = RankMemory(sum(p.nbytes for p in params), grads, state, masters, other)
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
    sends = (("all-reduce of gradients", _all_reduce_bytes(grad_bytes, config.world_size)),)
    return ModePlan("ddp", "DDP", (memory,) * config.world_size, sends, tuple(notes))


def _fsdp2_plan(inventory: Inventory, config: PlanConfig) -> ModePlan:
    """``fully_shard`` on every unit: ``ceil(rows / N)``-row chunks, padded except the optimizer state."""
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


def takes_muon(param: ParamSpec) -> bool:
    """Whether the planner gives ``param`` to Muon: a matrix inside a block."""
    return len(param.shape) == 2 and param.unit != ROOT_UNIT


def with_muon(inventory: Inventory) -> Inventory:
    """``inventory`` in the optimizer's order: the blocks' matrices (flagged ``muon``) first, then the rest."""
    matrices = [replace(p, muon=True) for p in inventory.params if takes_muon(p)]
    if not matrices:
        raise ValueError(
            f"--muon: {inventory.description} has no 2-D parameter inside a block (a child of an nn.ModuleList), "
            "which is what the planner gives Muon"
        )
    rest = [p for p in inventory.params if not takes_muon(p)]
    description = f"{inventory.description}; Muon on {len(matrices)} matrices of its blocks, the rest elementwise"
    return Inventory((*matrices, *rest), description)


def newton_schulz_flops(shape: Sequence[int], steps: int = NS_STEPS) -> int:
    """FLOPs of one orthogonalization as torch's Muon runs it: ``steps (4 m^2 n + 2 m^3)``, ``m`` the short side."""
    short, long = sorted(shape)
    return steps * (4 * short * short * long + 2 * short**3)


def _newton_schulz_per_rank(params: Sequence[ParamSpec], plan: PartitionPlan | None, world_size: int) -> list[int]:
    """Each rank's Newton-Schulz FLOPs per step: each trainable Muon matrix on its owners (no ``plan``: all)."""
    per_rank = [0] * world_size
    for index, param in enumerate(params):
        if param.muon and param.trainable:
            owners = range(world_size) if plan is None else {f.rank for f in plan.fragments[index]}
            for rank in owners:
                per_rank[rank] += newton_schulz_flops(param.shape)
    return per_rank
