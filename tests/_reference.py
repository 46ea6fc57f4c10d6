"""Shared pieces for parity tests: deterministic parameters and gradients, and the reference comparison."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "MasterWeightsReference",
    "assert_same_tensors",
    "averaged_gradients",
    "flatten",
    "make_params",
    "set_gradients",
]

# (shape, dtype, requires_grad) of the parameters most tests use: two groups, a frozen one, a bf16 one.
MODEL_SPEC: list[list[tuple[tuple[int, ...], torch.dtype, bool]]] = [
    [((16, 8), torch.float32, True), ((16,), torch.float32, True), ((8, 8), torch.float32, False)],
    [((4, 16), torch.float32, True), ((6,), torch.bfloat16, True)],
]


def make_params(
    spec: Sequence[Sequence[tuple[tuple[int, ...], torch.dtype, bool]]] = MODEL_SPEC,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> list[list[Tensor]]:
    """The same parameters on every rank (seeded), grouped as ``spec`` says."""
    generator = torch.Generator().manual_seed(seed)
    return [
        [
            torch.randn(shape, generator=generator).to(device=device, dtype=dtype).requires_grad_(trainable)
            for shape, dtype, trainable in group
        ]
        for group in spec
    ]


def flatten(groups: Sequence[Sequence[Tensor]]) -> list[Tensor]:
    return [p for group in groups for p in group]


def local_gradients(params: Sequence[Tensor], rank: int, step: int) -> list[Tensor]:
    """A different gradient on every rank and step, for the trainable parameters (None for frozen ones)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return [
        torch.randn(p.shape, generator=generator).to(dtype=p.dtype, device=p.device) if p.requires_grad else None
        for p in params
    ]


def averaged_gradients(params: Sequence[Tensor], rank: int, step: int, group: Any = None) -> list[Tensor | None]:
    """What DDP would leave in ``.grad``: this rank's gradients averaged over the group (one all_reduce each)."""
    grads = local_gradients(params, rank, step)
    size = dist.get_world_size(group)
    for grad in grads:
        if grad is not None:
            dist.all_reduce(grad, group=group)
            grad.div_(size)
    return grads


def assert_same_tensors(actual: Sequence[Tensor], expected: Sequence[Tensor], what: str) -> None:
    assert len(actual) == len(expected), f"{what}: {len(actual)} vs {len(expected)} tensors"
    for index, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(a.detach(), e.detach(), rtol=0, atol=0, msg=lambda m, i=index: f"{what}[{i}]: {m}")


def set_gradients(grads: Sequence[Tensor | None], *copies: Sequence[Tensor]) -> None:
    """Give each copy of the parameters its own clone of ``grads`` (None stays None)."""
    for params in copies:
        for param, grad in zip(params, grads, strict=True):
            param.grad = None if grad is None else grad.clone()


class MasterWeightsReference:
    """The plain optimizer on the gradients DDP left in ``.grad``: over fp32 copies of the low-precision parameters
    when ``master`` (copied back after each step), clipping as ``torch.nn.utils.clip_grad_norm_`` does with the norm
    accumulated in fp32."""

    def __init__(
        self,
        params: Sequence[Tensor],
        groups: list[dict[str, Any]],
        optimizer_class: type,
        kwargs: dict[str, Any],
        master: bool,
    ) -> None:
        self.params = list(params)
        self.stepped = [
            p.detach().float().requires_grad_() if master and p.dtype != torch.float32 else p for p in self.params
        ]
        by_param = dict(zip(map(id, self.params), self.stepped))
        self.optimizer = optimizer_class(
            [{**g, "params": [by_param[id(p)] for p in g["params"]]} for g in groups], **kwargs
        )

    def step(self, clip: tuple[float, float] | None) -> Tensor | None:
        """Clip (``(max_norm, norm_type)``, or None) and step; return the total norm before clipping."""
        grads = [p.grad for p in self.params if p.grad is not None]
        total = None
        if clip is not None:
            max_norm, norm_type = clip
            norms = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads])
            total = norms.amax() if math.isinf(norm_type) else torch.linalg.vector_norm(norms, norm_type)
            torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
        for param, stepped in zip(self.params, self.stepped):
            if stepped is not param:
                stepped.grad = None if param.grad is None else param.grad.float()
        self.optimizer.step()
        with torch.no_grad():
            for param, stepped in zip(self.params, self.stepped):
                if stepped is not param:
                    param.copy_(stepped)
        return total
