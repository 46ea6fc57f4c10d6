"""Process-group facts every communication module needs: which group, how big, which device its tensors use."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["comm_device", "default_group", "group_size"]


def default_group(process_group: ProcessGroup | None) -> ProcessGroup:
    """``process_group``, or the default (world) group when it is ``None``."""
    if process_group is not None:
        return process_group
    if not dist.is_available() or not dist.is_initialized() or dist.group.WORLD is None:
        raise RuntimeError(
            "no process group was given and the default one is not initialised; "
            "call torch.distributed.init_process_group() first (world size 1 works too), or pass process_group="
        )
    return dist.group.WORLD


def group_size(group: ProcessGroup) -> int:
    """Number of ranks in ``group``."""
    return dist.get_world_size(group=group)


def comm_device(group: ProcessGroup) -> torch.device:
    """Where tensors sent over ``group`` must live: the current CUDA device for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
