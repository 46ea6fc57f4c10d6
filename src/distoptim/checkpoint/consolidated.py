"""``torch.optim``'s state-dict format (parameters numbered group by group), so that dicts move between plain
optimizers and this one: every rank's shard gathered into it on one rank (consolidation), and a dict in it matched
to this rank's shard (loading)."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from distoptim.comm import agreement
from distoptim.comm import collectives as comm
from distoptim.zero.elementwise import class_name, is_elementwise, torch_class_of
from distoptim.zero.local_optimizer import CLASS_KEY
from distoptim.zero.state_formats import FORMAT_KEY

__all__ = [
    "STAGING_BYTES",
    "GlobalState",
    "apply_hooks",
    "gather_state",
    "global_param_groups",
    "receive_state",
    "saved_param_groups",
    "select_shard",
    "send_state",
]

GlobalState = dict[int, dict[str, Any]]

STAGING_BYTES = 4 << 20
"""Bytes per message when a shard travels: the most extra memory consolidation takes on any rank (sender or not)."""


def _as_bytes(tensor: Tensor) -> Tensor:
    """A flat uint8 view of ``tensor``'s elements (a copy of this one tensor only if it is not contiguous)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


def _chunks(sizes: Sequence[int], chunk: int) -> Iterator[tuple[list[tuple[int, int, int, int]], int]]:
    """The tensors' bytes in messages of ``chunk``: each its pieces ``(tensor, begin, end, at)`` and its length."""
    pieces: list[tuple[int, int, int, int]] = []
    at = 0
    for index, size in enumerate(sizes):
        begin = 0
        while begin < size:
            end = min(size, begin + chunk - at)
            pieces.append((index, begin, end, at))
            at += end - begin
            begin = end
            if at == chunk:
                yield pieces, at
                pieces, at = [], 0
    if pieces:
        yield pieces, at


def send_state(
    state: GlobalState, to: int, group: comm.Group, comm_device: torch.device, staging_bytes: int = STAGING_BYTES
) -> None:
    """Send this rank's shard to rank ``to``: its skeleton, then its bytes through one ``staging_bytes`` buffer."""
    tensors = [value for entry in state.values() for value in entry.values() if isinstance(value, Tensor)]
    skeleton = _map_values(  # the tensors as meta tensors: the receiver allocates them on the CPU
        state, lambda value: value.new_empty(value.shape, device="meta") if isinstance(value, Tensor) else value
    )
    sizes = [tensor.numel() * tensor.element_size() for tensor in tensors]
    chunk = max(1, staging_bytes)
    comm.send_object((skeleton, chunk), to, group, comm_device)
    staging = torch.empty(min(chunk, sum(sizes)), dtype=torch.uint8, device=comm_device)
    source: dict[int, Tensor] = {}  # the bytes of the tensor being sent (at most one copy, if not contiguous)
    for pieces, length in _chunks(sizes, chunk):
        for index, begin, end, at in pieces:
            if index not in source:
                source = {index: _as_bytes(tensors[index])}
            staging[at : at + end - begin].copy_(source[index][begin:end])
        comm.send_tensor(staging[:length], to, group)


def receive_state(source: int, group: comm.Group, comm_device: torch.device) -> GlobalState:
    """The shard that rank ``source`` sends with ``send_state``, in new CPU tensors."""
    skeleton, chunk = comm.receive_object(source, group, comm_device)
    empty = lambda value: torch.empty(value.shape, dtype=value.dtype) if isinstance(value, Tensor) else value
    state = _map_values(skeleton, empty)
    targets = [_as_bytes(value) for entry in state.values() for value in entry.values() if isinstance(value, Tensor)]
    staging = torch.empty(min(chunk, sum(target.numel() for target in targets)), dtype=torch.uint8, device=comm_device)
    for pieces, length in _chunks([target.numel() for target in targets], chunk):
        comm.receive_tensor(staging[:length], source, group)
        for index, begin, end, at in pieces:
            targets[index][begin:end].copy_(staging[at : at + end - begin])
    return state


def _map_values(state: GlobalState, function: Callable[[Any], Any]) -> GlobalState:
    return {index: {key: function(value) for key, value in entry.items()} for index, entry in state.items()}


def global_param_groups(param_groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``param_groups`` with parameters replaced by their global indices, as ``torch.optim`` saves them."""
    numbers = itertools.count()
    return [
        {**{k: v for k, v in group.items() if k != "params"}, "params": [next(numbers) for _ in group["params"]]}
        for group in param_groups
    ]


def saved_param_groups(param_groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``global_param_groups`` with a group's ``optimizer_class`` by its name (``"torch.optim.Muon"``), so that
    ``torch.load(..., weights_only=True)`` reads the dict; loading compares the names."""
    return [
        {**group, CLASS_KEY: _stored_name(group[CLASS_KEY])} if CLASS_KEY in group else group
        for group in global_param_groups(param_groups)
    ]


def _stored_name(value: Any) -> Any:
    """A class by the name of the ``torch.optim`` class that steps it; a name (an older dict's or ours) as it is."""
    return class_name(torch_class_of(value)) if isinstance(value, type) else value


def select_shard(
    state_dict: dict[str, Any], param_groups: Sequence[dict[str, Any]], optimizer_class: type
) -> tuple[dict[Tensor, dict[str, Any]], list[dict[str, Any]]]:
    """Match a saved global dict to ``param_groups``: per-parameter state (by tensor) and per-group hyperparameters;
    a ``ValueError`` for other parameters or another optimizer class (the whole dict checked: every rank agrees)."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError(
            "expected an optimizer state dict with 'state' and 'param_groups' keys, as state_dict() returns; "
            "a dict from sharded_state_dict() loads with dcp.load then load_sharded_state_dict()"
        )
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"the state dict has {len(saved_groups)} param groups but this optimizer has {len(param_groups)}; "
            "load a state dict saved for these parameters, grouped alike"
        )
    by_param: dict[Tensor, dict[str, Any]] = {}
    for number, (saved, group) in enumerate(zip(saved_groups, param_groups)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(
                f"param group {number} has {len(saved['params'])} parameters in the state dict "
                f"but {len(group['params'])} in this optimizer; load a state dict saved for these parameters"
            )
        check_hyperparameters(saved, group, number, optimizer_class)
        for index, param in zip(saved["params"], group["params"]):
            if index in state_dict["state"]:
                by_param[param] = state_dict["state"][index]
                _check_state_shapes(by_param[param], param, index, group.get(CLASS_KEY, optimizer_class))
    return by_param, [loaded_hyperparameters(saved) for saved in saved_groups]


def loaded_hyperparameters(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved group's settings to load: all but ``params``, the class and the state format (the group's own stay)."""
    return {k: v for k, v in saved.items() if k not in ("params", CLASS_KEY, FORMAT_KEY)}


# Implementation switches, not hyperparameters: torch.optim fills them in when an older checkpoint lacks them.
_IMPLEMENTATION_FLAGS = frozenset({"foreach", "maximize", "capturable", "differentiable", "fused"})


def _hyperparameter_names(optimizer_class: type) -> set[str]:
    """The hyperparameters ``optimizer_class`` takes by name (its positional arguments after ``params``)."""
    try:
        parameters = inspect.signature(optimizer_class).parameters.values()
    except (TypeError, ValueError):  # no introspectable signature: nothing to require
        return set()
    named = {p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and p.name != "params"}
    return named - _IMPLEMENTATION_FLAGS


def check_hyperparameters(saved: dict[str, Any], group: dict[str, Any], number: int, optimizer_class: type) -> None:
    """A saved group must carry this group's hyperparameters (an SGD dict has no 'betas') and name its class."""
    own, theirs = group.get(CLASS_KEY), saved.get(CLASS_KEY)
    if _stored_name(own) != _stored_name(theirs):  # by name: a checkpoint stores the class's (saved_param_groups)
        shown = ["none" if cls is None else _stored_name(cls) for cls in (theirs, own)]
        raise ValueError(
            f"param group {number} of the state dict names optimizer_class {shown[0]}, but this optimizer's names "
            f"{shown[1]}: load a state dict saved with the same optimizer class per group"
        )
    optimizer_class = torch_class_of(own) if isinstance(own, type) else optimizer_class
    if missing := sorted(name for name in _hyperparameter_names(optimizer_class) & group.keys() if name not in saved):
        name = torch_class_of(optimizer_class).__qualname__
        found = ", ".join(sorted(k for k in saved if k != "params"))
        raise ValueError(
            f"param group {number} of the state dict has no {', '.join(map(repr, missing))}, which {name} needs: "
            f"it was saved by a different optimizer class (the group holds {found}). Load a state dict saved by "
            f"{name}, or build ZeroRedundancyOptimizer with the optimizer class that saved this one"
        )


def _check_state_shapes(entry: dict[str, Any], param: Tensor, index: int, optimizer_class: type) -> None:
    """For an elementwise optimizer every non-scalar state tensor has its parameter's shape."""
    if not is_elementwise(optimizer_class):
        return
    for key, value in entry.items():
        if isinstance(value, Tensor) and value.dim() > 0 and value.shape != param.shape:
            name = torch_class_of(optimizer_class).__qualname__
            raise ValueError(
                f"state[{index}][{key!r}] in the state dict has shape {tuple(value.shape)} but parameter {index} "
                f"has shape {tuple(param.shape)}; {name} keeps state shaped like its parameter, so the dict was saved "
                "for other parameters (another model, or another parameter order). Load a state dict saved for "
                "these parameters, in this order"
            )


def apply_hooks(hooks: Iterable[Callable[..., Any]], optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Run ``torch.optim`` state-dict hooks in order: each gets the dict, and one that returns a dict replaces it."""
    for hook in hooks:
        replaced = hook(optimizer, state_dict)
        state_dict = state_dict if replaced is None else replaced
    return state_dict


def gather_state(
    mine: dict[Any, dict[str, Any]], to: int, group: comm.Group, comm_device: torch.device
) -> dict[Any, dict[str, Any]] | None:
    """Every rank's shard on rank ``to``'s CPU, merged (None on the other ranks); this rank's own copied."""
    if comm.group_rank(group) != to:
        send_state(mine, to, group, comm_device, STAGING_BYTES)
        return None
    # a copy on the CPU, as the other ranks' shards are: the consolidated state is this moment's, not live
    copied = lambda value: value.detach().to("cpu", copy=True) if isinstance(value, Tensor) else value
    merged = _map_values(mine, copied)
    for source in range(comm.group_size(group)):
        if source != to:
            merged.update(receive_state(source, group, comm_device))
    return merged


def agree_on_target(to: Any, world_size: int, group: comm.Group) -> None:
    """Every rank must name the same valid ``to`` (else the others would wait until the timeout): one agreement."""
    outcome: agreement.Fingerprint | BaseException = {"{} consolidation target": to}
    if isinstance(to, bool) or not isinstance(to, int):
        outcome = TypeError(f"consolidate_state_dict(to={to!r}): 'to' must be a rank (an int), 0..{world_size - 1}")
    elif not 0 <= to < world_size:
        outcome = ValueError(f"consolidate_state_dict(to={to}): 'to' must be a rank of the group, 0..{world_size - 1}")
    agreement.agree_across_ranks(outcome, group, "consolidate_state_dict", "pass the same 'to' everywhere")


def select_shard_on_every_rank(
    state_dict: Any, param_groups: Sequence[dict[str, Any]], optimizer_class: type, group: comm.Group
) -> tuple[dict[Tensor, dict[str, Any]], list[dict[str, Any]]]:
    """``select_shard``, with its verdict agreed (one all-reduce): a dict refused on one rank is refused on all."""
    select = lambda: select_shard(state_dict, param_groups, optimizer_class)
    return agreement.run_agreed(select, group, "load_state_dict", errors=(TypeError, ValueError, KeyError))
