"""Clipping a gradient laid out unlike its split parameter (a hand-set ``.grad`` of a column-major weight)."""

from __future__ import annotations

import torch

from distoptim import ZeroRedundancyOptimizer
from tests._dist import run_on_ranks


def _body(rank: int, world_size: int) -> None:
    weights = [torch.arange(48.0).reshape(6, 8).t().contiguous().t() / 10 for _ in range(2)]  # column-major
    for weight in weights:
        weight.requires_grad_(True)
    ours, plain = weights
    zero = ZeroRedundancyOptimizer([ours], torch.optim.SGD, lr=0.5, partition="even")
    reference = torch.optim.SGD([plain], lr=0.5)
    assert len(zero.fragments_of(ours)) == world_size  # split across the ranks
    for param in weights:
        param.grad = torch.ones(6, 8)  # row-major: unlike the parameter
    norm = zero.clip_grad_norm_(0.5)
    want = torch.nn.utils.clip_grad_norm_([plain], 0.5)
    torch.testing.assert_close(norm, want)
    zero.step()
    reference.step()
    torch.testing.assert_close(ours, plain)  # the norm summed by pieces: an ulp apart, not 0.46 (unclipped)


def test_a_gradient_laid_out_unlike_its_split_parameter_is_clipped() -> None:
    run_on_ranks(_body, 2)
