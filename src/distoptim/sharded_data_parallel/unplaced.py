"""Parameters made trainable after ``ShardedDataParallel`` planned its buckets: each backward's end averages their
``.grad`` (one all-reduce each) until the next plan takes that average into its new buckets."""

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

_SAME_TRAINABLE = "make the same parameters trainable on every rank (requires_grad_ on the same layers everywhere)"


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
        """At a backward's end: average the ``.grad`` of the trainable parameters not in ``placed`` that some rank's
        backward reached (zeros where this rank has none; the others left as DDP leaves them), marking them ``used``.
        With ``agree``, first agree on ``used`` (the ranks must have the same such parameters) and return it."""
        late = [i for i, p in enumerate(params) if p.requires_grad and id(p) not in placed and p.numel()]
        fresh = []  # this backward reached its .grad here: not None, and not the average we left, untouched
        for index in late:
            grad = params[index].grad
            used[index] = used[index] or grad is not None
            ref, version = self.averaged.get(index, (None, -1))
            fresh.append(grad is not None and not (ref is not None and ref() is grad and version == grad._version))
        groups = zero.agreement_groups
        late_here = {"parameters made trainable since the wrapper planned its buckets {}": tuple(late)} if late else {}
        agreed = agreement.agree_across_ranks(late_here, groups, "backward", _SAME_TRAINABLE, used) if agree else ()
        anywhere = agreement.agree_across_ranks({}, groups, "backward", flags=fresh) if late else ()
        for index, reached in zip(late, anywhere):
            if reached:
                param = params[index]
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
                grad.mul_(1.0 / (zero.world_size * zero.replica_count))  # then summed: DDP's order and rounding
                for group in zero.agreement_groups:
                    comm.all_reduce_(grad, group)
                param.grad = grad
                self.averaged[index] = (weakref.ref(grad), grad._version)
        return agreed

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
