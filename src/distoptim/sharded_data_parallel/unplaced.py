"""Parameters made trainable after ``ShardedDataParallel`` planned its buckets: each backward's end averages their
``.grad`` (one all-reduce each) until the next plan takes that average into its new buckets; under
``static_graph=True`` the step does, after its agreement (the backward's end has no collective to agree in)."""

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
from distoptim.sharded_data_parallel.marker import GradientMarker

if TYPE_CHECKING:
    from distoptim.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["SAME_TRAINABLE", "Unplaced"]

SAME_TRAINABLE = "make the same parameters trainable on every rank (requires_grad_ on the same layers everywhere)"


class Unplaced:
    """Which ``.grad`` tensors a backward's end averaged (held weakly, with their version then)."""

    def __init__(self) -> None:
        self.averaged: dict[int, tuple[weakref.ref[Tensor], int]] = {}

    def agree(
        self,
        zero: ZeroRedundancyOptimizer,
        params: Sequence[Tensor],
        placed: Mapping[int, Any],
        used: list[bool],
        alone: bool = False,
    ) -> tuple[bool, ...]:
        """At a backward's end: agree on ``used`` (the ranks must have the same trainable parameters not in ``placed``)
        and return it; average the ``.grad`` of those some rank's backward reached, marking them ``used``. ``alone``
        (static_graph=True: no collective) only marks them: their ``.grad`` waits for the step (``average``)."""
        late = [i for i, p in enumerate(params) if p.requires_grad and id(p) not in placed and p.numel()]
        fresh = []  # this backward reached its .grad here: not None, and not the average we left, untouched
        for index in late:
            grad = params[index].grad
            used[index] = used[index] or grad is not None
            ref, version = self.averaged.pop(index, (None, -1)) if alone else self.averaged.get(index, (None, -1))
            fresh.append(grad is not None and not (ref is not None and ref() is grad and version == grad._version))
        if alone:
            return ()
        groups = zero.agreement_groups
        late_here = {"parameters made trainable since the wrapper planned its buckets {}": tuple(late)} if late else {}
        agreed = agreement.agree_across_ranks(late_here, groups, "backward", SAME_TRAINABLE, used)
        anywhere = agreement.agree_across_ranks({}, groups, "backward", flags=fresh) if late else ()
        self.average(zero, params, [index for index, reached in zip(late, anywhere) if reached])
        return agreed

    def average(self, zero: ZeroRedundancyOptimizer, params: Sequence[Tensor], indices: Sequence[int]) -> None:
        """Average the ``.grad`` of ``indices``, the same on every rank (zeros where a rank has none, or a marker)."""
        for index in indices:
            param = params[index]
            grad = param.grad if param.grad is not None and not isinstance(param.grad, GradientMarker) else None
            grad = torch.zeros_like(param) if grad is None else grad
            grad.mul_(1.0 / (zero.world_size * zero.replica_count))  # then summed: DDP's order and rounding
            for group in zero.agreement_groups:
                comm.all_reduce_(grad, group)
            param.grad = grad
            self.averaged[index] = (weakref.ref(grad), grad._version)

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
