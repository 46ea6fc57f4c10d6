"""Packing tensors into one flat buffer and back; 1-D views of dense tensors in memory order (DDP's bucket order)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["copy_each_", "flat_view", "is_dense", "owns_its_memory", "pack", "unpack_", "view_like"]


def pack(tensors: Sequence[Tensor]) -> Tensor:
    """The tensors' elements one after another in a 1-D tensor."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unpack_(flat: Tensor, tensors: Sequence[Tensor]) -> None:
    """Copy ``flat`` back into ``tensors`` in place (their storage is kept), in ``pack``'s order."""
    targets = [t.detach() for t in tensors]
    views = torch.split(flat[: sum(t.numel() for t in targets)], [t.numel() for t in targets])
    torch._foreach_copy_(targets, [view.view_as(target) for view, target in zip(views, targets)])


def copy_each_(targets: list[Tensor], sources: list[Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for every ``i``, in one ``_foreach_copy_`` call and outside autograd."""
    if targets:
        with torch.no_grad():
            torch._foreach_copy_(targets, sources)


def is_dense(tensor: Tensor) -> bool:
    """Whether ``tensor`` fills one stretch of memory without gaps or overlaps (contiguous, channels_last, a
    transposed matrix...): c10's non-overlapping-and-dense rule, by which DDP lays parameters into its buckets."""
    if tensor.is_contiguous():  # the common case, decided in C (read per parameter in every overlapped backward)
        return True
    expected = 1
    for stride, size in sorted((stride, size) for stride, size in zip(tensor.stride(), tensor.shape) if size > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def owns_its_memory(tensor: Tensor) -> bool:
    """Whether no other tensor shares ``tensor``'s storage (False where torch cannot tell)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None or tensor._base is not None:
        return False
    storage = tensor.untyped_storage()  # this handle holds a reference of its own
    return bool(count(storage._cdata) == 2)


def flat_view(tensor: Tensor) -> Tensor:
    """A dense ``tensor``'s elements in memory order as a 1-D view (detached)."""
    tensor = tensor.detach()
    if tensor.is_contiguous():
        return tensor.view(-1)
    if not is_dense(tensor):
        raise ValueError(f"a tensor of shape {tuple(tensor.shape)} and strides {tensor.stride()} is not dense")
    return tensor.as_strided((tensor.numel(),), (1,), tensor.storage_offset())


def view_like(buffer: Tensor, offset: int, param: Tensor) -> Tensor:
    """``param``'s elements at ``buffer[offset:]`` laid out as DDP lays a parameter into its bucket: with the
    parameter's own strides when it is dense (``_flat.is_dense``), row-major otherwise."""
    if is_dense(param):
        return buffer.as_strided(param.shape, param.stride(), buffer.storage_offset() + offset)
    return buffer[offset : offset + param.numel()].view(param.shape)
