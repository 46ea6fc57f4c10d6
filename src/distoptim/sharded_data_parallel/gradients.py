"""The gradient side of ``ShardedDataParallel``: the store is the gradient's only home. Each parameter's gradient,
once autograd has accumulated it, goes into its bucket and ``.grad`` is set back to None; full buckets are reduced to
their owners in one fixed order, and each rank keeps its owned part, which ZeRO clips, scales and steps.
``zero.step()`` consumes it; ``zero_grad()`` through the optimizer or the wrapper clears it.

Memory: the owned gradient (about 1/N) plus at most ``max_in_flight`` buckets filling or in flight. Which parameters
some rank used (a parameter no rank used gets no gradient, as under DDP with ``find_unused_parameters``) is agreed
once per step (``agree_on_use``), not per backward. A backward that raised midway leaves its reductions unmatched:
the store refuses everything after it (``check_finished``), as DDP's reducer does.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from distoptim._backward import at_end_of_backward
from distoptim._flat import flat_view, is_dense, owns_its_memory, view_like
from distoptim._host_memory import host_zeros
from distoptim.comm import agreement
from distoptim.comm import collectives as comm
from distoptim.sharded_data_parallel.buckets import BucketPlan, store_plan
from distoptim.zero.buckets import ParameterSync
from distoptim.zero.shard import LocalTensor

if TYPE_CHECKING:
    from distoptim.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["OwnedGradients"]

POISONED = (
    "ShardedDataParallel: a backward raised before it finished, after some of its gradient reductions were "
    "launched; the ranks' reductions no longer pair up (DDP's reducer is left the same way). Restart from a "
    "checkpoint: build the model, the optimizer and the wrapper again"
)
UNREDUCED = (
    "ShardedDataParallel: zero.step() found gradients that backward passes under model.no_sync() accumulated and no "
    "backward outside no_sync() reduced (each rank's own, unaveraged). Run the last micro-batch's backward outside "
    "no_sync(), or call zero.zero_grad() to drop them"
)


class OwnedGradients:
    """This rank's owned gradient of ``zero``'s parameters, filled bucket by bucket during each backward."""

    def __init__(
        self,
        zero: ZeroRedundancyOptimizer,
        buckets: Sequence[BucketPlan],
        reduce_dtype: torch.dtype | None,
        sync: ParameterSync,
        replanned: Callable[[], None],
        max_in_flight: int = 2,
        previous: OwnedGradients | None = None,
    ) -> None:
        self.zero, self.buckets, self.max_in_flight = zero, list(buckets), max_in_flight
        self.sync, self.replanned = sync, replanned  # what the optimizer runs after a step, and after a re-placement
        self.params = zero.global_params
        first = [self.params[bucket.slots[0].index] for bucket in self.buckets]
        self.store_keys: dict[Hashable, tuple[torch.device, torch.dtype]] = {
            b.key: (p.device, reduce_dtype or p.dtype) for b, p in zip(self.buckets, first)
        }
        self.layout = store_plan(self.buckets, zero.rank, zero.plan)
        self.owned: list[Tensor | None] = [None] * len(self.buckets)  # each bucket's owned part, once landed
        self.slot_of = {id(self.params[s.index]): (b, s) for b, bucket in enumerate(self.buckets) for s in bucket.slots}
        self.landed = [False] * len(self.buckets)  # since the last clear: added to rather than copied into
        self.used = [False] * len(self.params)  # by this rank, since the last agreement on use
        self.holds = [False] * len(self.params)  # the store holds the parameter's gradient (zeros included)
        self.had = [False] * len(self.params)  # held one when the last step consumed it (zero_grad to zeros)
        self._unreduced: dict[int, weakref.ref[Tensor]] = {}  # index -> the .grad no_sync() left, not yet reduced
        self.no_sync = False
        self._unagreed = False  # a backward reduced since the ranks last agreed on which parameters were used
        self._stepping = False  # inside zero.step(): a closure's backward is agreed on at its end
        self._filled: set[int] = set()  # parameters whose gradient this backward put into a bucket
        self._remaining = [len(bucket.slots) for bucket in self.buckets]
        self._buffers: dict[int, Tensor] = {}
        self._in_flight: deque[tuple[int, Tensor, Any]] = deque()
        self._next = 0
        self._backward = False  # between a backward's first gradient and its flush
        self.shared = False  # this backward reached another wrapper (on another group): no waits before the flushes
        self.successor: OwnedGradients | None = None  # the store built over the next placement, once there is one
        if previous is not None:
            self._take_over(previous)

    # ------------------------------------------------------------------------------- what the step reads
    def grad_of(self, local: LocalTensor) -> Tensor | None:
        """``local``'s piece of its parameter's gradient: of a ``.grad`` the program set since the last backward,
        used as it is (as a plain optimizer would); else of the owned gradient (a view); None where none is held."""
        param = self.params[local.index]
        if param.grad is not None:
            if self._unreduced.get(local.index, _dead)() is param.grad:
                raise RuntimeError(UNREDUCED)
            if not local.whole and param.grad.stride() != param.stride():  # its pieces as views, for clipping
                param.grad = torch.empty_like(param).copy_(param.grad)
            return local.grad_from(param.grad)
        where = self.layout.fragments.get((local.index, local.offset))
        if where is None or not self.holds[local.index] or self.owned[where[0]] is None:
            return None
        owned, start = self.owned[where[0]], where[1]
        assert owned is not None
        return view_like(owned, start, local.param) if local.whole else owned[start : start + local.length]

    def check_finished(self) -> None:
        """Refuse anything after a backward that raised midway (its flush never ran): local, as DDP's reducer."""
        if self._backward:
            raise RuntimeError(POISONED)

    def ready(self) -> None:
        """Before the gradient is read (``step``, ``clip_grad_norm_``; collective on every rank alike): refuse a
        raised backward, and agree on which parameters some rank used since the last agreement."""
        self.check_finished()
        if self._unagreed:
            self.agree_on_use()

    def agree_on_use(self) -> None:
        """One all-reduce (MAX) of the used flags on the control plane: a parameter no rank used since the last
        clear has no gradient at the step (the optimizer skips it, as under DDP); one some rank used has its sum."""
        everywhere = agreement.agree_across_ranks({}, self.zero.agreement_groups, "backward", flags=self.used)
        self.holds = [held or now for held, now in zip(self.holds, everywhere)]
        self._unagreed = False

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """Around ``zero.step()``'s local part: ``ready`` first (a closure's backward inside is agreed at its end);
        then the step consumed the gradient, which is dropped (its buffers freed)."""
        self.ready()
        self._stepping = True
        try:
            yield
        finally:
            current = self
            while current.successor is not None:  # the step placed again: its store took over from this one
                current = current.successor
            current._stepping = False
            if not current._backward:  # else refused at the next forward, step or clear
                current.had = [had or held for had, held in zip(current.had, current.holds)]
                current._drop(to_zeros=False)

    def clear(self, set_to_none: bool = True) -> None:
        """``zero_grad``: drop the owned gradient, or with ``set_to_none=False`` zero it where a parameter had one
        (since the last step too), so that a plain optimizer steps it with zeros where no rank uses it, as DDP's."""
        self.check_finished()
        if not set_to_none:
            self.holds = [had or held for had, held in zip(self.had, self.holds)]
        self.had = [False] * len(self.params)
        self._drop(to_zeros=not set_to_none)

    def _drop(self, to_zeros: bool) -> None:
        self.landed = [to_zeros] * len(self.buckets)
        self.used = [False] * len(self.params)
        self._unagreed = False
        self._unreduced.clear()
        if not to_zeros:
            self.holds = [False] * len(self.params)
        for bucket, owned in enumerate(self.owned):
            if not to_zeros:
                self.owned[bucket] = None
            elif owned is None:
                self.owned[bucket] = self._new_owned(bucket).zero_()
            else:
                owned.zero_()

    def _new_owned(self, bucket: int) -> Tensor:
        device, dtype = self.store_keys[self.buckets[bucket].key]
        return host_zeros(self.layout.lengths[bucket], dtype, device)

    # ------------------------------------------------------------------------------------- the backward
    @property
    def in_backward(self) -> bool:
        """Between a backward's first gradient and its flush (still so after a backward that raised)."""
        return self._backward

    def on_grad(self, param: Tensor) -> None:
        """A post-accumulate-grad hook: ``param.grad`` into its bucket, ``.grad`` released, full buckets launched."""
        index = self.zero._index_of(param)
        if index is not None:
            self.used[index] = True
        if self.no_sync:
            if index is not None and param.grad is not None:
                self._unreduced[index] = weakref.ref(param.grad)
            return  # the local gradient accumulates in .grad until a backward outside no_sync
        if not self._backward:
            self._backward = True
            self.zero._land_sync()  # buckets no module of the forward read (local: step() launched every one)
            at_end_of_backward(self.flush)
        entry = self.slot_of.get(id(param))
        if entry is None or param.grad is None:  # trainable since the plan was made: averaged at the end
            return
        bucket, slot = entry
        self._fill(bucket, slot, param)
        self._launch_ready()
        while self._in_flight and self._in_flight[0][2].done():  # its buffer freed now, not when one is needed
            self._land_oldest()

    def _fill(self, bucket: int, slot: Any, param: Tensor) -> None:
        grad = param.grad
        assert grad is not None
        if slot.index in self._filled:
            raise RuntimeError(
                f"ShardedDataParallel: parameter {slot.index} of the optimizer received a second gradient in one "
                "backward, after its first went into its bucket (reentrant activation checkpointing, "
                "checkpoint(..., use_reentrant=True), with the parameter also used outside the checkpoint does "
                "this). Use checkpoint(..., use_reentrant=False), or use the parameter on one side only"
            )
        if bucket not in self._buffers and self._is_whole_bucket(bucket, param, grad):
            self._buffer(bucket, flat_view(grad))  # the gradient is the bucket (a parameter over the cap): no copy
        else:
            view_like(self._buffer(bucket), slot.position, param).copy_(grad)
        param.grad = None
        self._unreduced.pop(slot.index, None)
        self._filled.add(slot.index)
        self._remaining[bucket] -= 1

    def _is_whole_bucket(self, bucket: int, param: Tensor, grad: Tensor) -> bool:
        """Whether ``grad`` can be bucket ``bucket`` itself: its only parameter, no padding, the bucket's dtype, the
        parameter's memory order, and memory of its own (a gradient sharing memory with one another branch of the
        backward still reads would be read scaled and summed)."""
        plan = self.buckets[bucket]
        return (
            len(plan.slots) == 1
            and plan.numel == grad.numel()
            and (grad.device, grad.dtype) == self.store_keys[plan.key]
            and grad.stride() == param.stride()
            and is_dense(grad)
            and owns_its_memory(grad)
        )

    def _buffer(self, bucket: int, gradient: Tensor | None = None) -> Tensor:
        """Bucket ``bucket``'s buffer (``gradient``, or zeros), once fewer than ``max_in_flight`` are in use."""
        if bucket not in self._buffers:
            while len(self._buffers) + len(self._in_flight) >= self.max_in_flight and self._in_flight:
                if self.shared:  # the other ranks may launch it only in a flush: waiting here could wait forever
                    break
                self._land_oldest()
            plan = self.buckets[bucket]
            device, dtype = self.store_keys[plan.key]
            self._buffers[bucket] = gradient if gradient is not None else host_zeros(plan.numel, dtype, device)
        return self._buffers[bucket]

    def _launch_ready(self) -> None:
        """Launch, in order, every bucket whose parameters have all handed in their gradients."""
        while self._next < len(self.buckets) and not self._remaining[self._next]:
            self._launch(self._next)

    def _launch(self, bucket: int) -> None:
        zero, plan = self.zero, self.buckets[bucket]
        buffer = self._buffer(bucket)
        del self._buffers[bucket]
        buffer.div_(zero.world_size * zero.replica_count)
        reduced = comm.reduce_to_owners_async(
            buffer, plan.route, zero.process_group, zero.collectives, replicas=zero.replicate_group
        )
        self._in_flight.append((bucket, buffer, reduced))
        self._next = bucket + 1

    def _land_oldest(self) -> None:
        """Wait for the oldest reduction and add its owned sums into the owned gradient (copy: the first since
        the last clear)."""
        bucket, buffer, reduced = self._in_flight.popleft()
        reduced.wait()
        owned = self.owned[bucket]
        if owned is None:  # its first landing since the last clear: allocated here, and copied into
            owned = self.owned[bucket] = self._new_owned(bucket)
        at = 0
        for start, end in self.buckets[bucket].owned(self.zero.rank):
            target = owned[at : at + end - start]
            target.add_(buffer[start:end]) if self.landed[bucket] else target.copy_(buffer[start:end])
            at += end - start
        self.landed[bucket] = True

    def flush(self) -> None:
        """The end of a backward: the remaining buckets launched in order (with the gradients it did not reach:
        ``no_sync()``'s or set by hand, zeros for the parameters this rank did not use) and landed; gradients of
        parameters trainable since the plan was made are averaged in their ``.grad``."""
        for bucket in range(self._next, len(self.buckets)):
            for slot in self.buckets[bucket].slots:
                param = self.params[slot.index]
                if slot.index not in self._filled and param.grad is not None:
                    self.used[slot.index] = True  # reduced and stepped, as DDP + torch.optim would
                    self._fill(bucket, slot, param)
            self._launch(bucket)
        while self._in_flight:
            self._land_oldest()
        self._filled.clear()
        self._remaining = [len(bucket.slots) for bucket in self.buckets]
        self._next = 0
        self._average_unplaced()
        self._backward, self._unagreed, self.shared = False, True, False
        if self._stepping:  # a closure's backward: every rank runs it, failing ones too (optimizer._prepare)
            self.agree_on_use()

    def _average_unplaced(self) -> None:
        """The local gradients of parameters no bucket holds yet (trainable since the plan) averaged in ``.grad``,
        for the step that places them."""
        zero = self.zero
        for index, param in enumerate(self.params):
            if param.requires_grad and param.numel() and id(param) not in self.slot_of:
                self.used[index] = self.used[index] or param.grad is not None
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
                for group in zero.agreement_groups:
                    comm.all_reduce_(grad, group)
                param.grad = grad.div_(zero.world_size * zero.replica_count)

    def _take_over(self, previous: OwnedGradients) -> None:
        """After the plan grew: keep what ``previous`` had landed (its buckets come first, laid out alike), and take
        the averaged ``.grad`` of parameters placed since into their new buckets."""
        self.owned[: len(previous.owned)] = previous.owned
        self.landed[: len(previous.landed)] = previous.landed
        for mine, theirs in ((self.used, previous.used), (self.holds, previous.holds), (self.had, previous.had)):
            mine[: len(theirs)] = theirs
        self._unreduced, self._unagreed, self._stepping = previous._unreduced, previous._unagreed, previous._stepping
        self._backward = previous._backward  # a backward that raised stays refused
        previous.successor = self
        for bucket in range(len(previous.buckets), len(self.buckets)):
            plan = self.buckets[bucket]
            buffer = torch.zeros(plan.numel, dtype=self.store_keys[plan.key][1], device=self.store_keys[plan.key][0])
            for slot in plan.slots:
                param = self.params[slot.index]
                if param.grad is not None:
                    view_like(buffer, slot.position, param).copy_(param.grad)
                    param.grad = None
                    self.holds[slot.index] = True
            self._in_flight.append((bucket, buffer, _done(buffer)))
            self.landed[bucket] = False
            self._land_oldest()


def _done(value: Tensor) -> Any:
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    future.set_result(value)
    return future


def _dead() -> None:
    return None
