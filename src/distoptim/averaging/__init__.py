"""Post-local SGD: model averagers, the optimizer wrapper that runs them, and the DDP gradient hook.

``comm`` holds the only calls to ``torch.distributed``; ``averagers`` are schedules over one averaging
collective; ``optimizer`` wraps a local optimizer; ``hook`` is the DDP communication hook.
"""

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
