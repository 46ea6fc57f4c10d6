"""Refusing gradient accumulation across backwards that reduce gradients to their owners (``reduce_to_owners_hook``).

After such a backward only the owned ranges of ``.grad`` hold the average; the rest holds this rank's own partial
values. A further backward that adds onto them reduces the sum of the ranks' different leftovers: the owners'
gradients come out wrong, silently (DDP's all-reduce leaves the average everywhere, so accumulating there is right).
Accumulating under ``ddp.no_sync()`` for all micro-batches but the last is right (local gradients, reduced once),
and so is ``ShardedDataParallel``, which keeps the owned gradient itself.

How it is caught: at the end of each backward through the hook, the ``.grad`` of every parameter of its buckets is
noted (the tensor and its version counter). A parameter's gradient hook marks it when a later backward computes its
gradient while ``.grad`` is still that tensor, unchanged; its post-accumulate hook confirms that the backward wrote
``.grad`` (``torch.autograd.grad`` does not). ``zero.step()`` then refuses, through the step's agreement so that
every rank raises, while such a ``.grad`` still holds the sum: gradients added onto and then cleared (a GAN's
generator backward through the discriminator, before the discriminator's ``zero_grad()``) are never read, and pass,
whether the clear set ``.grad`` to None or zeroed it in place (``zero_grad(set_to_none=False)``: the same tensor,
written since the backward that added onto it ended). Whether such a write left zeros is taken where the next
backward reaches the parameter (before it accumulates) or else at the step, and read at the step: one host read, in
a step that finds such a ``.grad`` only. A clear through ``.data`` (``p.grad.data.zero_()``, the old idiom) leaves
the version alone, so a ``.grad`` a backward added onto is also let pass when it held zeros just before that
backward reached it, or holds zeros at the step: a backward onto zeros is a fresh one, reduced right.

DDP with ``gradient_as_bucket_view=True`` re-creates each ``.grad`` as a view of its rebuilt buckets in the second
forward, a copy: ``ddp/reduce_to_owners.py`` watches that forward and has the copies of what was left noted as left.

The overlap hooks step inside the backward, so they ask before stepping (``check_in_backward``): a sum made in this
backward is refused, and so is a leftover the backward has not reached yet (or DDP reduces as it stands, unused).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from distoptim import _host
from distoptim._backward import at_end_of_backward

__all__ = ["AccumulationGuard"]

_Noted = tuple["weakref.ref[Tensor]", int]


class AccumulationGuard:
    """One per ``ZeroRedundancyOptimizer`` whose gradients a DDP hook reduces to owners."""

    def __init__(self) -> None:
        self._watched: dict[int, weakref.ref[Tensor]] = {}  # id(param) -> the parameter (its hooks are registered)
        self._left: dict[int, _Noted] = {}  # what the last reducing backward left in .grad
        self._suspect: dict[int, Tensor] = {}  # a backward computes their gradient onto what it left: was it zeros?
        self._added_onto: dict[int, _Noted] = {}  # .grad holding such a sum, and its version once the backward ended
        self._flagged: set[int] = set()  # added onto in the backward running now
        self._was_zero: dict[int, Tensor] = {}  # such a .grad, written in place since: not any(), before accumulating
        self._zero_before: dict[int, Tensor] = {}  # such a .grad: not any() just before the backward added onto it
        self._noting_for = -1  # the backward (graph task) whose end is to be noted

    def saw_bucket(self, params: Sequence[Tensor]) -> None:
        """A bucket reached the hook: watch its trainable parameters, and note their gradients once this backward
        ends (outside a backward, as DDP's join hook runs the hook, nothing reaches ``.grad``: nothing to note)."""
        for param in params:
            if param.requires_grad and id(param) not in self._watched:
                self._watched[id(param)] = weakref.ref(param)
                param.register_hook(_Hook(self, param, before=True))  # type: ignore[no-untyped-call]
                param.register_post_accumulate_grad_hook(_Hook(self, param, before=False))  # type: ignore[no-untyped-call]
        task = torch._C._current_graph_task_id()
        if task != -1 and task != self._noting_for:
            self._noting_for = task
            at_end_of_backward(lambda: at_end_of_backward(self._note))  # after DDP's own, queued at its last bucket

    def still_left(self) -> list[int]:
        """The parameters (ids) whose ``.grad`` is still what the last reducing backward left."""
        return [key for key, grad in zip(self._left, self._left_grads(list(self._left))) if grad is not None]

    def renote(self, keys: list[int]) -> None:
        """DDP re-created these parameters' ``.grad`` as copies (views of its rebuilt buckets): note the copies."""
        for key in keys:
            param = self._watched[key]()
            if param is not None and param.grad is not None:
                self._left[key] = (weakref.ref(param.grad), param.grad._version)

    def _note(self) -> None:
        self._noting_for = -1
        self._left = {}
        for key, ref in self._watched.items():
            param = ref()
            if param is not None and param.grad is not None:
                self._left[key] = (weakref.ref(param.grad), param.grad._version)
                if key in self._flagged:  # its version after DDP's finalisation, which writes into .grad
                    self._added_onto[key] = self._left[key]
        self._flagged.clear()

    def before_gradient(self, param: Tensor) -> None:
        left, grad = self._left.get(id(param)), param.grad
        added = self._added_onto.get(id(param))
        if added is not None and grad is not None and added[0]() is grad and grad._version != added[1]:
            self._was_zero[id(param)] = grad.any().logical_not()  # cleared in place? (read at the step)
        if left is not None and grad is not None and left[0]() is grad and grad._version == left[1]:
            self._suspect[id(param)] = grad.any().logical_not()  # cleared through .data, which keeps the version?
        else:
            self._suspect.pop(id(param), None)
            if left is not None:  # cleared since: nothing left to compare at the step or in the backward
                del self._left[id(param)]

    def after_accumulation(self, param: Tensor) -> None:
        zero_before = self._suspect.pop(id(param), None)
        if zero_before is not None and param.grad is not None:
            self._added_onto[id(param)] = (weakref.ref(param.grad), param.grad._version)
            self._flagged.add(id(param))
            self._was_zero.pop(id(param), None)
            self._zero_before[id(param)] = zero_before

    def cleared(self) -> None:
        """``zero.zero_grad()``: whatever was added onto, or left, is gone (every ``.grad`` None or zeroed in place,
        which bumps its version), so that a loop that clears its gradients has nothing to compare."""
        self._left = {}
        self._added_onto.clear()
        self._was_zero.clear()
        self._zero_before.clear()

    @property
    def may_refuse(self) -> bool:
        """Whether ``check`` has anything to look at: a backward added onto what a reduction left, and no
        ``zero.zero_grad()`` since. The same on every rank of one program (it follows ``.grad`` identities and
        versions, not values), so that only then need the ranks agree on ``check``'s verdict."""
        return bool(self._added_onto)

    def check(self) -> None:
        """Raise if a ``.grad`` still holds a sum onto what a reduction to owners left (call where it is read)."""
        if self._added_onto and self._not_cleared([]):
            raise RuntimeError(_refusal("a backward added onto", _STEP_FIX))

    def suspects_in_backward(self) -> bool:
        """Whether ``check_in_backward`` has anything to look at (identities and versions only, no value read: the
        same on every rank of one program, so that the overlap hook agrees on the verdict only then)."""
        for key, (grad_ref, _) in list(self._added_onto.items()):
            param = self._watched[key]()
            if param is None or param.grad is None or param.grad is not grad_ref():
                del self._added_onto[key]  # cleared since
        return bool(self._added_onto) or bool(self._untouched())

    def check_in_backward(self) -> None:
        """The overlap hooks, in a backward, before they step: raise if a gradient it reduces holds a sum onto what
        the last reduction to owners left (``check``'s rule) or still holds that leftover (not reached yet, or
        unused here: DDP reduces it as it stands). Leftovers that are zeros (cleared through ``.data``) pass."""
        untouched = [grad.any().logical_not() for grad in self._untouched()]
        if (self._added_onto or untouched) and self._not_cleared(untouched):
            raise RuntimeError(_refusal("this backward adds onto", _OVERLAP_FIX))

    def _untouched(self) -> list[Tensor]:
        """The ``.grad`` of trainable parameters still as the last reducing backward left it."""
        grads = []
        for key, (grad_ref, version) in self._left.items():
            param = self._watched[key]()
            grad = None if param is None or not param.requires_grad else param.grad
            if grad is not None and grad is grad_ref() and grad._version == version:
                grads.append(grad)
        return grads

    def _left_grads(self, keys: list[int]) -> list[Tensor | None]:
        """Each parameter's ``.grad`` where it is still what the last reducing backward left (same tensor, same
        version), else None."""
        grads: list[Tensor | None] = []
        for key in keys:
            grad_ref, version = self._left[key]
            param = self._watched[key]()
            grad = None if param is None else param.grad
            grads.append(grad if grad is not None and grad is grad_ref() and grad._version == version else None)
        return grads

    def _not_cleared(self, others: list[Tensor]) -> bool:
        """Drop the sums cleared since (to None, or zeroed); whether any remains, or any of ``others`` (probes:
        True where zeros) is False. One host read per device."""
        written: dict[torch.device, list[tuple[int, Tensor]]] = {}
        remains = False
        for other in others:
            written.setdefault(other.device, []).append((-1, other))
        for key, (grad_ref, version) in list(self._added_onto.items()):
            param = self._watched[key]()
            if param is None or param.grad is None or param.grad is not grad_ref():
                del self._added_onto[key]  # cleared since
                continue
            if param.grad._version != version:  # written in place since: zeroed (then maybe a fresh backward)?
                probe = self._was_zero.get(key)
                probe = param.grad.any().logical_not() if probe is None else probe
            else:  # zeroed through .data (no version bump) before the backward that added onto it, or since
                probe = param.grad.any().logical_not()
                if (before := self._zero_before.get(key)) is not None:
                    probe = probe.logical_or(before)
            written.setdefault(param.grad.device, []).append((key, probe))
        for same_device in written.values():
            cleared = _host.read(
                torch.stack([probe for _, probe in same_device]), "accumulation guard: cleared in place"
            )
            for (key, _), zeroed in zip(same_device, cleared):
                if not zeroed:
                    remains = True
                elif key != -1:
                    del self._added_onto[key]
                    self._was_zero.pop(key, None)
                    self._zero_before.pop(key, None)
        return remains


_STEP_FIX = "use distoptim.ShardedDataParallel, which accumulates the owned gradient itself"
_OVERLAP_FIX = (
    "use the all-reduce hook inside the overlap hook (hook_with_zero_step(allreduce_hook, ddp, zero)), which leaves "
    "the average in every .grad. Nothing was stepped with the sum"
)


def _refusal(what: str, fix: str) -> str:
    return (
        f"{what} the gradients of a backward that reduce_to_owners_hook had reduced to their owners: only the owned "
        "ranges of .grad held the average (the rest were this rank's partial values), so the accumulated gradient "
        "is wrong. Clear the gradients between backwards (zero.zero_grad()), accumulate the micro-batches but the "
        f"last under ddp.no_sync(), or {fix}"
    )


class _Hook:
    """A parameter's gradient hook (``before``) or post-accumulate hook; holds the parameter weakly."""

    def __init__(self, guard: AccumulationGuard, param: Tensor, before: bool) -> None:
        self.guard, self.param, self.before = guard, weakref.ref(param), before

    def __call__(self, _: Tensor) -> Any:
        param = self.param()
        if param is not None:
            if self.before:
                self.guard.before_gradient(param)
            else:
                self.guard.after_accumulation(param)
        return None
