"""DDP communication hooks: ZeRO steps overlapped with the gradient reduction, post-local SGD, and the deprecated
``reduce_to_owners_hook`` (an all-reduce now; ZeRO-2 is ``distoptim.ShardedDataParallel``)."""

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
