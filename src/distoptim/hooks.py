"""DDP communication hooks: gradients reduced to their owners (ZeRO-2), ZeRO steps overlapped with the gradient
reduction, and post-local SGD."""

from distoptim.averaging.hook import PostLocalSGDState, allreduce_hook, post_localSGD_hook
from distoptim.zero.ddp_hooks import hook_with_zero_step, hook_with_zero_step_interleaved
from distoptim.zero.grad_sharding import reduce_to_owners_hook

__all__ = [
    "PostLocalSGDState",
    "allreduce_hook",
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
    "post_localSGD_hook",
    "reduce_to_owners_hook",
]
