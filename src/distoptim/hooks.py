"""DDP communication hooks: gradients reduced to their owners (ZeRO-2), ZeRO steps overlapped with the gradient
reduction, and post-local SGD."""

from distoptim.ddp.post_local_sgd import PostLocalSGDState, allreduce_hook, post_localSGD_hook
from distoptim.ddp.reduce_to_owners import reduce_to_owners_hook
from distoptim.ddp.zero_step import hook_with_zero_step, hook_with_zero_step_interleaved

__all__ = [
    "PostLocalSGDState",
    "allreduce_hook",
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
    "post_localSGD_hook",
    "reduce_to_owners_hook",
]
