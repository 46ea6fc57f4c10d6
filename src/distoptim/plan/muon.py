"""Muon in a plan: which parameters take it (the blocks' matrices), and each rank's Newton-Schulz work."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from distoptim.plan.inventory import ROOT_UNIT, Inventory, ParamSpec
from distoptim.zero.partition import PartitionPlan

__all__ = ["NS_STEPS", "newton_schulz_flops", "newton_schulz_per_rank", "takes_muon", "with_muon"]

NS_STEPS = 5  # torch.optim.Muon's default ns_steps


def takes_muon(param: ParamSpec) -> bool:
    """Whether the planner gives ``param`` to Muon: a matrix inside a block."""
    return len(param.shape) == 2 and param.unit != ROOT_UNIT


def with_muon(inventory: Inventory) -> Inventory:
    """``inventory`` in the optimizer's order, the blocks' matrices (flagged ``muon``) first, then the rest, each
    in ``model.parameters()`` order."""
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
    """FLOPs of one orthogonalization of an ``m x n`` matrix (``m`` the short side), as torch's Muon runs it:
    per iteration ``X X^T`` and ``B X`` (``2 m^2 n`` each) and ``b A + c A A`` (``2 m^3``)."""
    short, long = sorted(shape)
    return steps * (4 * short * short * long + 2 * short**3)


def newton_schulz_per_rank(params: Sequence[ParamSpec], plan: PartitionPlan | None, world_size: int) -> list[int]:
    """Each rank's Newton-Schulz FLOPs per step: each trainable Muon matrix on its owner under ``plan``, or on
    every rank without one."""
    per_rank = [0] * world_size
    for index, param in enumerate(params):
        if param.muon and param.trainable:
            owners = range(world_size) if plan is None else {f.rank for f in plan.fragments[index]}
            for rank in owners:
                per_rank[rank] += newton_schulz_flops(param.shape)
    return per_rank
