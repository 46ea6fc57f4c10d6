"""Packing tensors into one flat buffer and back: how every collective here avoids one call per tensor."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["pack", "unpack_"]


def pack(tensors: Sequence[Tensor], out: Tensor | None = None) -> Tensor:
    """The tensors' elements one after another in a 1-D tensor (written into ``out`` when given)."""
    flat = [t.detach().reshape(-1) for t in tensors]
    return torch.cat(flat) if out is None else torch.cat(flat, out=out)


def unpack_(flat: Tensor, tensors: Sequence[Tensor]) -> None:
    """Copy ``flat`` back into ``tensors`` in place (their storage is kept), in ``pack``'s order."""
    targets = [t.detach() for t in tensors]
    views = torch.split(flat[: sum(t.numel() for t in targets)], [t.numel() for t in targets])
    torch._foreach_copy_(targets, [view.view_as(target) for view, target in zip(views, targets)])
