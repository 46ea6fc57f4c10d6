"""Refusing gradient accumulation across backwards that reduce gradients to their owners (``reduce_to_owners_hook``).

After such a backward only the owned ranges of ``.grad`` hold the average; the rest holds this rank's own partial
values. A further backward that adds onto them reduces the sum of the ranks' different leftovers: the owners'
gradients come out wrong, silently (DDP's all-reduce leaves the average everywhere, so accumulating there is right).
Accumulating under ``ddp.no_sync()`` for all micro-batches but the last is right (local gradients, reduced once),
and so is ``ShardedDataParallel``, which keeps the owned gradient itself.

The check: at the end of each backward through the hook, the ``.grad`` of each bucket's first trainable parameter is
noted (the tensor and its version counter). When a later backward computes that parameter's gradient while its
``.grad`` is still that tensor, unchanged, the parameter's gradient hook raises before autograd adds onto it: on
every rank alike, since all run the same graph. Clearing the gradients (to None, or zeroed in place) passes.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from distoptim._backward import at_end_of_backward, in_backward

__all__ = ["AccumulationGuard"]


class AccumulationGuard:
    """One per ``ZeroRedundancyOptimizer`` whose gradients a DDP hook reduces to owners."""

    def __init__(self) -> None:
        self._watched: dict[int, weakref.ref[Tensor]] = {}  # id(param) -> the parameter (its hook is registered)
        self._left: dict[int, tuple[weakref.ref[Tensor], int]] = {}  # id(param) -> its .grad and version, noted
        self._queued = False

    def saw_bucket(self, params: Sequence[Tensor]) -> None:
        """A bucket reached the hook: watch its first trainable parameter, and note the gradients once this backward
        ends (outside a backward, as DDP's join hook runs the hook, nothing reaches ``.grad``: nothing to note)."""
        first = next((param for param in params if param.requires_grad), None)
        if first is not None and id(first) not in self._watched:
            self._watched[id(first)] = weakref.ref(first)
            first.register_hook(_Check(self, first))  # type: ignore[no-untyped-call]
        if not self._queued and in_backward():
            self._queued = True
            at_end_of_backward(lambda: at_end_of_backward(self._note))  # after DDP's own, queued at its last bucket

    def _note(self) -> None:
        self._queued = False
        self._left = {}
        for key, ref in self._watched.items():
            param = ref()
            if param is not None and param.grad is not None:
                self._left[key] = (weakref.ref(param.grad), param.grad._version)

    def check(self, param: Tensor) -> None:
        left, grad = self._left.get(id(param)), param.grad
        if left is not None and grad is not None and left[0]() is grad and grad._version == left[1]:
            raise RuntimeError(
                "this backward would add onto the gradients of a backward that reduce_to_owners_hook reduced to "
                "their owners: only the owned ranges of .grad hold the average (the rest are this rank's partial "
                "values), so the accumulated gradient would be wrong. Clear the gradients between backwards "
                "(zero.zero_grad()), accumulate the micro-batches but the last under ddp.no_sync(), or use "
                "distoptim.ShardedDataParallel, which accumulates the owned gradient itself"
            )


class _Check:
    """A parameter's gradient hook: the guard's check, before autograd accumulates (holds the parameter weakly)."""

    def __init__(self, guard: AccumulationGuard, param: Tensor) -> None:
        self.guard, self.param = guard, weakref.ref(param)

    def __call__(self, grad: Tensor) -> Any:
        param = self.param()
        if param is not None:
            self.guard.check(param)
        return None
