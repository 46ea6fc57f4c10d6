"""Model averagers: average parameters across a process group on a schedule (used by post-local SGD)."""

from distoptim.averaging.averagers import HierarchicalModelAverager, ModelAverager, PeriodicModelAverager

__all__ = ["HierarchicalModelAverager", "ModelAverager", "PeriodicModelAverager"]
