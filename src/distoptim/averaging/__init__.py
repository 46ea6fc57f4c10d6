"""SCAFFOLD: replaced by the post-local-SGD work."""

from distoptim.averaging.averagers import HierarchicalModelAverager, ModelAverager, PeriodicModelAverager
from distoptim.averaging.hook import PostLocalSGDState, post_localSGD_hook
from distoptim.averaging.optimizer import PostLocalSGDOptimizer

__all__ = [
    "HierarchicalModelAverager",
    "ModelAverager",
    "PeriodicModelAverager",
    "PostLocalSGDOptimizer",
    "PostLocalSGDState",
    "post_localSGD_hook",
]
