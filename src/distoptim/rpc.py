"""SCAFFOLD: replaced by the DistributedOptimizer work."""

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer:
    pass
