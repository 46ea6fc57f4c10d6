"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): every rank saves and loads its fragments only.

Each parameter-shaped state tensor (Adam's moments, a master weight) is presented to DCP as a 1-D tensor of the
parameter's element count (memory order) of which this rank holds its fragment's range, with that range as DCP
chunk metadata. DCP writes each rank's pieces from their own memory, and a load under another world size or
partition reads, for each rank, exactly the byte ranges that overlap its new fragments. Step counts and other
per-parameter scalars are saved by every rank that holds a piece of the parameter (DCP keeps one copy), the
hyperparameters once. No rank ever holds more than its own shard. Zero-sized parameters are left out (their state
holds nothing). A load needs, for every fragment the new optimizer holds, the state the checkpoint's optimizer had
for it: a parameter that had no state when saved (it never had a gradient) makes ``dcp.load`` report the key.

Usage (the method names are the contract)::

    dcp.save({"model": model.state_dict(), "optim": zero.sharded_state_dict()}, checkpoint_id=path)
    state = {"optim": zero.sharded_state_dict()}      # on the new optimizer, any world size or partition
    dcp.load(state, checkpoint_id=path)
    zero.load_sharded_state_dict(state["optim"])
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from distoptim._flat import flat_view
from distoptim.zero.shard import MASTER_KEY, LocalShard, LocalTensor

__all__ = ["FragmentTensor", "load_param_groups", "sharded_state", "template_state"]

PARAM_GROUPS = "param_groups"
LAYOUTS = "param_layouts"  # each parameter's (shape, strides): what turns a saved 1-D tensor back into its shape


class FragmentTensor(Tensor):
    """A 1-D tensor of ``numel`` elements of which this rank holds ``local`` from ``offset``: what DCP needs to save
    and load one rank's piece of a parameter-shaped tensor (DCP's checkpointable protocol, as DTensor implements
    it). It holds no data of its own and supports no operation."""

    _local: Tensor
    _offset: int

    @staticmethod
    def __new__(cls, local: Tensor, offset: int, numel: int) -> FragmentTensor:
        wrapper = Tensor._make_wrapper_subclass(cls, (numel,), dtype=local.dtype, device=local.device)
        wrapper._local, wrapper._offset = local, offset
        return wrapper

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        raise NotImplementedError(f"{func} is not supported on a checkpoint fragment (save or load it with DCP)")

    def _chunks(self) -> list[ChunkStorageMetadata]:
        if self._local.numel() == 0:
            return []
        return [ChunkStorageMetadata(offsets=torch.Size([self._offset]), sizes=torch.Size([self._local.numel()]))]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self._local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.size()),
            )
            for chunk in self._chunks()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self._chunks()

    def __get_tensor_shard__(self, index: MetadataIndex) -> Tensor:
        return self._local

    def __repr__(self) -> str:  # type: ignore[override]
        return f"FragmentTensor(numel={self.numel()}, offset={self._offset}, local={self._local.numel()})"


def sharded_state(
    shard: LocalShard, state: dict[Tensor, dict[str, Any]], param_groups: bytes, params: list[Tensor]
) -> dict[str, Any]:
    """``{"state.<index>.<name>": piece or scalar, "param_groups": pickled, "param_layouts": pickled}`` for this
    rank's fragments."""
    layouts = pickle.dumps([(tuple(p.shape), tuple(p.stride())) for p in params])
    exported: dict[str, Any] = {PARAM_GROUPS: param_groups, LAYOUTS: layouts}
    for local in (t for group in shard.groups for t in group if t.param.numel() > 0):  # zero-sized: nothing to keep
        entry = dict(state.get(local.tensor, {}))
        if local.master:
            entry[MASTER_KEY] = local.tensor
        for name, value in entry.items():
            exported[f"state.{local.index}.{name}"] = _as_saved(value, local)
    return exported


def _as_saved(value: Any, local: LocalTensor) -> Any:
    """A parameter-shaped tensor (or a fragment's 1-D piece of one) as a fragment of the whole; anything else as is."""
    if not isinstance(value, Tensor) or value.dim() == 0:
        return value
    piece = flat_view(value) if local.whole else value
    return FragmentTensor(piece.detach(), local.offset, local.param.numel())


def template_state(shard: LocalShard, step: Callable[[], Any], state: dict[Tensor, dict[str, Any]]) -> None:
    """Create the state of every local tensor that has none (a fresh optimizer, before a load) with one step of the
    local optimizer on zero gradients; every tensor's value and ``.grad`` are as before afterwards (DCP loads into
    existing tensors, which this makes)."""
    locals_ = [t for group in shard.groups for t in group]
    missing = [t for t in locals_ if not state.get(t.tensor)]
    if not missing:
        return
    values = [t.tensor.detach().clone() for t in missing]
    grads = [t.tensor.grad for t in locals_]
    for local in locals_:  # only the missing ones take part in the step
        local.tensor.grad = torch.zeros_like(local.tensor) if local in missing else None
    try:
        step()
    finally:
        with torch.no_grad():
            for local, value in zip(missing, values):
                local.tensor.copy_(value)
        for local, grad in zip(locals_, grads):
            local.tensor.grad = grad


def load_param_groups(saved: dict[str, Any], count: int) -> list[dict[str, Any]]:
    """The hyperparameters of each of ``count`` param groups that a loaded sharded checkpoint carries."""
    payload = saved.get(PARAM_GROUPS) if isinstance(saved, dict) else None
    if not isinstance(payload, bytes) or not payload:
        raise ValueError(
            "this is not a loaded sharded optimizer state: pass the dict that zero.sharded_state_dict() returned, "
            "after dcp.load(...) filled it in"
        )
    groups: list[dict[str, Any]] = pickle.loads(payload)
    if len(groups) != count:
        raise ValueError(f"the checkpoint has {len(groups)} param groups but this optimizer has {count}")
    return [{k: v for k, v in group.items() if k != "params"} for group in groups]
