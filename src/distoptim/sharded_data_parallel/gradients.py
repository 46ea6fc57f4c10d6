"""The gradient side of ``ShardedDataParallel``: each parameter's gradient, as soon as autograd has accumulated it,
goes into its bucket and its ``.grad`` is released; full buckets are reduced to their owners in one fixed order,
and each rank keeps only its owned part (``OwnedGradients``), which ZeRO then clips, scales and steps.

A rank holds its owned gradient plus at most ``max_in_flight`` buckets; at the end of the backward the rest are
launched alike on every rank; the step's agreement (or ``clip_grad_norm_``'s) says which parameters some rank used
(an unused one has no gradient, as under DDP). The intake of ``.grad`` between backwards is
``intake.MarkerIntake``'s. ``docs/guides/internals.md``.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from distoptim._backward import at_end_of_backward
from distoptim._flat import flat_view, is_dense, owns_its_memory, view_like
from distoptim._host_memory import host_zeros
from distoptim.comm import agreement
from distoptim.comm import collectives as comm
from distoptim.sharded_data_parallel.buckets import BucketPlan, store_plan
from distoptim.sharded_data_parallel.intake import MarkerIntake
from distoptim.sharded_data_parallel.marker import GradientMarker
from distoptim.zero.buckets import ParameterSync
from distoptim.zero.shard import LocalTensor

if TYPE_CHECKING:
    from distoptim.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["OwnedGradients"]

POISONED = (
    "ShardedDataParallel: a backward raised after some of its gradient reductions were launched; the ranks' "
    "reductions no longer pair up (DDP's reducer is left the same way). Restart from a checkpoint: build the model, "
    "the optimizer and the wrapper again"
)
UNFINISHED = (
    "ShardedDataParallel: the last backward raised before it finished, so its gradient is partly reduced and cannot "
    "be stepped or added to. Call zero_grad() (it drops that gradient) before the next forward and step"
)


class OwnedGradients(MarkerIntake):
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
        self.sync, self.replanned = sync, replanned  # what the optimizer syncs through, and calls after placing
        self.params = zero.global_params
        first = [self.params[bucket.slots[0].index] for bucket in self.buckets]
        self.store_keys: dict[Hashable, tuple[torch.device, torch.dtype]] = {
            b.key: (p.device, reduce_dtype or p.dtype) for b, p in zip(self.buckets, first)
        }
        self.layout = store_plan(self.buckets, zero.rank, zero.plan)
        self.owned: list[Tensor | None] = [None] * len(self.buckets)  # each bucket's owned part, once landed
        self.slot_of = {id(self.params[s.index]): (b, s) for b, bucket in enumerate(self.buckets) for s in bucket.slots}
        self.landed = [False] * len(self.buckets)  # since the last clear(): read, and added to rather than copied
        self.used = [False] * len(self.params)  # by this rank, since the ranks last agreed (or the last clear)
        self.holds = [False] * len(self.params)  # some rank used it since the last clear, as agreed (zeros included)
        self.unagreed = False  # a backward flushed since the ranks last agreed on which parameters were used
        self.pieces: dict[int, list[tuple[int, int, int]]] = {}  # index -> its (bucket, start, length) in the store
        for (index, offset), (bucket, start) in self.layout.fragments.items():
            length = next(f.length for f in zero.plan.fragments[index] if f.offset == offset and f.rank == zero.rank)
            self.pieces.setdefault(index, []).append((bucket, start, length))
        self._markers: dict[int, tuple[GradientMarker, int]] = {}  # index -> the marker in .grad, and its version then
        self._unreduced: dict[int, weakref.ref[Tensor]] = {}  # index -> the .grad no_sync() left, not yet reduced
        self._swapped: set[int] = set()  # markers taken out of .grad for this backward to accumulate into
        self._task = -1  # the backward (graph task) whose start settled every parameter, until it ends
        self.no_sync = False
        self._filled: set[int] = set()  # parameters whose gradient this backward put into a bucket
        self._remaining = [len(bucket.slots) for bucket in self.buckets]
        self._buffers: dict[int, Tensor] = {}
        self._in_flight: deque[tuple[int, Tensor, Any]] = deque()
        self._next = 0
        self._backward = False
        self.shared = False  # this backward may reach another wrapper (on its own group): no waits before flushes
        if previous is not None:
            self._take_over(previous)

    # ------------------------------------------------------------------------------- what the step reads
    def grad_of(self, local: LocalTensor) -> Tensor | None:
        """``local``'s piece of its parameter's gradient: of a ``.grad`` set by hand, used as it is; else of the
        owned gradient (a view); None when the parameter has none (no rank used it since it was cleared)."""
        param = self.params[local.index]
        self.settle(local.index)
        if param.grad is not None and not self._is_marker(local.index, param.grad):
            if not local.whole and param.grad.stride() != param.stride():  # its pieces as views, for clipping
                param.grad = torch.empty_like(param).copy_(param.grad)
            return local.grad_from(param.grad)
        where = self.layout.fragments.get((local.index, local.offset))
        if where is None or not (self.holds[local.index] or self.used[local.index]) or self.owned[where[0]] is None:
            return None
        owned, start = self.owned[where[0]], where[1]
        assert owned is not None
        return view_like(owned, start, local.param) if local.whole else owned[start : start + local.length]

    def clear(self, set_to_none: bool = True) -> None:
        """``zero_grad``: forget the owned gradient (the next landing overwrites it) and which parameters were used.
        ``set_to_none=False`` zeroes it instead, as ``zero_grad`` zeroes ``.grad``: a parameter that had a gradient
        then has zeros where no rank used it (a plain optimizer steps it with zeros)."""
        reached = self._recover()  # a backward that raised before launching anything: its gradient is dropped
        self.landed = [not set_to_none] * len(self.buckets)
        self.used = [False] * len(self.params)
        self.unagreed = False
        if set_to_none:
            self.holds = [False] * len(self.params)
        self._unreduced.clear()
        if set_to_none:
            self._markers.clear()  # a marker kept and put back after this clear stands for nothing: refused
        for bucket, owned in enumerate(self.owned):
            if set_to_none:
                self.owned[bucket] = None
            elif owned is None:
                self.owned[bucket] = self._new_owned(bucket).zero_()
            else:
                owned.zero_()
        if not set_to_none:  # zeros where the raised backward reached, on every rank where any did (the step agrees)
            for index in reached:
                self.used[index] = self.unagreed = True
            self.mark()

    def _recover(self) -> set[int]:
        """After a backward that raised before it launched a reduction (nothing to pair up): drop its buckets, put
        back the markers it took out, and return the parameters it reached. Refused after one that launched."""
        if not self._backward:
            return set()
        if self._next:
            raise RuntimeError(POISONED)
        reached = set(self._filled)
        self._buffers.clear()
        self._next_backward_afresh()
        self._backward = False
        self._unswap()
        return reached

    def _next_backward_afresh(self) -> None:
        """No parameter's gradient in a bucket yet, and no bucket launched: as the next backward must find it."""
        self._filled.clear()
        self._remaining = [len(bucket.slots) for bucket in self.buckets]
        self._next = 0

    def check_finished(self) -> None:
        """Refuse a gradient a backward that raised midway left (local, as DDP's reducer): after one that launched
        a reduction, for good (restart from a checkpoint); after one that launched none, until ``zero_grad()``."""
        if self._backward:
            raise RuntimeError(POISONED if self._next else UNFINISHED)

    # ------------------------------------------------------------------- which parameters some rank used
    def prepare_step(self) -> bool:
        """Before a step reads the gradient (inside its agreement): refuse what cannot be read, take in what the
        program did to ``.grad``; whether this rank already knows which of its owned parameters some rank used
        (every one it owns was used here, or is held), so that it may step before the ranks agree."""
        self.check_finished()
        for index in range(len(self.params)):
            self.settle(index)
        return not self.unagreed or all(
            self.holds[i] or self.used[i] for i in self.pieces if self.params[i].requires_grad
        )

    def agreed(self, everywhere: Sequence[bool]) -> None:
        """The ranks agreed which parameters some rank used (``everywhere``, from the step's ``used`` flags): the
        store holds those; markers of the others go."""
        self.holds = [held or now for held, now in zip(self.holds, everywhere)]
        self.used = [False] * len(self.params)
        self.unagreed = False
        for index, (marker, _) in list(self._markers.items()):
            if not self.holds[index] and self.params[index].grad is marker:
                self.params[index].grad = None
                del self._markers[index]
        self.mark()

    def ready(self) -> None:
        """Before ``clip_grad_norm_`` reads the gradient: ``prepare_step`` (its refusals local, as DDP's), then, where a
        backward ran since the ranks last agreed, the used flags agreed (one all-reduce on the control plane)."""
        self.prepare_step()
        if self.unagreed:
            groups = self.zero.agreement_groups
            self.agreed(agreement.agree_across_ranks({}, groups, "clip_grad_norm_", flags=self.used))

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
        index = self.zero.index_of(param)
        if index is not None:
            self.used[index] = True
            self._swapped.discard(index)
        if self.no_sync:
            if index is not None and param.grad is not None:
                self._unreduced[index] = weakref.ref(param.grad)
            return  # the local gradient accumulates in .grad until a backward outside no_sync
        if not self._backward:
            self._backward = True
            self.zero.land_sync()  # buckets no module of the forward read (local: step() launched every one)
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
        """Whether ``grad`` can be bucket ``bucket`` itself: laid out flat it is exactly the bucket (its only
        parameter, no padding, the bucket's dtype, the parameter's memory order), and its memory is its own. Autograd
        may hand a parameter a gradient that shares memory with one another branch of the backward still needs (a
        parameter read through a view and added to an activation): reduced in place, that branch would read it
        scaled and summed."""
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
        """Bucket ``bucket``'s buffer (``gradient``, or zeros, when it has none yet), once fewer than
        ``max_in_flight`` buckets are filling or in flight."""
        if bucket not in self._buffers:
            while len(self._buffers) + len(self._in_flight) >= self.max_in_flight and self._in_flight:
                if self.shared:  # another wrapper's reductions may come first on other ranks: no wait before flushes
                    break
                self._land_oldest()
            plan = self.buckets[bucket]
            device, dtype = self.store_keys[plan.key]
            self._buffers[bucket] = gradient if gradient is not None else host_zeros(plan.numel, dtype, device)
        return self._buffers[bucket]

    def _launch_ready(self) -> None:
        """Launch, in order, every bucket whose parameters have all handed in their gradients. Not while another
        wrapper shares the backward under hybrid sharding: a launch there waits for the shard group's sums before
        summing across replicas, and with a rank-dependent graph one rank waited in one wrapper's reduction while its
        peer waited in the other's (a hang); the flush launches them, wrapper after wrapper."""
        if self.shared and self.zero.replicate_group is not None:
            return
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
        ``clear()``)."""
        bucket, buffer, reduced = self._in_flight.popleft()
        reduced.wait()
        owned = self.owned[bucket]
        if owned is None:  # its first landing since zero_grad(): allocated here, and copied into, not added to
            owned = self.owned[bucket] = self._new_owned(bucket)
        at = 0
        for start, end in self.buckets[bucket].owned(self.zero.rank):
            target = owned[at : at + end - start]
            target.add_(buffer[start:end]) if self.landed[bucket] else target.copy_(buffer[start:end])
            at += end - start
        self.landed[bucket] = True

    def flush(self) -> None:
        """The end of a backward: every bucket launched (in order, with the gradients accumulated under
        ``no_sync`` that this backward did not touch) and landed; gradients of parameters trainable since the plan
        was made are averaged in their ``.grad``; the ranks agree which parameters some rank used (one small
        all-reduce), and markers go in: ``.grad`` is None exactly where no rank used the parameter, as under DDP
        (a program's ``if p.grad is None: p.grad = zeros`` must see what DDP's sees)."""
        self._backward = False
        self._launch_the_rest()
        while self._in_flight:
            self._land_oldest()
        self._next_backward_afresh()
        self._average_unplaced()
        self.unagreed = True
        self.agreed(agreement.agree_across_ranks({}, self.zero.agreement_groups, "backward", flags=self.used))

    def _average_unplaced(self) -> None:
        """The local gradients of the parameters no bucket holds yet (made trainable since the plan), averaged in
        their ``.grad``, for the step that places them (every rank trains the same ones: the step agrees on it)."""
        zero, params = self.zero, self.params
        for index, param in enumerate(params):
            if param.requires_grad and id(param) not in self.slot_of and param.numel():
                self.used[index] = self.used[index] or param.grad is not None
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
                for group in zero.agreement_groups:
                    comm.all_reduce_(grad, group)
                param.grad = grad.div_(zero.world_size * zero.replica_count)

    def _launch_the_rest(self) -> None:
        """Launch, in order, the buckets this backward has not: with the gradients it did not reach (``no_sync()``'s,
        or set by hand; not markers) and zeros for the parameters this rank did not use."""
        for bucket in range(self._next, len(self.buckets)):
            for slot in self.buckets[bucket].slots:
                param = self.params[slot.index]
                grad = param.grad
                if slot.index not in self._filled and grad is not None and not self._is_marker(slot.index, grad):
                    self.used[slot.index] = True  # its gradient is reduced and stepped, as DDP + torch.optim would
                    self._fill(bucket, slot, param)
            self._launch(bucket)

    def _take_over(self, previous: OwnedGradients) -> None:
        """After the plan grew: keep what ``previous`` had landed (its buckets come first, laid out alike), and take
        the averaged ``.grad`` of parameters placed since into their new buckets."""
        self.owned[: len(previous.owned)] = previous.owned
        self.landed[: len(previous.landed)] = previous.landed
        self.used[: len(previous.used)] = previous.used
        self.holds[: len(previous.holds)] = previous.holds
        self._markers, self._unreduced, self.unagreed = previous._markers, previous._unreduced, previous.unagreed
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
        self.mark()


def _done(value: Tensor) -> Any:
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    future.set_result(value)
    return future
