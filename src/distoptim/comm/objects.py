"""Picklable objects over a process group, as pickled bytes in uint8 tensors, length first (torch's own object
collectives need numpy, which distoptim does not depend on); ``release``, for gloo's worker thread."""

from __future__ import annotations

import pickle
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from distoptim.comm.groups import comm_device, group_size

__all__ = ["RELEASE_TIMEOUT_S", "all_gather_objects", "receive_object", "release", "send_object"]

RELEASE_TIMEOUT_S = 2.0


def release(*tensors: Tensor) -> None:
    """Return once no thread but the caller's holds ``tensors`` (CPU tensors of a finished blocking collective):
    gloo's worker drops them a moment after ``wait()``, taking the GIL, and aborts the process if the interpreter is
    finalizing by then. Gives up after ``RELEASE_TIMEOUT_S`` (a dead peer: the caller raises)."""
    deadline = None
    for tensor in tensors:
        while tensor._use_count() > 1:  # type: ignore[attr-defined]  # gloo's worker still holds it
            deadline = deadline or time.monotonic() + RELEASE_TIMEOUT_S
            if time.monotonic() > deadline:
                return
            time.sleep(1e-4)


def all_gather_objects(obj: Any, group: dist.ProcessGroup, device: torch.device | None = None) -> list[Any]:
    """Every rank's ``obj`` (small, picklable), on every rank; ``device``: ``comm_device(group)`` when None."""
    device = comm_device(group) if device is None else device
    mine = _to_bytes(obj, device)
    lengths = [torch.empty(1, dtype=torch.int64, device=device) for _ in range(group_size(group))]
    length = torch.tensor([mine.numel()], dtype=torch.int64, device=device)
    dist.all_gather(lengths, length, group=group)
    sizes = [int(length.item()) for length in lengths]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: mine.numel()] = mine
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded, group=group)
    if device.type == "cpu":  # gloo's thread lets go of them now, not while the interpreter exits (an abort)
        release(length, padded, *lengths, *gathered)
    return [_from_bytes(payload[:size]) for payload, size in zip(gathered, sizes)]


def send_object(obj: Any, to: int, group: dist.ProcessGroup, device: torch.device | None = None) -> None:
    """Send a picklable ``obj`` to group rank ``to``, which calls ``receive_object``; ``device`` as for receiving."""
    payload = _to_bytes(obj, comm_device(group) if device is None else device)
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=payload.device)
    destination = dist.get_global_rank(group, to)
    dist.send(length, dst=destination, group=group)
    dist.send(payload, dst=destination, group=group)


def receive_object(source: int, group: dist.ProcessGroup, device: torch.device | None = None) -> Any:
    """The object group rank ``source`` sends with ``send_object`` (``device``: the communication device)."""
    device = comm_device(group) if device is None else device
    origin = dist.get_global_rank(group, source)
    length = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(length, src=origin, group=group)
    payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.recv(payload, src=origin, group=group)
    return _from_bytes(payload)


def _to_bytes(obj: Any, device: torch.device) -> Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _from_bytes(payload: Tensor) -> Any:
    buffer = bytearray(payload.numel())
    torch.frombuffer(buffer, dtype=torch.uint8).copy_(payload)  # the tensor writes into the bytearray it wraps
    return pickle.loads(buffer)
