"""Noise measured, not assumed: the allowance of an inexact program (a bf16 layer, a clip, 3 ranks, Newton-Schulz)
comes from a second oracle run in the same session that differs from the first only by rounding.

``run_program`` (interpret.py) runs an inexact program twice on every rank. First as its ``twin``: the oracle's
local gradients moved one ulp up (``one_ulp_up``, a tensor hook on each parameter: every summand of every reduction
moves, so a sum that cancels moves by its summands' ulps, as a reduction in another order does; a bf16 gradient by
a bf16 ulp), its values recorded at each comparison. Then for real: each element of the subject within ``FACTOR``
times the twin's distance from the oracle there (or that distance's rms over the tensor, if larger), plus
``floor`` (``FLOOR_ULPS`` ulps of the element and of its tensor's mean magnitude, per step). The subject's
trajectory never depends on the oracle, so both passes see the same subject. Neither oracle is ever aligned to the
subject: an allowance is what the twin drifted since the start, never carried past an alignment, and a slow drift
of the subject adds up until it leaves the allowance.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

# the subject may be this many times as far from the oracle as the twin is, at the element or in its tensor's rms
# (a rounding difference lands on other elements in the subject than in the twin: bf16 sums, near-zero gradients)
FACTOR = 8.0
FLOOR_ULPS = 4  # ulps (of the element, plus of its tensor's mean magnitude) allowed per unaligned step regardless
Record = dict[str, Tensor]  # what a pass saw at each comparison: "where|what" -> the oracle's value


def one_ulp_up(grad: Tensor) -> Tensor:
    """The twin's gradient hook: every element one ulp of its dtype up (toward +inf)."""
    if grad.is_sparse:
        grad = grad.coalesce()
        values = grad.values()
        up = torch.nextafter(values, torch.full_like(values, math.inf))
        return torch.sparse_coo_tensor(grad.indices(), up, grad.size())
    return torch.nextafter(grad, torch.full_like(grad, math.inf))


def floor(want: Tensor, steps: int) -> Tensor:
    """What any element may be off without a measurement: ``FLOOR_ULPS`` ulps of itself and of its tensor's mean
    magnitude, per unaligned step (the twin can be exactly right where the subject rounds once)."""
    want = want.detach().float()
    eps = torch.finfo(want.dtype).eps
    scale = want.abs().mean() if want.numel() else torch.tensor(0.0)
    return steps * FLOOR_ULPS * eps * (want.abs() + scale)


def allowance(want: Tensor, twin: Tensor | None, steps: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Per element: ``FACTOR`` times the twin's distance from the oracle (at least its rms over the tensor), plus
    the floor in ``dtype``'s ulps."""
    want = want.detach().float()
    ulps = floor(want, steps) * (torch.finfo(dtype).eps / torch.finfo(torch.float32).eps)
    if twin is None or twin.shape != want.shape:
        return ulps
    apart = (twin.detach().float() - want).abs()
    spread = apart.square().mean().sqrt() if apart.numel() else apart.sum()
    return FACTOR * torch.maximum(apart, spread) + ulps


def excess(where: str, got: Tensor, want: Tensor, allowed: Tensor) -> str:
    """'' if every element of ``got`` is within ``allowed`` of ``want``, else what is off."""
    a, b = got.detach().float(), want.detach().float()
    if a.shape != b.shape:
        return f"{where}: shapes {tuple(a.shape)} != {tuple(b.shape)}"
    off = (a - b).abs()
    bad = ~(off <= allowed)  # NaN counts as off
    if not bool(bad.any()):
        return ""
    worst = int(torch.where(bad, off - allowed, torch.zeros_like(off)).nan_to_num(math.inf).argmax())
    return (
        f"{where}: {int(bad.sum())} / {off.numel()} elements off, {float(off.view(-1)[worst]):.3g} where "
        f"{float(allowed.view(-1)[worst]):.3g} is allowed (the twin's distance times {FACTOR:g}, with the floor)"
    )


def excess_norm(where: str, got: Tensor, want: Tensor, twin: Tensor | None, steps: int) -> str:
    """A Muon matrix in Frobenius norm (Newton-Schulz in bf16 moves a few elements by much of themselves when the
    gradient's last bits differ, the twin's others than the subject's): within ``FACTOR`` times the twin's
    distance, plus the floor's norm."""
    b = want.detach().float()
    off = float((got.detach().float() - b).norm())
    allowed = float(floor(b, steps).norm())
    if twin is not None and twin.shape == b.shape:
        allowed += FACTOR * float((twin.detach().float() - b).norm())
    if not off <= allowed:
        return f"{where}: {off:.3g} off in Frobenius norm where the twin measured {allowed:.3g} with the floor"
    return ""


class Recorder:
    """What the twin pass keeps: the oracle's value at each comparison point."""

    def __init__(self) -> None:
        self.values: Record = {}

    def keep(self, key: str, value: Any) -> None:
        self.values[key] = torch.as_tensor(value).detach().clone()
