"""SCAFFOLD."""


class ZeroRedundancyOptimizer:
    pass
