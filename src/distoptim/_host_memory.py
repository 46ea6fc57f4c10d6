"""Large host buffers of distoptim's own (gradient buckets, the owned gradient, receive staging) in mappings of
their own, returned to the OS when freed.

Why: these buffers are allocated and freed every backward. From glibc's heap they fragment it and stay resident:
glibc raises its mmap threshold to the size of the largest mapped block freed so far (up to 32 MiB), after which
blocks below it come from the heap, whose freed memory the next, differently ordered allocations cannot reuse
(``benchmarks/README.md``, peak RSS). A mapping of their own keeps them off the heap and out of that threshold,
without touching the allocator's settings for the rest of the program. Accelerator tensors and small buffers go
through torch's allocator as usual.
"""

from __future__ import annotations

import mmap

import torch
from torch import Tensor

__all__ = ["MAPPED_BYTES", "host_zeros"]

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
