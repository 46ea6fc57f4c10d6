"""Post-local SGD: model averagers, the optimizer wrapper that runs them, and the DDP gradient hook."""

from distoptim.averaging.averagers import HierarchicalModelAverager, ModelAverager, PeriodicModelAverager
from distoptim.averaging.optimizer import PostLocalSGDOptimizer
from distoptim.ddp.post_local_sgd import PostLocalSGDState, post_localSGD_hook

__all__ = [
    "HierarchicalModelAverager",
    "ModelAverager",
    "PeriodicModelAverager",
    "PostLocalSGDOptimizer",
    "PostLocalSGDState",
    "post_localSGD_hook",
]
