"""The overlap-mode step of a ZeroRedundancyOptimizer: functional optimizers over its local shard, stepped by the
DDP hooks (``ddp/zero_step.py``) with gradients straight from DDP's buckets, never from ``.grad``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from distoptim import _host
from distoptim._flat import copy_each_
from distoptim.comm import collectives as comm
from distoptim.functional import FunctionalOptimizer
from distoptim.zero import amp
from distoptim.zero.buckets import StagedSync, owned_bytes, staged_sync_of
from distoptim.zero.local_optimizer import CompositeOptimizer
from distoptim.zero.placement import Placement
from distoptim.zero.shard import LocalTensor
from distoptim.zero.state_formats import StateFormats

__all__ = ["OverlapStepper", "buckets_final"]

# The warm-up's stages: waiting for DDP's final buckets, the backward after them (torch's hook learns them), over.
_WAITING, _LEARNING, _OVER = "waiting", "learning", "over"

# torch.optim.lr_scheduler reads this attribute to tell whether optimizer.step() ran before its own step().
_SCHEDULER_SAW_STEP = "_opt_called"


class OverlapStepper:
    """The overlap-mode step of one ZeroRedundancyOptimizer: functional optimizers over the local param groups,
    sharing the local optimizer's ``state`` (in its formats) and reading the global ``param_groups`` at every step."""

    def __init__(
        self,
        functional_cls: type[FunctionalOptimizer],
        group: comm.Group,
        collectives: comm.Collectives,
        stepped_flag_on: object,
        on_step: Callable[[], None],
    ) -> None:
        self.functional_cls = functional_cls
        self._on_step = on_step  # the optimizer's own after-step bookkeeping (a consolidated state is stale)
        self.group, self.collectives = group, collectives
        self._stepped_flag_on = stepped_flag_on  # the optimizer LR schedulers watch
        self._hooked = False
        self._warmup = _WAITING  # torch's warm-up: no step until DDP's buckets are final, then one more backward
        self.stepped = False  # by a hook since the last zero_grad()
        self._unconfirmed = False  # stepped by a hook since the last zero.step()
        self._deferred_finish: Callable[[], None] | None = None  # a joined rank's step, for ZeRO's join hook
        self._grad_seen: tuple[int, int] | None = None

    def rebuild(
        self,
        local_optimizer: Optimizer,
        placed: Placement,
        global_params: list[Tensor],
        param_groups: list[dict[str, Any]],
    ) -> None:
        """Forget the functional optimizers over the local shard's tensors (after every placement, the first too)."""
        self.local_optimizer, self.placed = local_optimizer, placed
        self.formats: StateFormats | None = (  # set by placement.bind_local_optimizer where a group takes a format
            local_optimizer.formats if isinstance(local_optimizer, CompositeOptimizer) else None
        )
        self.global_params, self.param_groups = global_params, param_groups
        defaults = self.functional_cls.spec.defaults
        self._options = [{k: v for k, v in group.items() if k in defaults} for group in local_optimizer.param_groups]
        self._locals_of: dict[Tensor, list[tuple[int, LocalTensor]]] = {}  # parameter -> (group, local tensor)
        for index, locals_ in enumerate(placed.shard.groups):
            for local in locals_:
                self._locals_of.setdefault(local.param, []).append((index, local))
        self._parts: dict[tuple[Tensor, ...], list[_Part]] = {}  # by the parameters stepped together
        self._bucket_syncs: dict[tuple[Tensor, ...], StagedSync] = {}
        pieces = [piece for layout in placed.sync.layouts for piece in layout.pieces]  # the whole sync's
        self._relay = comm.relayed(owned_bytes(pieces, comm.group_size(self.group)))  # bucket syncs relay as it would

    def step(self, grads: dict[Tensor, Tensor | None]) -> None:
        """Step the owned fragments of the parameters in ``grads`` (a DDP bucket) with those gradients (None: skip)."""
        state, self.placed.shard.unsynced = self.local_optimizer.state, True  # until the sync (LocalShard.check_synced)
        for part in self._parts_for(grads):
            functional, group = part.functional, self.param_groups[part.group]
            functional.state = state  # load_state_dict may have replaced the local optimizer's state
            functional.param_group.update((k, group[k]) for k in functional.defaults if k in group)
            step_grads = [local.grad_for_step(grads.get(local.param)) for local in part.locals]
            if self.formats is None:
                functional.step(step_grads)
            else:
                tensors = [local.tensor for local, grad in zip(part.locals, step_grads) if grad is not None]
                with self.formats.decoded_for(tensors, state):
                    functional.step(step_grads)
            copy_each_(part.write_into, part.write_from)  # master copies, rounded into their parameters
        self.stepped = self._unconfirmed = True
        setattr(self._stepped_flag_on, _SCHEDULER_SAW_STEP, True)  # a scheduler stepped after this step must not warn
        self._on_step()

    def synced(self) -> None:
        """Every bucket this backward stepped reached every rank (the interleaved hook's syncs landed)."""
        self.placed.shard.unsynced = False

    @property
    def warmup_over(self) -> bool:
        """Whether the hooked backwards step now: the warm-up is over (or was skipped: ``step_from_first_backward``)."""
        return self._warmup == _OVER

    def attach_hook(self, step_from_first_backward: bool) -> None:
        """A DDP hook now steps this optimizer (at most one may); ``step_from_first_backward`` skips the warm-up."""
        if self._hooked:
            raise ValueError("a ZeRO overlap hook is already registered for this ZeroRedundancyOptimizer")
        self._hooked = True
        if step_from_first_backward:
            self._warmup = _OVER

    def defer_finish(self, finish: Callable[[], None]) -> None:
        """A joined rank's end of backward, run by ``run_deferred`` from ZeRO's join hook after DDP's."""
        self._deferred_finish = finish

    def run_deferred(self) -> None:
        finish, self._deferred_finish = self._deferred_finish, None
        if finish is not None:
            finish()

    def begin_backward(self, buckets_final: Callable[[], bool]) -> bool:
        """At a hooked backward's first bucket: whether it is a warm-up backward (as torch's: until DDP has rebuilt its
        buckets, and the backward after), which takes no step."""
        if self._warmup == _WAITING:
            if buckets_final():
                self._warmup = _LEARNING
            return True
        if self._warmup == _LEARNING:
            self._warmup = _OVER
        return False

    def check_formats(self) -> None:
        """Refuse a group whose ``state_format`` was edited since it was added (in the hooks' agreement)."""
        if self.formats is not None:
            self.formats.check_unchanged(self.param_groups)

    def skip_step(self) -> None:
        """The end of a warm-up backward: nothing stepped, but ``zero_grad`` and ``step()`` see the hook's backward."""
        self.stepped = self._unconfirmed = True

    def _parts_for(self, grads: dict[Tensor, Tensor | None]) -> list[_Part]:
        """This rank's tensors of the parameters in ``grads``, one part per local param group (cached)."""
        key = tuple(grads)
        if key not in self._parts:
            by_group: dict[int, list[LocalTensor]] = {}
            for param in key:
                for index, local in self._locals_of.get(param, ()):
                    by_group.setdefault(index, []).append(local)
            self._parts[key] = [self._part(index, locals_) for index, locals_ in sorted(by_group.items())]
        return self._parts[key]

    def _part(self, index: int, locals_: list[LocalTensor]) -> _Part:
        tensors = [local.tensor for local in locals_]
        functional = self.functional_cls(tensors, **self._options[index], _allow_empty_param_list=True)
        masters = [local for local in locals_ if local.master]
        write_into = [local.param if local.whole else local.param_piece() for local in masters]
        return _Part(index, functional, locals_, write_into, [local.tensor for local in masters])

    def explicit_step(
        self, closure: Callable[[], float] | None, grad_scaler: Any, kwargs: dict[str, Any]
    ) -> float | None:
        """``zero.step()`` in overlap mode: runs the ``closure``, then only checks that a hook stepped since."""
        amp.refuse_in_overlap_mode(grad_scaler, self._stepped_flag_on)
        if kwargs:
            raise TypeError(
                "ZeroRedundancyOptimizer(overlap_with_ddp=True).step() takes no keyword arguments, got "
                f"{sorted(kwargs)}: the step already ran inside DDP's backward"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._hooked:
            raise RuntimeError(
                "ZeroRedundancyOptimizer(overlap_with_ddp=True) steps inside DDP's backward, but no overlap hook is "
                "registered: call ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero)) (or "
                "the interleaved one) before training; step() then only confirms the hook's step"
            )
        if not self._unconfirmed:
            raise RuntimeError(
                "ZeroRedundancyOptimizer(overlap_with_ddp=True): the DDP comm hook has not stepped since the last "
                "step(); run loss.backward() on the DDP model's output before step() (the step runs inside DDP's "
                "backward, and step() only confirms it once per backward)"
            )
        self._unconfirmed = False
        return loss

    def bucket_sync(self, params: list[Tensor]) -> StagedSync:
        """The staged broadcast of one DDP bucket's parameters from their owners, relayed as the whole sync would be."""
        key = tuple(params)
        if key not in self._bucket_syncs:
            chosen = [self.placed.index[id(param)] for param in params if id(param) in self.placed.index]
            self._bucket_syncs[key] = staged_sync_of(
                self.placed.plan, self.global_params, chosen, self.group, self.collectives, self._relay
            )
        return self._bucket_syncs[key]

    def check_stepped(self) -> None:
        """Called by ``zero_grad``: gradients arrived since the last call but no hook stepped -> say so."""
        seen = self._grad_marker()
        if seen is not None and seen != self._grad_seen and not self.stepped:
            raise RuntimeError(
                "ZeroRedundancyOptimizer(overlap_with_ddp=True) has gradients but no optimizer step ran: register "
                "hook_with_zero_step(allreduce_hook, ddp, zero) (or the interleaved one) with "
                "ddp.register_comm_hook(None, ...) so that DDP's backward steps the optimizer"
            )
        self.stepped = False

    def record_grads(self) -> None:
        self._grad_seen = self._grad_marker()

    def _grad_marker(self) -> tuple[int, int] | None:
        """Identity and version of the first gradient a trainable parameter holds: changes whenever a backward wrote
        one (an unused first parameter hides nothing)."""
        grad = next((p.grad for p in self.global_params if p.requires_grad and p.grad is not None), None)
        return None if grad is None else (id(grad), grad._version)


def buckets_final(ddp: Any) -> Callable[[], bool]:
    """Whether ``ddp``'s buckets are final (the end of torch's warm-up), asked at a warm-up backward's first bucket."""
    asked = []

    def final() -> bool:
        asked.append(True)
        if ddp.find_unused_parameters and not ddp.static_graph:  # DDP never rebuilds: torch's hooks never step
            return len(asked) >= 2  # distoptim takes them final where DDP would rebuild them, alike on every rank
        # DDP's private flag, as torch's hooks read it; MAX over the group: a rank that joined early never sets it
        device = comm.comm_device(ddp.process_group, [p.device for p in ddp.module.parameters()])
        flag = torch.tensor([ddp._has_rebuilt_buckets], dtype=torch.uint8, device=device)
        comm.all_reduce_(flag, ddp.process_group, "max")
        return bool(_host.read(flag, "whether DDP rebuilt its buckets")[0])

    return final


@dataclass
class _Part:
    """The owned tensors of one local param group among a set of parameters, and the functional optimizer over them."""

    group: int
    functional: FunctionalOptimizer
    locals: list[LocalTensor]
    write_into: list[Tensor]
    write_from: list[Tensor]
