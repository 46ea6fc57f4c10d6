"""What a memory plan is made of: every parameter's shape, dtype, trainability and FSDP unit (a child of an
``nn.ModuleList``, else the root), from a model built on the meta device or a GPT-style parameter count."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from torch import nn

__all__ = ["ROOT_UNIT", "Inventory", "ParamSpec", "from_factory", "from_module", "load_factory", "transformer"]

ROOT_UNIT = 0
VOCAB = 50304  # GPT-2's vocabulary padded to a multiple of 64, as nanoGPT pads it
WIDTH_PER_LAYER = 128  # GPT-3's aspect ratio (6.7B: 32 layers of width 4096)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as the planner sees it: no data, only what decides its bytes and where it goes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    trainable: bool
    unit: int = ROOT_UNIT  # the FSDP unit holding it
    muon: bool = False  # stepped by Muon (``plan.memory.with_muon``), not by the plan's elementwise optimizer

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Inventory:
    """The parameters in ``model.parameters()`` order (the order an optimizer sees them) and how they were found."""

    params: tuple[ParamSpec, ...]
    description: str

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def cast(self, dtype: torch.dtype | None) -> Inventory:
        """Floating-point parameters in ``dtype`` (the dtype the model trains in); others as they are."""
        if dtype is None:
            return self
        params = tuple(replace(p, dtype=dtype) if p.dtype.is_floating_point else p for p in self.params)
        return Inventory(params, self.description)


def load_factory(spec: str) -> Callable[[], nn.Module]:
    """``"package.module:factory"`` -> the callable (imported, not called)."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"--model {spec!r}: expected 'package.module:factory' (a callable that returns an nn.Module)")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise ValueError(f"--model {spec!r}: cannot import {module_name!r}: {type(error).__name__}: {error}") from None
    factory: Any = module
    for part in attribute.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ValueError(f"--model {spec!r}: {module_name!r} has no attribute {attribute!r}")
    if not callable(factory):
        raise ValueError(f"--model {spec!r}: {attribute!r} is not callable")
    return cast(Callable[[], nn.Module], factory)


def from_factory(factory: Callable[[], nn.Module], name: str = "model") -> Inventory:
    """The inventory of ``factory()`` built under ``torch.device("meta")`` (shapes only)."""
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as error:
        raise ValueError(
            f"--model {name}: the factory failed on the meta device: {type(error).__name__}: {error}"
        ) from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {name}: the factory returned a {type(model).__name__}, not an nn.Module")
    return from_module(model, f"{name} ({type(model).__name__})")


def from_module(model: nn.Module, description: str) -> Inventory:
    """The parameters of ``model`` (shared ones once), each in its FSDP unit (the innermost ``nn.ModuleList`` child)."""
    units: dict[str, int] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            for child_name, _ in module.named_children():
                units[f"{name}.{child_name}." if name else f"{child_name}."] = len(units) + 1
    params = []
    for name, param in model.named_parameters():
        prefixes = [prefix for prefix in units if name.startswith(prefix)]
        unit = units[max(prefixes, key=len)] if prefixes else ROOT_UNIT
        params.append(ParamSpec(name, tuple(param.shape), param.dtype, param.requires_grad, unit))
    if not params:
        raise ValueError(f"{description} has no parameters")
    return Inventory(tuple(params), description)


def _block_numel(width: int) -> int:
    return 12 * width * width + 13 * width


def transformer(total: int, dtype: torch.dtype = torch.float32) -> Inventory:
    """``total`` parameters as a GPT-style transformer: the most layers ``L`` of width ``128 L`` that leave room for
    a tied embedding of ``VOCAB`` rows or more, which takes the rest (exact); below one layer, one flat tensor."""
    if total < 1:
        raise ValueError(f"--params must be at least 1, got {total}")
    layers = 0
    while (layers + 1) * _block_numel(width := WIDTH_PER_LAYER * (layers + 1)) + (2 + VOCAB) * width <= total:
        layers += 1
    if layers == 0:
        flat = ParamSpec("flat", (total,), dtype, True)
        return Inventory((flat,), f"{total:,} parameters as one flat tensor (too few for a transformer layer)")
    width = WIDTH_PER_LAYER * layers
    rows, rest = divmod(total - layers * _block_numel(width) - 2 * width, width)
    block = [
        ("ln_1.weight", (width,)), ("ln_1.bias", (width,)),
        ("attn.qkv.weight", (3 * width, width)), ("attn.qkv.bias", (3 * width,)),
        ("attn.proj.weight", (width, width)), ("attn.proj.bias", (width,)),
        ("ln_2.weight", (width,)), ("ln_2.bias", (width,)),
        ("mlp.fc.weight", (4 * width, width)), ("mlp.fc.bias", (4 * width,)),
        ("mlp.proj.weight", (width, 4 * width)), ("mlp.proj.bias", (width,)),
    ]  # fmt: skip
    params = [ParamSpec("embedding.weight", (rows, width), dtype, True)]
    for layer in range(layers):  # each block an FSDP unit of its own
        params += [ParamSpec(f"blocks.{layer}.{name}", shape, dtype, True, layer + 1) for name, shape in block]
    params += [ParamSpec("ln_f.weight", (width,), dtype, True), ParamSpec("ln_f.bias", (width,), dtype, True)]
    if rest:
        params.append(ParamSpec("head.bias", (rest,), dtype, True))
    description = (
        f"{total:,} parameters modelled as a GPT-style transformer: {layers} layer{'s' if layers > 1 else ''} "
        f"of width {width}, tied embedding {rows:,} x {width}{f' (+{rest} to make the total exact)' if rest else ''}; "
        "FSDP units: one per layer, the embedding and final norm in the root"
    )
    return Inventory(tuple(params), description)
