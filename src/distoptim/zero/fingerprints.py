"""What every rank must agree on, as plain data: at construction the settings, groups and parameters
(``fingerprint``), at each step the trainable parameters and hyperparameters (``step_fingerprint``). Values are
made canonical (``_canonical``) so that ranks meaning the same compare equal, and nothing is read off a device."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from distoptim.comm.agreement import STEPPING_ONLY, Fingerprint
from distoptim.zero.elementwise import class_name

__all__ = ["fingerprint", "step_fingerprint"]

ParamGroups = list[dict[str, Any]]


def fingerprint(
    groups: ParamGroups, defaults: dict[str, Any], settings: dict[str, Any] | None = None, first_group: int = 0
) -> Fingerprint:
    """What every rank must agree on: ``settings``, the groups' sizes and hyperparameters (``defaults`` filled in),
    and each parameter's shape, dtype, device type and trainability. Groups are numbered from ``first_group``."""
    entries: Fingerprint = {f"settings: {key!r} {{}}": _canonical(value) for key, value in (settings or {}).items()}
    if settings is not None:
        entries["{} param groups"] = len(groups)
    for index, group in enumerate(groups, start=first_group):
        entries[f"param group {index} has {{}} parameters"] = len(group["params"])
        hyperparameters = {**defaults, **{k: v for k, v in group.items() if k != "params"}}
        for key in sorted(hyperparameters):
            entries[f"param group {index}: {key!r} {{}}"] = _canonical(hyperparameters[key])
        for position, p in enumerate(group["params"]):
            label = f"param group {index}, parameter {position}: (shape, dtype, device, requires_grad) {{}}"
            entries[label] = (tuple(p.shape), str(p.dtype), p.device.type, bool(p.requires_grad))
            entries[f"param group {index}, parameter {position}: strides {{}}"] = tuple(p.stride())
    return entries


def _canonical(value: Any) -> Any:
    """``value`` as plain data that compares (and hashes) the same on every rank when it means the same."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (tuple, list)):
        return tuple(_canonical(item) for item in value)
    if isinstance(value, dict):
        return tuple(sorted((str(key), _canonical(item)) for key, item in value.items()))
    if isinstance(value, Tensor):  # a device tensor's value is not read: that would stall the CPU on the device
        shown = value.detach().tolist() if value.device.type == "cpu" else f"on {value.device.type}"
        return ("tensor", str(value.dtype), tuple(value.shape), _canonical(shown))
    if isinstance(value, type):  # an optimizer_class key: by name
        return class_name(value)
    if isinstance(value, (torch.dtype, torch.device, complex, enum.Enum)):
        return repr(value)
    return f"<{type(value).__module__}.{type(value).__qualname__}>"  # opaque objects: only their type is comparable


def step_fingerprint(trainability: Sequence[bool], param_groups: ParamGroups) -> Fingerprint:
    """What every rank must step with alike: which parameters are trainable (by global index), and each param group's
    hyperparameters (tensor-valued ones on a device by dtype and shape only). The hyperparameters are compared
    among the stepping ranks only (``STEPPING_ONLY``): a rank joined under Join steps with its own, as in torch."""
    hyperparameters: Fingerprint = {}
    for index, group in enumerate(param_groups):
        for key, value in group.items():
            if key != "params":
                hyperparameters[f"param group {index}: {key!r} {{}}"] = _canonical(value)
    trainable = _trainable_indices(trainability)
    return {"the parameters that require grad, by index: {}": trainable, STEPPING_ONLY: hyperparameters}


def _trainable_indices(trainability: Sequence[bool]) -> tuple[int, ...]:
    return tuple(index for index, trainable in enumerate(trainability) if trainable)
