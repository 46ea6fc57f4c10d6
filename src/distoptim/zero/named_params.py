"""Named parameters, as ``torch.optim`` takes them since torch 2.5: ``(name, tensor)`` pairs
(``model.named_parameters()``), flat or in param groups; the tensors go in ``params``, the names in each group's
``param_names``, which ``param_groups`` and ``state_dict()`` show (the local optimizers, over other tensors, do not
carry them). A group naming some parameters and not others, or named groups beside unnamed ones, are refused with
torch's texts, then how to fix it."""

from __future__ import annotations

from typing import Any

__all__ = ["check_names_alike", "take_names"]


def take_names(group: dict[str, Any], index: int) -> None:
    """Named parameters (``model.named_parameters()``: ``(name, tensor)`` pairs), as ``torch.optim`` takes them since
    torch 2.5: the tensors in ``params``, the names in ``param_names``; a group naming some and not others is
    refused with torch's text."""
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
