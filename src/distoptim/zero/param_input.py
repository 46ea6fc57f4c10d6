"""``params`` taken as ``torch.optim`` takes it; what torch refuses is refused with torch's text, then how to fix it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["check_names_alike", "normalize_param_groups"]


def normalize_param_groups(params: Any, first: int = 0) -> list[dict[str, Any]]:
    """Turn ``params`` (tensors or param-group dicts, any iterable) into a list of groups, or raise a clear error
    naming each group by its index in the optimizer (``first``: the first one's, for ``add_param_group``)."""
    if isinstance(params, Tensor):
        raise TypeError(
            f"`params` argument should be an iterable of Tensors, but got {torch.typename(params)}. "
            "ZeroRedundancyOptimizer got a single tensor; wrap it in a list: ZeroRedundancyOptimizer([tensor], ...)"
        )
    if isinstance(params, dict) or not isinstance(params, Iterable):
        raise TypeError(
            f"`params` argument should be an iterable of Tensors or dicts, but got {torch.typename(params)}; "
            "pass model.parameters() or a list of {'params': [...], ...} dicts"
        )
    entries = list(params)
    if not entries:
        raise ValueError("ZeroRedundancyOptimizer got an empty parameter list; pass at least one parameter")
    kinds = {isinstance(entry, dict) for entry in entries}
    if len(kinds) > 1:
        raise TypeError(
            "`params` argument should be an iterable of Tensors or dicts. "
            "params mixes tensors and param-group dicts; pass either only tensors or only dicts"
        )
    groups = [dict(entry) for entry in entries] if kinds == {True} else [{"params": entries}]
    for index, group in enumerate(groups, start=first):
        if "params" not in group:
            raise ValueError(
                "Each parameter group passed-in via `params` must have a 'params' key mapping to the parameters in "
                f"the group: param group {index} has no 'params' key; each group dict needs 'params': [tensors]"
            )
        members = group["params"]
        group["params"] = [members] if isinstance(members, Tensor) else list(members)
        _take_names(group, index)
        for param in group["params"]:
            _check_parameter(param, index)
        if len({id(param) for param in group["params"]}) != len(group["params"]):
            raise ValueError(
                f"param group {index} lists a parameter more than once; torch.optim warns that this will become an "
                "error and meanwhile steps it once per listing, which ZeroRedundancyOptimizer does not copy: list "
                "each parameter once (a shared, tied parameter too: model.parameters() gives it once)"
            )
    check_names_alike(groups[1:], groups[0])
    return groups


def _check_parameter(param: Any, group_index: int) -> None:
    if not isinstance(param, Tensor):
        raise TypeError(
            f"optimizer can only optimize Tensors, but one of the params is {torch.typename(param)}: "
            f"param group {group_index} holds a {type(param).__name__}, not a tensor; pass the parameters "
            "themselves (model.parameters()) or (name, tensor) pairs (model.named_parameters())"
        )
    if param.is_sparse or param.layout != torch.strided:
        raise ValueError(
            f"param group {group_index} holds a sparse parameter (layout {param.layout}); ZeroRedundancyOptimizer "
            "shards dense parameters only: keep sparse parameters in a separate, unsharded optimizer"
        )


def _take_names(group: dict[str, Any], index: int) -> None:
    """``(name, tensor)`` pairs (torch >= 2.5): the tensors in ``params``, the names in ``param_names``."""
    named = [isinstance(entry, tuple) for entry in group["params"]]
    if not any(named):
        return
    if not all(named):
        raise ValueError(
            "all optimizer params should be with/without names. Some param names are missing "
            f"(param group {index}: {named.count(False)} of its {len(named)} parameters are bare tensors): pass "
            "(name, tensor) pairs for all of them (model.named_parameters()) or tensors for all of them"
        )
    pairs = group["params"]
    if any(len(pair) != 2 for pair in pairs):
        raise TypeError(f"param group {index} holds a tuple that is not a (name, tensor) pair")
    group["params"] = [tensor for _, tensor in pairs]
    group["param_names"] = [name for name, _ in pairs]


def check_names_alike(groups: list[dict[str, Any]], first: dict[str, Any]) -> None:
    """Every group named (``param_names``) or none, as ``torch.optim`` requires; refused with torch's text."""
    for group in groups:
        if ("param_names" in group) != ("param_names" in first):
            which = "with names" if "param_names" in group else "without names"
            raise ValueError(
                "all optimizer param groups should be with/without names. "
                f"cannot add param group {which} to the optimizer: pass (name, tensor) pairs "
                "(model.named_parameters()) in every group, or tensors in every group"
            )
