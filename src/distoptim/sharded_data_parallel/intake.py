"""The gradient intake of ``ShardedDataParallel``'s store: after each backward every parameter whose gradient the store
holds gets a marker in ``.grad`` (its shape, one element of storage, NaN), so that whatever the program does to
``.grad`` afterwards is seen, through whatever object it goes: set to None (``zero_grad`` of the wrapper, of the
inner module or of a reference to the bare model kept from before wrapping, ``p.grad = None``) forgets the
parameter's owned gradient; zeroed in place (``zero_grad(set_to_none=False)`` anywhere) zeroes it; replaced by a
tensor of the user's (``p.grad = g`` after ``torch.autograd.grad`` and an all-reduce) makes the step use that tensor
as it is, as a plain optimizer under DDP would, and a later backward adds onto it. The step, ``clip_grad_norm_`` and
the next backward read that verdict parameter by parameter (``settle``); a ``.grad`` that ``no_sync()`` left and no
backward outside reduced is refused.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from distoptim._backward import at_end_of_backward
from distoptim.sharded_data_parallel.marker import GradientMarker

if TYPE_CHECKING:
    from distoptim.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["MarkerIntake"]


class MarkerIntake:
    """What ``.grad`` says about each parameter's gradient, read against the marker the store put there last: the
    intake half of ``gradients.OwnedGradients`` (which sets these attributes up)."""

    zero: ZeroRedundancyOptimizer
    params: list[Tensor]
    owned: list[Tensor | None]
    holds: list[bool]
    used: list[bool]
    unagreed: bool
    pieces: dict[int, list[tuple[int, int, int]]]
    slot_of: dict[int, tuple[int, object]]
    _markers: dict[int, tuple[GradientMarker, int]]
    _unreduced: dict[int, weakref.ref[Tensor]]
    _swapped: set[int]
    _task: int

    def settle(self, index: int, before_backward: bool = False) -> None:
        """Take in what the program did to parameter ``index``'s ``.grad`` since the store last marked it: None
        forgets its owned gradient; the marker zeroed in place zeroes it; a tensor of the user's replaces it (the
        step reads that tensor; a backward adds onto it and reduces the sum). ``before_backward``: its gradient
        hook, before the backward accumulates into ``.grad``, which then must not hold the marker.

        Raises:
            RuntimeError: at a step, when ``.grad`` holds the local gradient of backwards run under ``no_sync()``
                and no backward outside it reduced it (local to this rank: the caller agrees on it).
        """
        param, marker = self.params[index], self._markers.get(index)
        grad = param.grad
        if isinstance(grad, GradientMarker) and (marker is None or grad is not marker[0]):
            if marker is None or grad.origin is not marker[0].origin:
                raise RuntimeError(
                    "ShardedDataParallel: a parameter's .grad holds a marker (a gradient without values) that is "
                    "not the one this store put there last: copied from another parameter, or kept from before a "
                    "zero_grad() or a later backward; the gradient it stood for is gone. Set .grad to a full "
                    "tensor of your own, or to None"
                )
            marker = self._markers[index] = (grad, grad._version)  # the held gradient, converted (module.to())
        if grad is None:
            if marker is not None and index not in self._swapped:
                self._forget(index)
        elif marker is not None and grad is marker[0]:
            if grad._version != marker[1]:  # zero_grad(set_to_none=False), through whatever object
                self._zero(index)
                self._markers[index] = (grad, grad._version)
            if before_backward:
                param.grad = None
                self._swapped.add(index)
        elif self._unreduced.get(index, _dead)() is grad:
            if not before_backward:
                raise RuntimeError(
                    "ShardedDataParallel: zero.step() found gradients that backward passes under model.no_sync() "
                    "accumulated and no backward outside no_sync() reduced (each rank's own, unaveraged). Run the "
                    "last micro-batch's backward outside no_sync(), or call zero.zero_grad() to drop them"
                )
        elif marker is not None or self.holds[index]:  # set by hand: it replaces the owned gradient
            self._forget(index)

    def _is_marker(self, index: int, grad: Tensor) -> bool:
        return isinstance(grad, GradientMarker)

    def _forget(self, index: int) -> None:
        self._zero(index)
        self.holds[index] = self.used[index] = False
        self._markers.pop(index, None)

    def _zero(self, index: int) -> None:
        for bucket, start, length in self.pieces.get(index, ()):
            owned = self.owned[bucket]
            if owned is not None:
                owned[start : start + length].zero_()

    def mark(self) -> None:
        """Put a marker into each free ``.grad`` whose gradient the store holds, may hold (used here), or, until the
        ranks agree which were used, of which this rank owns a piece (its clear is seen here, where it counts)."""
        for index, param in enumerate(self.params):
            maybe = self.used[index] or (self.unagreed and index in self.pieces and param.requires_grad)
            if (self.holds[index] or maybe) and param.grad is None and id(param) in self.slot_of:
                marker = GradientMarker.like(param)
                param.grad = marker
                self._markers[index] = (marker, marker._version)

    def before_gradient(self, param: Tensor) -> None:
        """A parameter's gradient hook, before the backward accumulates into ``.grad``: at the first of a backward,
        settle every parameter (markers taken out of ``.grad``, to be put back at its end where nothing accumulated:
        ``torch.autograd.grad``, a parameter this backward did not reach), before any bucket lands."""
        if self._task != -1 or self.zero.index_of(param) is None:
            return  # settled at the start of this backward (or of the one a reentrant checkpoint runs inside)
        self._task = torch._C._current_graph_task_id()
        at_end_of_backward(self._unswap)
        for index in range(len(self.params)):
            self.settle(index, before_backward=True)

    def _unswap(self) -> None:
        for index in self._swapped:
            param = self.params[index]
            if param.grad is None and index in self._markers:
                param.grad = self._markers[index][0]
        self._swapped.clear()
        self._task = -1


def _dead() -> None:
    return None
