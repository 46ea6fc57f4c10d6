"""This rank's shard as its local optimizer sees it: one tensor per owned fragment, and its state's global format.

A fragment that covers its parameter whole is stepped as the parameter itself (so the greedy partition, and any
parameter that an even cut leaves whole, behaves exactly like a plain optimizer, state shapes included). A partial
fragment is stepped as a 1-D view of its parameter's elements (memory order) whose ``.grad`` is attached for the
step from the parameter's gradient; elementwise optimizers then do on the piece what they would do on the whole.

In the global (``torch.optim``) format a partial fragment's state is keyed ``(index, offset)`` until the
consolidating rank stitches the pieces back into parameter-shaped tensors (``stitch``); loading slices them again
(``slice_entry``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from distoptim._flat import flat_view
from distoptim.zero.partition import PartitionPlan

__all__ = ["LocalShard", "LocalTensor", "fragment_of", "slice_entry", "stitch"]


@dataclass(frozen=True)
class LocalTensor:
    """Elements ``[offset, offset + length)`` of global parameter ``index`` (``param``), stepped as ``tensor``."""

    index: int
    param: Tensor
    offset: int
    length: int
    tensor: Tensor

    @property
    def whole(self) -> bool:
        return self.tensor is self.param

    def grad_from(self, grad: Tensor | None) -> Tensor | None:
        """This piece of a gradient of the whole parameter (None stays None)."""
        return grad if grad is None or self.whole else fragment_of(grad, self.param, self.offset, self.length)


def fragment_of(tensor: Tensor, param: Tensor, offset: int, length: int) -> Tensor:
    """Elements ``[offset, offset + length)`` of ``tensor`` in ``param``'s memory order (a view when laid out alike)."""
    if tensor.stride() != param.stride():
        tensor = torch.empty_like(param, dtype=tensor.dtype, device=tensor.device).copy_(tensor)
    return flat_view(tensor)[offset : offset + length]


class LocalShard:
    """The local tensors of one rank for one partition plan, grouped like the global param groups."""

    def __init__(self, plan: PartitionPlan, param_groups: Sequence[dict[str, Any]], rank: int) -> None:
        self.groups: list[list[LocalTensor]] = []
        index = 0
        for group in param_groups:
            local: list[LocalTensor] = []
            for param in group["params"]:
                for fragment in plan.fragments[index]:
                    if fragment.rank == rank:
                        local.append(_local_tensor(index, param, fragment.offset, fragment.length))
                index += 1
            self.groups.append(local)
        self.by_tensor = {id(t.tensor): t for group in self.groups for t in group}
        self.partial = [t for group in self.groups for t in group if not t.whole]

    @property
    def tensors(self) -> list[list[Tensor]]:
        """What the local optimizer holds, group by group."""
        return [[t.tensor for t in group] for group in self.groups]

    def attach_grads(self) -> None:
        """Give every partial fragment its piece of its parameter's gradient (before the local step)."""
        self._align_grads()
        for local in self.partial:
            local.tensor.grad = local.grad_from(local.param.grad)

    def detach_grads(self) -> None:
        """Drop the pieces again, so that no stale gradient outlives ``zero_grad``."""
        for local in self.partial:
            local.tensor.grad = None

    def owned_grads(self) -> list[Tensor]:
        """This rank's pieces of the gradient (views where the layouts agree), for clipping."""
        self._align_grads()
        pieces = (t.grad_from(t.param.grad) for group in self.groups for t in group)
        return [grad for grad in pieces if grad is not None]

    def _align_grads(self) -> None:
        """Lay out any gradient unlike its split parameter like it, so that its pieces are views of ``.grad``."""
        for local in self.partial:
            grad = local.param.grad
            if grad is not None and grad.stride() != local.param.stride():
                local.param.grad = torch.empty_like(local.param).copy_(grad)

    def key(self, local: LocalTensor) -> int | tuple[int, int]:
        """The global-format key of a local tensor's state: the parameter index, with the offset when partial."""
        return local.index if local.whole else (local.index, local.offset)

    def global_state(self, state: dict[Tensor, dict[str, Any]]) -> dict[Any, dict[str, Any]]:
        """The local optimizer's ``state`` keyed as in the global format (partial fragments as ``(index, offset)``)."""
        return {self.key(self.by_tensor[id(tensor)]): dict(entry) for tensor, entry in state.items()}

    def local_state(self, by_param: dict[Tensor, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """Saved whole-parameter entries cut to this shard, keyed by position in the local optimizer (copies: a
        ``torch.optim`` load would alias same-device tensors and step them in place)."""
        locals_ = (local for group in self.groups for local in group)
        return {i: slice_entry(by_param[t.param], t) for i, t in enumerate(locals_) if t.param in by_param}

    def move_state(self, state: dict[Tensor, Any], previous: LocalShard | None) -> None:
        """Re-key ``state`` from ``previous``'s tensors to this shard's (same parameter and offset: same state)."""
        if previous is None:
            return
        now = {(t.index, t.offset, t.length): t.tensor for group in self.groups for t in group}
        for group in previous.groups:
            for old in group:
                entry = state.pop(old.tensor, None)
                new = now.get((old.index, old.offset, old.length))
                if entry is not None and new is not None:
                    state[new] = entry


def _local_tensor(index: int, param: Tensor, offset: int, length: int) -> LocalTensor:
    if offset == 0 and length == param.numel():
        return LocalTensor(index, param, offset, length, param)
    return LocalTensor(index, param, offset, length, flat_view(param)[offset : offset + length])


def _is_piece(value: Any) -> bool:
    return isinstance(value, Tensor) and value.dim() == 1


def stitch(state: dict[Any, dict[str, Any]], params: Sequence[Tensor]) -> dict[int, dict[str, Any]]:
    """Merge partial fragments' entries (keyed ``(index, offset)``) into whole-parameter entries keyed ``index``.

    A 1-D tensor of a fragment is its piece of a parameter-shaped tensor (laid out like the parameter); anything
    else (a step count) is the same on every fragment and is taken once.
    """
    merged: dict[int, dict[str, Any]] = {key: entry for key, entry in state.items() if isinstance(key, int)}
    for (index, offset), entry in sorted((k, v) for k, v in state.items() if isinstance(k, tuple)):
        whole = merged.setdefault(index, {})
        param = params[index]
        for name, value in entry.items():
            if not _is_piece(value):
                whole.setdefault(name, value)
                continue
            if name not in whole:
                whole[name] = torch.empty_like(param, dtype=value.dtype, device=value.device)
            flat_view(whole[name])[offset : offset + value.numel()].copy_(value)
    return merged


def slice_entry(entry: dict[str, Any], local: LocalTensor) -> dict[str, Any]:
    """A saved whole-parameter entry cut to ``local``'s fragment (copies, never aliases of the caller's dict)."""
    if local.whole:
        return {k: v.clone() if isinstance(v, Tensor) else v for k, v in entry.items()}
    return {
        k: fragment_of(v, local.param, local.offset, local.length).clone()
        if isinstance(v, Tensor) and v.shape == local.param.shape and v.dim() > 0
        else (v.clone() if isinstance(v, Tensor) else v)
        for k, v in entry.items()
    }
