"""Process-group facts every communication module needs: which group, how big, which device its tensors use."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "attached",
    "attached_everywhere",
    "backends_of",
    "choose_comm_device",
    "comm_device",
    "control_group",
    "default_group",
    "gloo_twin",
    "group_size",
    "is_member",
]

_ATTACHED: weakref.WeakKeyDictionary[ProcessGroup, dict[str, Any]] = weakref.WeakKeyDictionary()

_T = TypeVar("_T")


def default_group(process_group: ProcessGroup | None) -> ProcessGroup:
    """``process_group``, or the default (world) group when it is ``None``; a ``TypeError`` for anything else but
    the sentinel ``dist.new_group`` hands the ranks outside the group."""
    if process_group is not None:
        if not isinstance(process_group, ProcessGroup) and is_member(process_group):
            value = f" {process_group!r}" if isinstance(process_group, (int, float, str)) else ""
            raise TypeError(
                f"process_group must be a torch.distributed.ProcessGroup or None, got {type(process_group).__name__}"
                f"{value}; pass the optimizer's hyperparameters by keyword (lr=...)"
            )
        return process_group
    if not dist.is_available() or not dist.is_initialized() or dist.group.WORLD is None:
        raise RuntimeError(
            "no process group was given and the default one is not initialised; "
            "call torch.distributed.init_process_group() first (world size 1 works too), or pass process_group="
        )
    return dist.group.WORLD


def gloo_twin(group: ProcessGroup, purpose: str) -> ProcessGroup:
    """A gloo group over ``group``'s ranks, one per ``purpose`` (``"control"``, ``"async_checkpoint"``), made the
    first time (a collective over those ranks)."""

    def make() -> ProcessGroup:
        ranks = dist.get_process_group_ranks(group)
        twin: ProcessGroup = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        return twin

    return attached(group, f"gloo {purpose}", make)


def attached(group: ProcessGroup, purpose: str, make: Callable[[], _T]) -> _T:
    """What is kept for ``group`` under ``purpose``: what ``make()`` returned the first time; gone with ``group``."""
    kept = _ATTACHED.setdefault(group, {})
    value: _T | None = kept.get(purpose)
    if value is None:
        value = kept[purpose] = make()
    return value


def attached_everywhere(purpose: str) -> list[Any]:
    """What is kept under ``purpose`` for every live group."""
    return [kept[purpose] for kept in list(_ATTACHED.values()) if purpose in kept]


def is_member(group: object) -> bool:
    """False for what ``dist.new_group`` hands the ranks outside the new group instead of a group."""
    return group is not dist.GroupMember.NON_GROUP_MEMBER


def group_size(group: ProcessGroup) -> int:
    return dist.get_world_size(group=group)


def backends_of(group: ProcessGroup) -> dict[str, str]:
    """Which backend carries each device type's tensors over ``group``: ``{"cpu": "gloo", "cuda": "nccl"}``, from its
    backend config (``get_backend`` says "undefined" after an ``init_process_group()`` that named no backend)."""
    return dict(pair.strip().split(":", 1) for pair in str(dist.get_backend_config(group)).split(",") if ":" in pair)


def comm_device(group: ProcessGroup, devices: Iterable[torch.device] | None = None) -> torch.device:
    """Where tensors sent over ``group`` must live (``choose_comm_device``) for tensors on ``devices`` (without
    them, a GPU-only group's is the current CUDA device)."""
    backends = backends_of(group)
    if devices is None:
        devices = [] if "cpu" in backends else [torch.device("cuda", torch.cuda.current_device())]
    return choose_comm_device(backends, devices)


def choose_comm_device(backends: dict[str, str], devices: Iterable[torch.device]) -> torch.device:
    """The device for communication buffers: the one CUDA device of ``devices`` where NCCL carries it (NCCL alone,
    or "cpu:gloo,cuda:nccl": a norm or flag made there never goes through host memory), else the CPU where the group
    takes CPU tensors (gloo), else a ``ValueError``. Pure."""
    distinct = sorted({torch.device(device) for device in devices}, key=str)
    on_one_gpu = len(distinct) == 1 and distinct[0].type == "cuda"
    if on_one_gpu and (backends.get("cuda") == "nccl" or "cpu" not in backends):
        return distinct[0]
    if "cpu" in backends:
        return torch.device("cpu")
    found = ", ".join(map(str, distinct)) or "none"
    named = ",".join(f"{device}:{backend}" for device, backend in backends.items())
    raise ValueError(
        f"the process group's backend ({named}) communicates tensors on one CUDA device per rank, but the parameters "
        f"are on: {found}; move the whole model to this rank's GPU (model.to(f'cuda:{{local_rank}}')), or use the "
        "gloo backend"
    )


def control_group(group: ProcessGroup) -> ProcessGroup:
    """A group over ``group``'s ranks for host values (agreements): ``group`` itself where gloo carries its CPU
    tensors, else its ``"control"`` gloo twin (NCCL would block the CPU on the GPU's queue)."""
    return group if backends_of(group).get("cpu") == "gloo" else gloo_twin(group, "control")
