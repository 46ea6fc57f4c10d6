"""The planner's figures (``PlanConfig``, ``RankMemory``, ``ModePlan``) and the per-parameter arithmetic every
mode's plan shares: the state a parameter's step keeps and the dtype it steps in."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from distoptim.plan.inventory import ParamSpec
from distoptim.plan.state import OptimizerSpec, StateCost, state_cost
from distoptim.zero.codecs import MIN_NUMEL
from distoptim.zero.shard import has_master

__all__ = ["ModePlan", "PlanConfig", "RankMemory", "dtype_name", "step_cost", "step_dtype"]


@dataclass(frozen=True)
class PlanConfig:
    """How the model is trained: the settings that change the bytes."""

    world_size: int
    optimizer: OptimizerSpec
    master_dtype: torch.dtype | None = None
    partition: str = "even"  # ZeRO's; the planner's default (ZeroRedundancyOptimizer's own default is greedy)
    gradient_as_bucket_view: bool = False  # DDP's (its default: False)
    bucket_cap_mb: float = 25.0  # ShardedDataParallel's
    parameters_as_bucket_view: bool = False  # ZeroRedundancyOptimizer's (its default: False)
    reduce_dtype: torch.dtype | None = None  # ShardedDataParallel's and FSDP2's gradient reduction dtype
    muon: OptimizerSpec | None = None  # Muon on the blocks' matrices (``with_muon``), ``optimizer`` on the rest
    state_format: str = "fp32"  # ZeroRedundancyOptimizer's (its modes only): fp32, bf16, int8


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds; ``other``: named buffers (communication staging, gathered FSDP units, upcast gradients)."""

    params: int
    grads: int
    state: int
    master: int
    other: tuple[tuple[str, int], ...] = ()

    @property
    def total(self) -> int:
        return self.params + self.grads + self.state + self.master + sum(size for _, size in self.other)


@dataclass(frozen=True)
class ModePlan:
    """One mode's figures: per rank, bytes sent per step by collective, and what the model assumes."""

    key: str
    title: str
    ranks: tuple[RankMemory, ...]
    sends: tuple[tuple[str, int], ...]
    notes: tuple[str, ...]
    gloo_received: tuple[int, ...] = ()  # per rank, bytes received a step on gloo by the path taken; (): not modelled
    newton_schulz: tuple[int, ...] = ()  # with Muon: each rank's Newton-Schulz FLOPs per step

    @property
    def sends_total(self) -> int:
        return sum(size for _, size in self.sends)

    def peak(self) -> tuple[int, RankMemory]:
        """The rank that holds the most (the lowest such rank) and its figures."""
        rank = max(range(len(self.ranks)), key=lambda r: (self.ranks[r].total, -r))
        return rank, self.ranks[rank]


def step_cost(param: ParamSpec, config: PlanConfig, dtype: torch.dtype, zero: bool = False) -> StateCost:
    """The state of ``param`` stepped in ``dtype`` by its optimizer; ``zero``: in ZeRO's ``config.state_format``."""
    formatted = zero and param.numel >= MIN_NUMEL and dtype.is_floating_point  # Muon's momentum too
    optimizer = config.muon if param.muon and config.muon is not None else config.optimizer
    return state_cost(optimizer, dtype, config.state_format if formatted else "fp32")


def step_dtype(param: ParamSpec, master: torch.dtype | None) -> torch.dtype:
    """The dtype the optimizer steps ``param`` in: its master copy's where it has one (``zero.shard.has_master``)."""
    return master if master is not None and has_master(param.dtype, master) else param.dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
