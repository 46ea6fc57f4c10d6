"""ZeRO stage 1: optimizer state sharded across the ranks of a process group."""

from distoptim.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer"]
