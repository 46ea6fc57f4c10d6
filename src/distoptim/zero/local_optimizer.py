"""The local optimizer: plain ``torch.optim`` over this rank's shard or, where groups name their own class or keep
their state in fewer bits, a ``CompositeOptimizer``: one plain optimizer per kind of group, seen as one."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from distoptim.zero.elementwise import is_elementwise, torch_class_of
from distoptim.zero.partition import newton_schulz_cost
from distoptim.zero.shard import has_master
from distoptim.zero.state_formats import StateFormats, needs_formats

__all__ = [
    "CLASS_KEY",
    "CompositeOptimizer",
    "build_local_optimizer",
    "check_classes_unchanged",
    "check_eps_from_first_dtype",
    "group_class",
    "kind_of",
    "whole_tensor_weights",
]

CLASS_KEY = "optimizer_class"

Kind = tuple[type, bool]  # the torch.optim class, whether the group named it (then without the constructor's defaults)


def group_class(group: dict[str, Any], default: type) -> type:
    """The ``torch.optim`` class that steps ``group`` (a ``distoptim.functional`` class stands for its own)."""
    return torch_class_of(group.get(CLASS_KEY, default))


def kind_of(group: dict[str, Any], default: type) -> Kind:
    return group_class(group, default), CLASS_KEY in group


def whole_tensor_weights(groups: Sequence[dict[str, Any]], default: type) -> tuple[list[bool], list[int]]:
    """For each parameter (global order): whether its class needs it whole, and what stepping it costs."""
    whole, costs = [], []
    for group in groups:
        cls = group_class(group, default)
        for param in group["params"]:
            whole.append(not is_elementwise(cls))
            muon = issubclass(cls, torch.optim.Muon)
            costs.append(newton_schulz_cost(tuple(param.shape)) if muon else param.numel())
    return whole, costs


def build_local_optimizer(groups: Sequence[dict[str, Any]], default: type, defaults: dict[str, Any]) -> Optimizer:
    """The local optimizer over ``groups`` (this rank's, in global order): plain where every group is of one kind."""
    kinds = [kind_of(group, default) for group in groups]
    if len(set(kinds)) == 1 and not needs_formats(groups):
        cls, named = kinds[0]
        optim: Optimizer = cls(list(groups), **({} if named else defaults))
        return optim
    return CompositeOptimizer(groups, default, defaults)


def check_classes_unchanged(global_groups: Sequence[dict[str, Any]], optim: Optimizer, default: type) -> None:
    """Refuse a group whose ``optimizer_class`` was edited (or removed) after the group was added."""
    if isinstance(optim, CompositeOptimizer):  # the class each group was added as
        built = [kind[0] for kind, _ in optim._order]
    else:
        built = [torch_class_of(type(optim))] * len(optim.param_groups)
    for index, (group, cls) in enumerate(zip(global_groups, built)):
        now = group_class(group, default)
        if now is not cls:
            raise ValueError(
                f"param group {index}: its 'optimizer_class' was changed to {now.__name__} after the group was added "
                f"as {cls.__name__}; a group's class is fixed when it is added (its state and defaults are that "
                "class's). Put it back, or build the optimizer again with the group naming the new class"
            )


def check_eps_from_first_dtype(
    groups: Sequence[dict[str, Any]], default: type, master_dtype: torch.dtype | None
) -> None:
    """Refuse Adafactor's ``eps=(None, ...)`` over several stepped dtypes: a shard cannot reproduce its ``eps1``."""
    for index, group in enumerate(groups):
        eps = group.get("eps")
        adafactor = issubclass(group_class(group, default), torch.optim.Adafactor)
        if not adafactor or not isinstance(eps, (tuple, list)) or eps[0] is not None:
            continue
        stepped = {master_dtype if has_master(p.dtype, master_dtype) else p.dtype for p in group["params"]}
        if len(stepped) > 1:
            raise ValueError(
                f"param group {index} (torch.optim.Adafactor) steps parameters of dtypes "
                f"{sorted(str(d) for d in stepped)} with eps=(None, ...): torch's Adafactor then uses the epsilon "
                "of its first parameter's dtype for the whole group, which a shard cannot reproduce. Set eps1 "
                "explicitly (eps=(torch.finfo(torch.float32).eps, 1e-3)), or put each dtype in its own group"
            )


class CompositeOptimizer(Optimizer):
    """Several plain optimizers, one per kind of group, seen as one: its parts' groups in global order, one state."""

    def __init__(self, groups: Sequence[dict[str, Any]], default: type, defaults: dict[str, Any]) -> None:
        self._default, self._defaults = default, defaults  # a part whose groups named their class: its own defaults
        self.formats: StateFormats | None = None  # the state's formats, where a group keeps it in fewer bits
        self.parts: dict[Kind, Optimizer] = {}
        self._shared: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
        super().__init__([{"params": []}], {})  # the hook registries; the groups are the parts'
        self._order: list[tuple[Kind, int]] = []  # global group number -> (part, its group number)
        by_kind: dict[Kind, list[dict[str, Any]]] = {}
        for group in groups:  # each part built with all its groups, as the plain class is (its state at construction)
            kind = kind_of(group, default)
            by_kind.setdefault(kind, []).append(group)
            self._order.append((kind, len(by_kind[kind]) - 1))
        for kind, kind_groups in by_kind.items():
            self._add_part(kind, kind_groups)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [self.parts[kind].param_groups[number] for kind, number in self._order]

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:  # Optimizer.__init__ assigns [] first
        if value:
            raise AttributeError("a CompositeOptimizer's param groups are its parts': use add_param_group")

    @property
    def state(self) -> defaultdict[Tensor, Any]:
        return self._shared

    @state.setter
    def state(self, value: Any) -> None:  # Optimizer.__init__ assigns an empty state
        if value:
            raise AttributeError("a CompositeOptimizer's state is its parts' shared dict")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not hasattr(self, "_order"):
            return
        kind = kind_of(param_group, self._default)
        part = self.parts.get(kind)
        if part is None:
            part = self._add_part(kind, [param_group])
        else:
            part.add_param_group(param_group)
        self._order.append((kind, len(part.param_groups) - 1))

    def _add_part(self, kind: Kind, groups: list[dict[str, Any]]) -> Optimizer:
        self.parts[kind] = kind[0](groups, **({} if kind[1] else self._defaults))
        part = self.parts[kind]
        self._shared.update(part.state)  # what it made at construction (Adagrad's sums)
        part.state = self._shared
        return part

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.formats is not None:
            self.formats.step(list(self.parts.values()), self.param_groups, self._shared, kwargs)
        else:
            for part in self.parts.values():
                part.step(**kwargs)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts.values():
            part.zero_grad(set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """``torch.optim``'s format over the composite's groups, split into each part's own and loaded there."""
        per_part: dict[Hashable, dict[str, Any]] = {kind: {"state": {}, "param_groups": []} for kind in self.parts}
        for (kind, _), saved in zip(self._order, state_dict["param_groups"]):
            part = per_part[kind]
            numbers: list[int] = []
            for saved_position in saved["params"]:
                number = sum(len(g["params"]) for g in part["param_groups"]) + len(numbers)
                if saved_position in state_dict["state"]:
                    part["state"][number] = state_dict["state"][saved_position]
                numbers.append(number)
            part["param_groups"].append({**saved, "params": numbers})
        self._shared.clear()
        for kind, optim in self.parts.items():
            optim.load_state_dict(per_part[kind])
            self._shared.update(optim.state)
            optim.state = self._shared
        if self.formats is not None:  # torch.optim's format is decoded: encoded again here
            self.formats.encode_all(self._shared)
