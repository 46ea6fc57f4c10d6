"""Partition balance (largest optimizer-state shard over the ideal) for GPT-2 124M's parameter shapes, 2 to 1,024
ranks: pure arithmetic, no process group, no memory (torch's partition runs on meta tensors).

    .venv/bin/python benchmarks/partition_balance.py

Three partitions: distoptim's ``greedy`` and ``even`` (``distoptim.zero.partition.partition_parameters``) and
torch's ``ZeroRedundancyOptimizer`` (sorted greedy, whole parameters), computed by torch's own
``_partition_parameters`` on an instance that was never constructed (so it needs no process group). The shapes are
tests/zero/test_partition.py's (embedding tied to the output head: 124,439,808 elements in 148 tensors).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from distoptim.zero.partition import partition_parameters

__all__ = ["PARTITIONS", "WORLD_SIZES", "balance", "gpt2_124m_numels", "torch_greedy_loads"]

PARTITIONS = ("distoptim greedy", "distoptim even", "torch greedy")
WORLD_SIZES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


def gpt2_124m_numels() -> list[int]:
    """GPT-2 small's parameter element counts, from the partition tests (one definition of the shapes)."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    from tests.zero.test_partition import _gpt2_124m_numels

    return _gpt2_124m_numels()


def torch_greedy_loads(numels: Sequence[int], world_size: int) -> list[int]:
    """Elements per rank under torch's ZeroRedundancyOptimizer partition, by torch's own ``_partition_parameters``.

    The instance is made with ``object.__new__`` and given only what that method reads (``world_size``,
    ``param_groups``, the empty cache): no process group, no optimizer, and the parameters are meta tensors.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    shim = object.__new__(ZeroRedundancyOptimizer)
    shim.world_size = world_size
    shim.param_groups = [{"params": [torch.empty(n, device="meta") for n in numels]}]
    shim._partition_parameters_cache = []
    per_rank = shim._partition_parameters()
    return [sum(p.numel() for group in groups for p in group["params"]) for groups in per_rank]


def balance(numels: Sequence[int], world_sizes: Sequence[int] = WORLD_SIZES) -> dict[str, list[float]]:
    """For each partition in ``PARTITIONS``: largest shard / (total / N) at each world size N."""
    total = sum(numels)
    trainable = [True] * len(numels)
    ratios: dict[str, list[float]] = {name: [] for name in PARTITIONS}
    for world_size in world_sizes:
        ideal = total / world_size
        for mode in ("greedy", "even"):
            plan = partition_parameters(numels, trainable, world_size, mode=mode)
            ratios[f"distoptim {mode}"].append(max(plan.loads()) / ideal)
        ratios["torch greedy"].append(max(torch_greedy_loads(numels, world_size)) / ideal)
    return ratios


def main() -> None:
    numels = gpt2_124m_numels()
    ratios = balance(numels)
    print(f"GPT-2 124M shapes: {sum(numels):,} elements in {len(numels)} tensors; largest shard / ideal")
    print(f"{'N':>5} " + " ".join(f"{name:>17}" for name in PARTITIONS))
    for index, world_size in enumerate(WORLD_SIZES):
        print(f"{world_size:>5} " + " ".join(f"{ratios[name][index]:>17.3f}" for name in PARTITIONS))


if __name__ == "__main__":
    main()
