"""Optimizer-state bytes, measured from ``torch.optim`` itself: one step on tiny CPU tensors gives ``per_element``
and ``per_tensor`` bytes (a state format's with ZeRO's own codec); state not proportional to size is refused."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from distoptim.zero import codecs
from distoptim.zero.elementwise import is_elementwise

__all__ = ["OptimizerSpec", "StateCost", "resolve_optimizer", "state_cost"]

ALIASES: dict[str, tuple[str, dict[str, Any]]] = {"sgd-momentum": ("SGD", {"momentum": 0.9})}


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer class and the keyword arguments that decide its state (``momentum``, ``centered``...)."""

    cls: type[Optimizer]
    kwargs: tuple[tuple[str, Any], ...] = ()

    @property
    def name(self) -> str:
        settings = ", ".join(f"{key}={value!r}" for key, value in self.kwargs)
        return f"{self.cls.__name__}({settings})" if settings else self.cls.__name__


@dataclass(frozen=True)
class StateCost:
    """Bytes of state for a stepped tensor of ``n`` elements: ``per_element * n + per_tensor``. ``at_construction``:
    made when the optimizer is built, for frozen parameters too (Adagrad)."""

    per_element: float  # int8: a byte per element per moment
    per_tensor: int
    at_construction: bool = False
    per_block: int = 0  # int8: each started block of ``codecs.BLOCK`` elements, its fp32 scale per moment

    def bytes_for(self, numel: int) -> int:
        return round(self.per_element * numel) + self.per_block * -(-numel // codecs.BLOCK) + self.per_tensor


def resolve_optimizer(name: str, kwargs: Mapping[str, Any] | None = None) -> OptimizerSpec:
    """``"adamw"``, ``"AdamW"``, ``"sgd-momentum"``...: a ``torch.optim`` class by name (case-insensitive)."""
    name, defaults = ALIASES.get(name.lower(), (name, {}))
    settings = {**defaults, **(kwargs or {})}
    classes = {
        attribute.lower(): value
        for attribute in dir(torch.optim)
        if isinstance(value := getattr(torch.optim, attribute), type) and issubclass(value, Optimizer)
    }
    cls = classes.get(name.lower())
    if cls is torch.optim.Muon:
        raise ValueError(
            "Muon steps whole matrices, not every parameter: pass --muon (Muon on the blocks' matrices, "
            "--optimizer on the rest)"
        )
    if cls is None or not is_elementwise(cls):
        choices = ", ".join(sorted([*ALIASES, *(key for key, value in classes.items() if is_elementwise(value))]))
        raise ValueError(f"unknown optimizer {name!r}: choose one of {choices}")
    return OptimizerSpec(cls, tuple(sorted(settings.items())))


def state_cost(optimizer: OptimizerSpec, dtype: torch.dtype, state_format: str = "fp32") -> StateCost:
    """The state one step of ``optimizer`` leaves for a tensor stepped in ``dtype``, kept in ``state_format``."""
    return _measured(optimizer, dtype) if state_format == "fp32" else _encoded(optimizer, dtype, state_format)


@functools.cache
def _encoded(optimizer: OptimizerSpec, dtype: torch.dtype, state_format: str) -> StateCost:
    """Bytes per element and per started block, measured at 16 blocks, 16 blocks and one element, and 32 blocks."""
    muon = issubclass(optimizer.cls, torch.optim.Muon)  # matrices only
    small, one_more, large = (
        _state_bytes(optimizer, dtype, (1, n) if muon else (n,), fmt=state_format) for n in (4096, 4097, 8192)
    )
    blocks = 4096 // codecs.BLOCK
    per_element, uneven = divmod(large - small - blocks * (one_more - small), 4096 - blocks)
    per_block = one_more - small - per_element
    if uneven or per_block < 0:
        raise ValueError(f"{optimizer.name}'s {state_format} state is not blockwise-proportional; cannot plan it")
    per_tensor = small - 4096 * per_element - blocks * per_block
    return StateCost(per_element, per_tensor, _measured(optimizer, dtype).at_construction, per_block)


@functools.cache
def _measured(optimizer: OptimizerSpec, dtype: torch.dtype) -> StateCost:
    shapes = ((1, 3), (1, 7), (3, 5)) if issubclass(optimizer.cls, torch.optim.Muon) else ((3,), (7,), (3, 5))
    sizes = {shape: _state_bytes(optimizer, dtype, shape) for shape in shapes}
    three, seven, matrix = sizes.values()
    per_element, remainder = divmod(seven - three, 4)
    per_tensor = three - 3 * per_element
    cost = StateCost(per_element, per_tensor, _state_bytes(optimizer, dtype, shapes[0], step=False) > 0)
    if remainder or cost.bytes_for(15) != matrix or per_tensor < 0:
        raise ValueError(
            f"{optimizer.name}'s state is not proportional to its parameters' sizes (measured {sizes} bytes for "
            "those shapes); the planner cannot model it"
        )
    return cost


def _state_bytes(
    optimizer: OptimizerSpec, dtype: torch.dtype, shape: tuple[int, ...], step: bool = True, fmt: str = "fp32"
) -> int:
    """State bytes after one step on a tensor of ``shape`` (``step=False``: frozen, after construction) in ``fmt``."""
    param = torch.zeros(shape, dtype=dtype, requires_grad=step)
    try:
        stepper = optimizer.cls([param], **dict(optimizer.kwargs))
        if step:
            param.grad = torch.ones_like(param)
            stepper.step()
    except Exception as error:
        raise ValueError(
            f"cannot step {optimizer.name} on a {dtype} tensor to measure its state: {type(error).__name__}: {error}"
        ) from None
    entry = dict(stepper.state[param])
    for key in [k for k, v in entry.items() if fmt != "fp32" and codecs.is_encodable(k, v) and v.shape == param.shape]:
        entry.update(codecs.encode(key, entry.pop(key), fmt))
    return sum(value.numel() * value.element_size() for value in entry.values() if isinstance(value, torch.Tensor))
