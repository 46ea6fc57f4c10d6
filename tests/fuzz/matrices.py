"""Muon programs: torch.optim.Muon on the model's hidden matrices, the constructor's AdamW on the rest.

The subject is one ``ZeroRedundancyOptimizer`` whose matrix groups name ``optimizer_class=torch.optim.Muon``
(distoptim owns each matrix whole); the oracle is what a user of plain torch writes, one plain optimizer per group
(``PlainPerGroup``), seen as one optimizer so that the program's schedulers, scaler and edits drive it alike.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

MUON = "Muon"  # the program's optimizer name for Muon on the matrices + AdamW on the rest
MUON_LR = 0.02
NOT_HIDDEN = ("embed", "out", "sparse", "conv", "extra")  # the embedding and head, 4-D and sparse weights, `extra`


def constructor_class(name: str) -> type:
    """The class a program's ZeRO is built with (AdamW for Muon programs: the rest's)."""
    return torch.optim.AdamW if name == MUON else getattr(torch.optim, name)


def hidden_matrices(model: nn.Module) -> set[int]:
    """The ids of the 2-D weights Muon users give Muon: inside the network, not the embedding or the head."""
    return {id(p) for name, p in model.named_parameters() if p.dim() == 2 and name.split(".")[0] not in NOT_HIDDEN}


def with_muon_groups(groups: list[dict[str, Any]], model: nn.Module, lr: float) -> list[dict[str, Any]]:
    """Each group split into its hidden matrices (a Muon group, its lr scaled as the group's is) and the rest."""
    matrices = hidden_matrices(model)
    split: list[dict[str, Any]] = []
    for group in groups:
        scale = group.get("lr", lr) / lr
        mats = [p for p in group["params"] if id(p) in matrices]
        rest = [p for p in group["params"] if id(p) not in matrices]
        if mats:
            split.append({"params": mats, "optimizer_class": torch.optim.Muon, "lr": MUON_LR * scale})
        if rest:
            split.append({**group, "params": rest})
    return split


def muon_step_size(lr: float, shape: tuple[int, ...]) -> float:
    """torch's Muon's step for an ``m x n`` matrix (its default ``adjust_lr_fn``): ``lr * sqrt(max(1, m / n))``."""
    return lr * math.sqrt(max(1.0, shape[0] / shape[1]))


class PlainPerGroup(torch.optim.Optimizer):
    """One plain torch optimizer per param group (a group's ``optimizer_class``, else ``default``), one shared
    state: ``param_groups``, ``state``, ``step``, ``state_dict`` and ``load_state_dict`` over all of them."""

    def __init__(self, groups: list[dict[str, Any]], default: type, defaults: dict[str, Any]) -> None:
        super().__init__([{"params": [torch.zeros(1, requires_grad=True)]}], dict(defaults))  # hooks only
        self._default, self._defaults = default, defaults
        self._state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
        self.parts: list[torch.optim.Optimizer] = []
        for group in groups:
            self.add_param_group(group)

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return [part.param_groups[0] for part in getattr(self, "parts", [])]

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:  # torch's __init__ assigns its own list
        pass

    @property  # type: ignore[override]
    def state(self) -> defaultdict[Tensor, dict[str, Any]]:
        return getattr(self, "_state", defaultdict(dict))

    @state.setter
    def state(self, value: Any) -> None:
        pass

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not hasattr(self, "parts"):
            return
        group = dict(param_group)
        cls = group.pop("optimizer_class", self._default)
        part = cls([group], **({} if "optimizer_class" in param_group else self._defaults))
        part.state = self._state
        self.parts.append(part)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts:
            part.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's format over all groups (positions numbered through them in order), into each part."""
        for part, saved in zip(self.parts, state_dict["param_groups"], strict=True):
            entries = {i: state_dict["state"][p] for i, p in enumerate(saved["params"]) if p in state_dict["state"]}
            settings = {k: v for k, v in saved.items() if k not in ("params", "optimizer_class")}
            numbered = {**settings, "params": list(range(len(saved["params"])))}
            part.load_state_dict({"state": entries, "param_groups": [numbered]})
        self._state.clear()
        for part in self.parts:
            self._state.update(part.state)
            part.state = self._state
