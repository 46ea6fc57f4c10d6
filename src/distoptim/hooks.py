"""DDP communication hooks: ZeRO steps overlapped with gradient reduction, and post-local SGD."""

from distoptim.averaging.hook import PostLocalSGDState, allreduce_hook, post_localSGD_hook
from distoptim.zero.ddp_hooks import hook_with_zero_step, hook_with_zero_step_interleaved

__all__ = [
    "PostLocalSGDState",
    "allreduce_hook",
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
    "post_localSGD_hook",
]
