"""Large host buffers of distoptim's own (gradient buckets, the owned gradient, receive staging) in anonymous
mappings of their own, returned to the OS when freed: from glibc's heap they would fragment it and raise its mmap
threshold (``benchmarks/README.md``, peak RSS). Their owners reuse them rather than map new ones each backward: a
fresh mapping costs a page fault per 4 KiB on first write.
"""

from __future__ import annotations

import mmap

import torch
from torch import Tensor

__all__ = ["MAPPED_BYTES", "Spares", "host_zeros"]

MAPPED_BYTES = 1 << 20
"""Host buffers of at least this size get a mapping of their own (smaller ones: torch's allocator)."""


def host_zeros(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A flat tensor of ``numel`` zeros; on the host and at least ``MAPPED_BYTES``, in an anonymous mapping of its
    own (zeroed by the OS), unmapped once the tensor and every view of it are gone."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < MAPPED_BYTES:
        return torch.zeros(numel, dtype=dtype, device=device)
    private = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # not shared with forked children
    return torch.frombuffer(private, dtype=dtype, count=numel)


class Spares:
    """Host buffers one owner keeps for reuse between its allocations of similar sizes."""

    def __init__(self) -> None:
        self.kept: list[Tensor] = []

    def zeros(self, numel: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
        """``numel`` zeros and the buffer they are a view of (for ``keep``): the smallest kept buffer that fits, else
        a new one (the kept ones freed first)."""
        fits = [b for b in self.kept if b.numel() >= numel and b.dtype == dtype and b.device == device]
        if not fits:
            self.kept.clear()
            base = host_zeros(numel, dtype, device)
            return base, base
        base = min(fits, key=Tensor.numel)
        self.kept = [b for b in self.kept if b is not base]
        return base[:numel].zero_(), base

    def keep(self, base: Tensor | None, room: int) -> None:
        """Keep ``base`` (if any) for a later ``zeros`` while fewer than ``room`` are kept."""
        if base is not None and len(self.kept) < room:
            self.kept.append(base)
