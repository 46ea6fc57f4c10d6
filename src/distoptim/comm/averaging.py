"""The averagers' and hooks' collectives: ``all_reduce(x / n, SUM)``, dividing first as PyTorch's do (fp16 does
not overflow), so results match theirs bit for bit."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from distoptim._flat import pack, unpack_
from distoptim.comm.agreement import run_agreed
from distoptim.comm.groups import default_group, group_size, is_member

__all__ = [
    "agree_on_settings",
    "allreduce_mean_async",
    "average_tensors_",
    "completed_future",
    "default_group",
    "group_by_device",
    "group_size",
    "node_subgroup_size",
    "split_group",
]


def agree_on_settings(
    settings: dict[str, Any], check: Callable[[], None], process_group: ProcessGroup | None, what: str
) -> None:
    """Raise on every rank unless ``check()`` (which raises ``TypeError`` or ``ValueError``) passed on every rank of
    the group and all built ``what`` with equal ``settings`` (ranks averaging on different schedules would hang)."""
    if process_group is None and not dist.is_initialized():
        check()  # its error before default_group's: there is no group to agree over
    group = default_group(process_group)
    if not is_member(group):
        check()
        return
    fix = "every rank must pass the same period(s) and warmup_steps, or they average at different steps"
    fingerprint = {f"{{}} {k}": v for k, v in settings.items()}
    run_agreed(check, group, what, (TypeError, ValueError), lambda _: fingerprint, fix)


def split_group(group: ProcessGroup, size: int) -> ProcessGroup:
    """Cut ``group`` into consecutive subgroups of ``size`` ranks (a collective); return the one holding this rank."""
    if size == group_size(group):
        return group
    subgroup, _ = dist.new_subgroups(group_size=size, group=group)  # type: ignore[no-untyped-call]
    assert isinstance(subgroup, ProcessGroup)
    return subgroup


def node_subgroup_size(total: int, environ: Mapping[str, str] | None = None) -> int:
    """The ranks of a ``total``-rank group on this node: ``LOCAL_WORLD_SIZE``, or ``total`` if unknown or uneven."""
    raw = (os.environ if environ is None else environ).get("LOCAL_WORLD_SIZE", "")
    try:
        local = int(raw)
    except ValueError:
        return total
    if local < 1 or local > total or total % local != 0:
        warnings.warn(
            f"LOCAL_WORLD_SIZE={raw} does not split a group of {total} ranks into equal nodes; "
            "all-reducing gradients over the whole group after warm-up. Pass subgroup= to choose explicitly.",
            stacklevel=3,
        )
        return total
    return local


def group_by_device(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Split ``tensors`` into runs sharing a device, keeping first-appearance order (same on every rank)."""
    runs: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        runs.setdefault(tensor.device, []).append(tensor)
    return list(runs.values())


@torch.no_grad()
def average_tensors_(tensors: Sequence[torch.Tensor], group: ProcessGroup) -> None:
    """Replace every tensor by its mean over ``group``, in place: one all-reduce per device, in the promoted dtype
    (torch's ``average_parameters``' arithmetic). Ranks outside ``group`` leave theirs untouched."""
    if not is_member(group):
        return
    size = group_size(group)
    for run in group_by_device([t for t in tensors if t.numel() > 0]):  # every rank skips the same ones
        flat = pack(run).div_(size)
        dist.all_reduce(flat, group=group)
        unpack_(flat, run)


def allreduce_mean_async(tensor: torch.Tensor, group: ProcessGroup) -> torch.futures.Future[torch.Tensor]:
    """Average ``tensor`` over ``group`` in place, asynchronously; the future yields ``tensor`` (a DDP hook result)."""
    tensor.div_(group_size(group))
    work = dist.all_reduce(tensor, group=group, async_op=True)
    assert work is not None  # async_op=True always returns a Work
    future: torch.futures.Future[torch.Tensor] = work.get_future().then(lambda fut: fut.value()[0])
    return future


def completed_future(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future already holding ``tensor`` (a DDP hook that communicates nothing)."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(tensor)
    return fut
