"""``DistributedOptimizer`` over RPC: ``optimizer`` (the caller's half) and ``owner`` (the owners' half)."""

from distoptim.rpc.optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
