"""ZeRO-2 that saves memory: ``ShardedDataParallel`` reduces each gradient bucket to the owners of its elements and
keeps only this rank's part, for a ``ZeroRedundancyOptimizer`` to step."""

from distoptim.sharded_data_parallel.wrapper import ShardedDataParallel

__all__ = ["ShardedDataParallel"]
