"""``DistributedOptimizer`` over RPC: ``optimizer`` (the caller's half: one optimizer over parameters other workers
own) and ``owner`` (the owners' half: a local optimizer per owner and the RPC entry points it runs). The RPC framework
is its communication; it imports ``functional`` only."""

from distoptim.rpc.optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
