"""The memory planner: bytes per rank and bytes sent per step for DDP, ZeRO-1,
``ShardedDataParallel`` and FSDP2, computed with the library's own partition plan (``python -m distoptim plan``)."""

from distoptim.plan.figures import ModePlan, PlanConfig, RankMemory
from distoptim.plan.inventory import Inventory, ParamSpec, from_factory, from_module, transformer
from distoptim.plan.memory import plan_modes
from distoptim.plan.state import OptimizerSpec, StateCost, resolve_optimizer, state_cost

__all__ = [
    "Inventory",
    "ModePlan",
    "OptimizerSpec",
    "ParamSpec",
    "PlanConfig",
    "RankMemory",
    "StateCost",
    "from_factory",
    "from_module",
    "plan_modes",
    "resolve_optimizer",
    "state_cost",
    "transformer",
]
