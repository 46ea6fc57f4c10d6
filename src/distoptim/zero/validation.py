"""Checks on what the user passed, made so that every rank raises the same clear error instead of hanging.

A check that fails on one rank only (one rank built a different model, or passed a bare tensor) would leave the
others waiting in the next collective. So each rank's verdict, or a fingerprint of its parameters, is exchanged
first, and every rank raises when any rank is wrong.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from distoptim.zero import comm

__all__ = ["ParamGroups", "agree_across_ranks", "fingerprint", "normalize_param_groups"]

ParamGroups = list[dict[str, Any]]


def normalize_param_groups(params: Any) -> ParamGroups:
    """Turn ``params`` (tensors or param-group dicts, any iterable) into a list of groups, or raise a clear error."""
    if isinstance(params, Tensor):
        raise TypeError(
            "params must be an iterable of tensors or of param-group dicts, got a single tensor; "
            "wrap it in a list: ZeroRedundancyOptimizer([tensor], ...)"
        )
    if isinstance(params, dict) or not isinstance(params, Iterable):
        raise TypeError(
            f"params must be an iterable of tensors or of param-group dicts, got {type(params).__name__}; "
            "pass model.parameters() or a list of {'params': [...], ...} dicts"
        )
    entries = list(params)
    if not entries:
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list; pass at least one parameter")
    kinds = {isinstance(entry, dict) for entry in entries}
    if len(kinds) > 1:
        raise TypeError("params mixes tensors and param-group dicts; pass either only tensors or only dicts")
    groups = [dict(entry) for entry in entries] if kinds == {True} else [{"params": entries}]
    for index, group in enumerate(groups):
        if "params" not in group:
            raise ValueError(f"param group {index} has no 'params' key; each group dict needs 'params': [tensors]")
        members = group["params"]
        group["params"] = [members] if isinstance(members, Tensor) else list(members)
        for param in group["params"]:
            check_parameter(param, index)
    return groups


def check_parameter(param: Any, group_index: int) -> None:
    if not isinstance(param, Tensor):
        raise TypeError(f"param group {group_index} holds a {type(param).__name__}, not a tensor")
    if param.is_sparse or param.layout != torch.strided:
        raise ValueError(
            f"param group {group_index} holds a sparse parameter (layout {param.layout}); ZeroRedundancyOptimizer "
            "shards dense parameters only: keep sparse parameters in a separate, unsharded optimizer"
        )


def fingerprint(groups: ParamGroups, **settings: Any) -> tuple[Any, ...]:
    """What every rank must agree on: settings, group sizes, and each parameter's shape, dtype and trainability."""
    described = tuple(
        tuple((tuple(p.shape), str(p.dtype), p.device.type, bool(p.requires_grad)) for p in group["params"])
        for group in groups
    )
    return (tuple(sorted(settings.items())), described)


def agree_across_ranks(local: tuple[Any, ...] | BaseException, group: comm.Group, what: str) -> None:
    """Exchange each rank's fingerprint (or its local error) and raise on every rank unless all agree."""
    verdict: Any = f"{type(local).__name__}: {local}" if isinstance(local, BaseException) else local
    verdicts = comm.all_gather_objects(verdict, group)
    if isinstance(local, BaseException):
        raise local
    failed = [(rank, v) for rank, v in enumerate(verdicts) if isinstance(v, str)]
    if failed:
        rank, message = failed[0]
        raise ValueError(f"{what} failed on rank {rank}: {message}")
    for rank, other in enumerate(verdicts):
        if other != local:
            raise ValueError(
                f"{what}: rank {comm.group_rank(group)} and rank {rank} disagree ({_first_difference(local, other)}); "
                "every rank must pass the same parameters (shapes, dtypes, requires_grad, groups) and settings"
            )


def _first_difference(mine: tuple[Any, ...], theirs: tuple[Any, ...]) -> str:
    my_settings, my_groups = mine
    their_settings, their_groups = theirs
    if my_settings != their_settings:
        return f"settings {dict(my_settings)} vs {dict(their_settings)}"
    if len(my_groups) != len(their_groups):
        return f"{len(my_groups)} vs {len(their_groups)} param groups"
    for index, (a, b) in enumerate(zip(my_groups, their_groups)):
        if len(a) != len(b):
            return f"param group {index} has {len(a)} vs {len(b)} parameters"
        for position, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"param group {index}, parameter {position}: (shape, dtype, device, requires_grad) {x} vs {y}"
    return "unknown difference"
