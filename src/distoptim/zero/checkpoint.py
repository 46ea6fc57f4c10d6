"""Optimizer-state formats and their movement: shards to one rank (consolidation), a global dict to shards (loading).

The global format is exactly ``torch.optim``'s: ``{"state": {index: {...}}, "param_groups": [{..., "params":
[indices]}]}`` with indices numbering all parameters group by group, so a consolidated dict loads into a plain
``torch.optim`` optimizer, and dicts from plain optimizers (or torch's own ZeroRedundancyOptimizer) load here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from distoptim._flat import pack
from distoptim.zero import comm

__all__ = ["GlobalState", "global_param_groups", "receive_state", "select_shard", "send_state"]

GlobalState = dict[int, dict[str, Any]]


@dataclass(frozen=True)
class _TensorSlot:
    """Where a state tensor travels: its bucket (device, dtype), its place in it, and its shape."""

    bucket: int
    offset: int
    shape: tuple[int, ...]
    device: str


def send_state(state: GlobalState, to: int, group: comm.Group, comm_device: torch.device) -> None:
    """Send this rank's shard to rank ``to``: a small skeleton as an object, tensors as one flat buffer per dtype."""
    buckets: list[list[Tensor]] = []
    keys: dict[torch.dtype, int] = {}
    sizes: list[int] = []

    def place(tensor: Tensor) -> _TensorSlot:
        bucket = keys.setdefault(tensor.dtype, len(buckets))
        if bucket == len(buckets):
            buckets.append([])
            sizes.append(0)
        slot = _TensorSlot(bucket, sizes[bucket], tuple(tensor.shape), str(tensor.device))
        buckets[bucket].append(tensor)
        sizes[bucket] += tensor.numel()
        return slot

    skeleton = {
        index: {key: place(value) if isinstance(value, Tensor) else value for key, value in entry.items()}
        for index, entry in state.items()
    }
    dtypes = sorted(keys, key=keys.__getitem__)
    comm.send_object((skeleton, [str(dtype) for dtype in dtypes], sizes), to, group)
    for tensors in buckets:
        flat = pack([t.to(comm_device) for t in tensors])
        comm.send_tensor(flat, to, group)


def receive_state(source: int, group: comm.Group, comm_device: torch.device) -> GlobalState:
    """Receive the shard that rank ``source`` sends with ``send_state``."""
    skeleton, dtype_names, sizes = comm.receive_object(source, group, comm_device)
    flats = []
    for name, size in zip(dtype_names, sizes):
        flat = torch.empty(size, dtype=getattr(torch, name.removeprefix("torch.")), device=comm_device)
        comm.receive_tensor(flat, source, group)
        flats.append(flat)

    def unpack(value: Any) -> Any:
        if not isinstance(value, _TensorSlot):
            return value
        numel = int(torch.Size(value.shape).numel())
        tensor = flats[value.bucket][value.offset : value.offset + numel].view(value.shape)
        return tensor.to(value.device) if value.device.startswith("cpu") else tensor

    return {index: {key: unpack(value) for key, value in entry.items()} for index, entry in skeleton.items()}


def global_param_groups(param_groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``param_groups`` with parameters replaced by their global indices, as ``torch.optim`` saves them."""
    saved, next_index = [], 0
    for group in param_groups:
        count = len(group["params"])
        saved.append(
            {**{k: v for k, v in group.items() if k != "params"}, "params": list(range(next_index, next_index + count))}
        )
        next_index += count
    return saved


def select_shard(
    state_dict: dict[str, Any], param_groups: Sequence[dict[str, Any]]
) -> tuple[dict[Tensor, dict[str, Any]], list[dict[str, Any]]]:
    """Match a saved global dict to ``param_groups``: per-parameter state (by tensor) and per-group hyperparameters.

    Raises a ``ValueError`` saying what does not match when the dict was saved for a different set of parameters.
    """
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("expected an optimizer state dict with 'state' and 'param_groups' keys")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"the state dict has {len(saved_groups)} param groups but this optimizer has {len(param_groups)}"
        )
    by_param: dict[Tensor, dict[str, Any]] = {}
    for number, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"param group {number} has {len(saved['params'])} parameters in the state dict "
                f"but {len(group['params'])} in this optimizer"
            )
        for index, param in zip(saved["params"], group["params"]):
            if index in state_dict["state"]:
                by_param[param] = state_dict["state"][index]
    hyperparameters = [{k: v for k, v in saved.items() if k != "params"} for saved in saved_groups]
    return by_param, hyperparameters
