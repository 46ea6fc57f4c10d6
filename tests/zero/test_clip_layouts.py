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


def _scale_body(rank: int, world_size: int) -> list[float]:
    """A float ``grad_scale`` that is no power of two, under a bf16 default dtype: the norm of the unscaled gradient."""
    scale = 1000.0 / 3
    norms = []
    for default in (torch.float32, torch.bfloat16):
        net = torch.nn.Linear(8, 4)
        zero = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
        net.weight.grad, net.bias.grad = torch.full((4, 8), scale), torch.full((4,), scale)  # unscaled: all ones
        torch.set_default_dtype(default)
        try:
            norms.append(float(zero.clip_grad_norm_(1.0, grad_scale=scale)))
        finally:
            torch.set_default_dtype(torch.float32)
    return norms


def test_a_float_grad_scale_is_kept_in_fp32_whatever_the_default_dtype() -> None:
    for norms in run_on_ranks(_scale_body, 2):
        assert norms == [6.0, 6.0], norms  # sqrt(36 ones)
