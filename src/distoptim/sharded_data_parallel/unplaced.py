"""The gradients of parameters made trainable after ``ShardedDataParallel`` planned its buckets: no bucket holds
them until the wrapper plans again, so each backward's end averages their ``.grad`` (one all-reduce each), and the
next plan takes that average into its new buckets.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from distoptim._flat import view_like
from distoptim.comm import agreement
from distoptim.comm import collectives as comm
from distoptim.sharded_data_parallel.buckets import BucketPlan

if TYPE_CHECKING:
    from distoptim.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["Unplaced"]


class Unplaced:
    """Which ``.grad`` tensors a backward's end averaged (held weakly, with their version then)."""

    def __init__(self) -> None:
        self.averaged: dict[int, tuple[weakref.ref[Tensor], int]] = {}

    def average(
        self,
        zero: ZeroRedundancyOptimizer,
        params: Sequence[Tensor],
        placed: Mapping[int, Any],
        used: list[bool],
        agree: bool,
    ) -> tuple[bool, ...]:
        """At a backward's end: mark each trainable parameter not in ``placed`` used where it has a ``.grad``; agree
        across ranks on ``used`` (with ``agree``) and on which of those each rank's backward reached, in one
        agreement; average the ``.grad`` of those some rank reached (zeros where this rank has none). One that no
        backward reached stays as it is, as DDP leaves a gradient unused everywhere. Returns the agreed ``used``."""
        late = [i for i, p in enumerate(params) if p.requires_grad and id(p) not in placed and p.numel()]
        fresh = []  # this backward reached its .grad here: not None, and not the average we left, untouched
        for index in late:
            grad = params[index].grad
            used[index] = used[index] or grad is not None
            ref, version = self.averaged.get(index, (None, -1))
            fresh.append(grad is not None and not (ref is not None and ref() is grad and version == grad._version))
        mine = [*used, *fresh] if agree else fresh
        flags = agreement.agree_across_ranks({}, zero.agreement_groups, "backward", flags=mine) if agree or late else ()
        for index, reached in zip(late, flags[len(mine) - len(late) :]):
            if reached:
                param = params[index]
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
                grad.mul_(1.0 / (zero.world_size * zero.replica_count))  # then summed: DDP's order and rounding
                for group in zero.agreement_groups:
                    comm.all_reduce_(grad, group)
                param.grad = grad
                self.averaged[index] = (weakref.ref(grad), grad._version)
        return tuple(flags[: len(used)]) if agree else ()

    def take_into(self, buffer: Tensor, plan: BucketPlan, params: Sequence[Tensor]) -> list[int]:
        """Move each averaged ``.grad`` of ``plan``'s parameters into ``buffer`` (``.grad`` set to None); return
        their indices. Only the average as it was: a ``no_sync()`` sum stays, the next backward reduces it."""
        taken = []
        for slot in plan.slots:
            param, (ref, version) = params[slot.index], self.averaged.get(slot.index, (None, -1))
            grad = param.grad
            if grad is not None and ref is not None and ref() is grad and version == grad._version:
                view_like(buffer, slot.position, param).copy_(grad)
                param.grad = None
                taken.append(slot.index)
        return taken
