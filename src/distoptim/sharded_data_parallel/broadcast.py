"""The initial broadcast of ``ShardedDataParallel``: every rank starts from the first rank's parameters and buffers
(as DDP's constructor does), packed in capped batches so that the model is never copied whole."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from distoptim._flat import flat_view, is_dense, pack, unpack_
from distoptim.comm import collectives as comm

__all__ = ["broadcast_from_first"]


def broadcast_from_first(tensors: Sequence[Tensor], groups: Sequence[comm.Group], cap_bytes: int) -> None:
    """Every rank's ``tensors`` made the same: broadcast over each group in turn from its first rank, the replicas
    first (each replica group takes its first member's; the shard groups' first members, one replica group, then hold
    one value, which each shard group takes), whatever ranks the groups hold. Packed per (device, dtype) in batches
    of at most ``cap_bytes``, a larger dense tensor broadcast in place: never a second copy of the model."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for tensor in tensors:
        if tensor.numel():
            by_kind.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    with torch.no_grad():
        for same_kind in by_kind.values():
            for batch in _batches(same_kind, cap_bytes):
                alone = len(batch) == 1 and is_dense(batch[0])
                flat = flat_view(batch[0]) if alone else pack(batch)
                for group in reversed(groups):
                    comm.broadcast_slices(flat, [(0, 0, flat.numel())], group)
                if not alone:
                    unpack_(flat, batch)


def _batches(tensors: Sequence[Tensor], cap_bytes: int) -> Iterator[list[Tensor]]:
    """``tensors`` in order, in runs of at most ``cap_bytes`` (a larger tensor alone)."""
    batch: list[Tensor] = []
    filled = 0
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if batch and filled + size > cap_bytes:
            yield batch
            batch, filled = [], 0
        batch.append(tensor)
        filled += size
    if batch:
        yield batch
