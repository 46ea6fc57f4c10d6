"""ShardedDataParallel's own large host buffers (the owned gradient, the gradient buckets, gloo's receive staging) live
in mappings of their own, not in glibc's heap, where their churn every step fragments it and stays resident: freed,
they leave glibc's books unchanged, and training with them still matches DDP + the plain optimizer."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer
from tests._dist import run_on_ranks

_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keep")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]  # glibc's struct mallinfo2, size_t each


def _glibc_in_use() -> int:
    """Bytes glibc's malloc has handed out and not had back (heap and its own mappings, every arena)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 512))


def _body(rank: int, world_size: int) -> tuple[int, int]:
    model, reference = _model(), _model()
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, partition="even", parameters_as_bucket_view=True, lr=0.01
    )
    sdp = ShardedDataParallel(model, zero, bucket_cap_mb=2)
    ddp = DDP(reference)
    plain = torch.optim.AdamW(reference.parameters(), lr=0.01)
    freed = owned = 0
    for step in range(3):
        data = torch.randn(8, 512, generator=torch.Generator().manual_seed(100 * step + rank))
        zero.zero_grad()
        sdp(data).square().mean().backward()
        zero.step()
        plain.zero_grad()
        ddp(data).square().mean().backward()
        plain.step()
        assert sdp.gradients is not None
        owned = sum(t.numel() * t.element_size() for t in sdp.gradients.owned if t is not None)
        before = _glibc_in_use()
        zero.zero_grad()  # frees the owned gradient (and nothing else of this size)
        freed = max(freed, before - _glibc_in_use())
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs)
    return freed, owned


@pytest.mark.skipif(ctypes.util.find_library("c") is None, reason="needs glibc's mallinfo2")
def test_the_owned_gradient_is_not_glibc_heap_and_training_matches_ddp() -> None:
    for freed, owned in run_on_ranks(_body, 2):
        assert owned >= 2 << 20, owned  # large enough to be mapped: the check below can fail
        assert freed < owned // 8, f"zero_grad() gave glibc back {freed} bytes of a {owned}-byte owned gradient"


def _allocations_body(rank: int, world_size: int) -> list[int]:
    import distoptim.comm.p2p as p2p
    import distoptim.sharded_data_parallel.gradients as gradients

    model, reference = _model(), _model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01)
    sdp = ShardedDataParallel(model, zero, bucket_cap_mb=2)
    ddp = DDP(reference)
    plain = torch.optim.AdamW(reference.parameters(), lr=0.01)
    calls = [0]

    def counted(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        calls[0] += 1
        return torch.zeros(numel, dtype=dtype, device=device)

    gradients.host_zeros = p2p.host_zeros = counted  # type: ignore[assignment]
    per_iteration = []
    for step in range(4):
        data = torch.randn(8, 512, generator=torch.Generator().manual_seed(100 * step + rank))
        calls[0] = 0
        zero.zero_grad()
        sdp(data).square().mean().backward()
        zero.step()
        per_iteration.append(calls[0])
        plain.zero_grad()
        ddp(data).square().mean().backward()
        plain.step()
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, theirs)
    return per_iteration


def test_bucket_buffers_and_staging_are_reused() -> None:
    """Fresh mappings cost a page fault per 4 KiB on first write: a bucket's buffer is reused by the later buckets of
    the same backward, and gloo's receive staging by later reductions. The owned gradient and the first buckets are
    mapped anew each backward, so the forward and the backward's start hold none of them."""
    for per_iteration in run_on_ranks(_allocations_body, 2):
        assert per_iteration[1] < per_iteration[0], per_iteration  # the staging, kept from the first iteration
        assert per_iteration[1:] == [per_iteration[1]] * 3, f"host buffers allocated per iteration: {per_iteration}"
