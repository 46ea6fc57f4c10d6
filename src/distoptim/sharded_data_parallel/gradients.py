"""The gradient side of ``ShardedDataParallel``: gradients go into buckets reduced to their owners in one fixed order,
and each rank keeps its owned part (``OwnedGradients``) for ZeRO to step. ``docs/guides/internals.md`` has more."""

from __future__ import annotations

import copy
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge

from distoptim import _host
from distoptim._backward import at_end_of_backward, in_backward
from distoptim._flat import flat_view, is_dense, owns_its_memory, view_like
from distoptim.comm import agreement
from distoptim.comm import collectives as comm
from distoptim.comm.averaging import completed_future
from distoptim.sharded_data_parallel import checks
from distoptim.sharded_data_parallel.buckets import BucketPlan, gaps, narrowed, store_plan
from distoptim.sharded_data_parallel.marker import GradientMarker
from distoptim.sharded_data_parallel.unplaced import SAME_TRAINABLE, Unplaced
from distoptim.zero import amp
from distoptim.zero.buckets import ParameterSync
from distoptim.zero.shard import LocalTensor

if TYPE_CHECKING:
    from distoptim.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["OwnedGradients"]


class OwnedGradients:
    """This rank's owned gradient of ``zero``'s parameters, filled bucket by bucket during each backward."""

    max_in_flight = 2  # the most buckets being filled or reduced at once
    overflow: bool | Tensor | None  # under a GradScaler, each backward's end's inf/nan sum (``overflow_found``)

    def __init__(
        self, wrapper: Any, buckets: Sequence[BucketPlan], sync: ParameterSync, replanned: Callable[[], None]
    ) -> None:
        self.wrapper, self.replanned = wrapper, replanned  # the ShardedDataParallel whose hooks these are; its rebuild
        self.zero: ZeroRedundancyOptimizer = wrapper.zero
        self.static = checks.StaticGraph() if wrapper.static_graph else None  # DDP's promise
        self.late: list[int] = []  # static_graph=True: placed since the ranks last agreed (their .grad: the ranks' own)
        self.scaled = False  # the last step's ranks, agreed, used a GradScaler: each backward's end sums inf/nan too
        self._build(buckets, sync)

    def _build(self, buckets: Sequence[BucketPlan], sync: ParameterSync) -> None:
        """Everything over ``buckets``, as new (``replan`` then keeps what the last plan held)."""
        zero, reduce_dtype = self.zero, self.wrapper.reduce_dtype
        self.buckets, self.sync, self.params = list(buckets), sync, zero.global_params  # sync: the optimizer's
        self.store_keys: dict[Hashable, tuple[torch.device, torch.dtype]] = {  # each bucket's first parameter's
            b.key: ((p := self.params[b.slots[0].index]).device, reduce_dtype or p.dtype) for b in self.buckets
        }
        self.layout = store_plan(self.buckets, zero.rank, zero.plan)
        self.owned: list[Tensor | None] = [None] * len(self.buckets)  # each bucket's owned part, once landed
        self.slot_of = {id(self.params[s.index]): (b, s) for b, bucket in enumerate(self.buckets) for s in bucket.slots}
        self.landed = [False] * len(self.buckets)  # since the last clear(): read, and added to rather than copied
        self.used = [False] * len(self.params)  # by this rank, since the ranks last agreed (or the last clear)
        self.holds = [False] * len(self.params)  # some rank used it since the last clear, as agreed (zeros included)
        self.unagreed = False  # a backward flushed since the ranks last agreed on which parameters were used
        self.dropped: set[int] = set()  # set to None since then: nothing held (a static graph's check counts them)
        self.pieces = self.layout.pieces  # index -> its (bucket, start, length) in the store
        self._markers: dict[int, tuple[GradientMarker, int]] = {}  # index -> the marker in .grad, and its version then
        self._unreduced: dict[int, weakref.ref[Tensor]] = {}  # index -> the .grad no_sync() left, not yet reduced
        self._unplaced = Unplaced()  # the .grad of parameters trainable since the plan, averaged by each flush
        self._swaps: dict[int, Any] = {}  # index -> this backward's accumulator pre-hook (.grad taken in, marker out)
        self._task: weakref.ref[Callable[[], None]] | None = None  # the end of the backward whose start settled all
        self._next_backward_afresh()
        self._buffers: dict[int, Tensor] = {}
        self._in_flight: deque[tuple[int, Tensor, Any]] = deque()
        self.in_backward = self.no_sync = False  # in_backward: from a backward's first gradient to its flush (or raise)
        self.shared = False  # this backward may reach another wrapper (on its own group): no waits before flushes

    def replan(self, buckets: Sequence[BucketPlan], sync: ParameterSync) -> None:
        """After the plan grew: the same store over the new buckets, keeping the landed ones and placed ``.grad``."""
        previous = copy.copy(self)
        self._build(buckets, sync)
        for kept in ("owned", "landed", "used", "holds"):
            getattr(self, kept)[: len(getattr(previous, kept))] = getattr(previous, kept)
        for kept in ("_markers", "_unreduced", "unagreed", "dropped"):
            setattr(self, kept, getattr(previous, kept))
        if self.static is not None:  # a pending check stays; the next backward's parameters are the promise
            self.static.pattern, placed = None, self.slot_of.keys() - previous.slot_of.keys()
            self.late += [index for index, param in enumerate(self.params) if id(param) in placed]
        self.no_sync = previous.no_sync  # placed inside no_sync() (add_param_group): its backwards still accumulate
        for bucket, plan in enumerate(self.buckets[len(previous.buckets) :], start=len(previous.buckets)):
            buffer = self._new(bucket, plan.numel).zero_()
            for index in previous._unplaced.take_into(buffer, plan, self.params):
                self.holds[index] = True
            self._in_flight.append((bucket, buffer, completed_future(buffer)))
            self.landed[bucket] = False
            self._land_oldest()
        self.mark()

    def settle(self, index: int, before_backward: bool = False) -> None:
        """Take in what the program did to ``.grad`` since it was marked: None forgets the owned gradient, the marker
        zeroed zeroes it, a tensor replaces it (``before_backward``: a ``no_sync()`` sum stays, for it to reduce)."""
        marker, grad = self._markers.get(index), self.params[index].grad
        if isinstance(grad, GradientMarker) and (marker is None or grad is not marker[0]):
            if marker is None or grad.origin is not marker[0].origin:
                raise RuntimeError(checks.FOREIGN_MARKER)
            marker = self._markers[index] = (grad, grad.version)  # the held gradient, converted (module.to())
        if grad is None:
            if marker is not None:
                self._forget(index)
        elif marker is not None and grad is marker[0]:
            if marker[0].version != marker[1]:  # zero_grad(set_to_none=False), through whatever object
                self._zero(index)
                self._markers[index] = (marker[0], marker[0].version)
        elif (left := self._unreduced.get(index)) is not None and left() is grad:
            if not before_backward:
                raise RuntimeError(checks.UNREDUCED)
        elif marker is not None or self.holds[index]:  # set by hand: it replaces the owned gradient
            self._forget(index)

    def _forget(self, index: int) -> None:
        self._zero(index)
        self.holds[index] = self.used[index] = False
        self._markers.pop(index, None)

    def _zero(self, index: int) -> None:
        self.overflow = None
        for bucket, start, length in self.pieces.get(index, ()):
            if (owned := self.owned[bucket]) is not None:
                owned[start : start + length].zero_()

    def mark(self) -> None:
        """A marker into each free ``.grad`` the store holds, may hold, or (until the ranks agree) owns a piece of."""
        predicted = self.static if self.static is not None and self.static.predicted else None
        for index, param in enumerate(self.params):  # predicted: a static graph's first backward's, as if agreed
            unagreed = self.unagreed and index in self.pieces and param.requires_grad
            maybe = self.holds[index] or self.used[index] or (unagreed if predicted is None else predicted.used(index))
            if maybe and index not in self.dropped and param.grad is None and id(param) in self.slot_of:
                marker = param.grad = GradientMarker.like(param)  # (a new one each time: see GradientMarker.like)
                self._markers[index] = (marker, marker.version)

    def before_gradient(self, param: weakref.ref[Tensor], _: Tensor) -> None:
        """A gradient hook (``param`` weakly): at a backward's first, settle every parameter. A marker leaves ``.grad``
        only as autograd accumulates there, after the program's hooks (a raise leaves ``.grad`` as torch's)."""
        if (held := param()) is None or (index := self.zero.index_of(held)) is None:
            return
        if self._task is None or self._task() is None:  # (else settled at this backward's start, or at a reentrant
            self._end()  # checkpoint's outer one's); a backward that raised never ran its end: autograd dropped it
            self._task = weakref.ref(end := self._end)  # (the bound method autograd holds, until the backward ends)
            at_end_of_backward(end)
            for each in range(len(self.params)):
                self.settle(each, before_backward=True)
        if index in self._markers and index not in self._swaps:  # (once: torch.autograd.grad runs this hook too)
            self._swaps[index] = get_gradient_edge(held).node.register_prehook(lambda _: self._swap(index))

    def _swap(self, index: int) -> None:  # after every hook, as late as can be: what they did to .grad taken in
        param, recorded = self.params[index], self._markers.get(index)
        if recorded is not None and (param.grad is not recorded[0] or recorded[0].version != recorded[1]):
            self.settle(index, before_backward=True)
        if isinstance(param.grad, GradientMarker):  # autograd accumulates into None; on_grad marks it again
            param.grad = None

    def _end(self) -> None:
        for handle in self._swaps.values():  # (those of parameters a raise left unreached)
            handle.remove()
        self._swaps, self._task = {}, None

    # ------------------------------------------------------------------------------- what the step reads
    def grad_of(self, local: LocalTensor) -> Tensor | None:
        """``local``'s piece of its gradient: of a ``.grad`` set by hand, else a view of the owned gradient; or None."""
        param = self.params[local.index]
        self.settle(local.index)
        if param.grad is not None and not isinstance(param.grad, GradientMarker):
            if not local.whole and param.grad.stride() != param.stride():  # its pieces as views, for clipping
                param.grad = torch.empty_like(param).copy_(param.grad)
            return local.grad_from(param.grad)
        where, index = self.layout.fragments.get((local.index, local.offset)), local.index
        held = self.holds[index] or (self.used[index] and index not in self.dropped)  # dropped: counted, not held
        if where is None or not held or (owned := self.owned[where[0]]) is None:
            return None
        return view_like(owned, where[1], local.param) if local.whole else owned[where[1] : where[1] + local.length]

    def clear(self, set_to_none: bool = True) -> None:
        """``zero_grad``: forget the owned gradient and which parameters were used (``set_to_none=False``: zero it)."""
        if not self.in_backward:
            self.check_finished()
        pending = self.static is not None and self.static.predicted and not set_to_none  # checked at the step
        reached = {index for index, used in enumerate(self.used) if used and pending}
        if self.in_backward:  # a backward that raised before launching anything: its buckets dropped
            if self._next:
                raise RuntimeError(checks.POISONED)
            reached |= self._filled
            self._buffers, self.in_backward = {}, False
            self._next_backward_afresh()
            self._end()
        self.landed, self.overflow = [not set_to_none] * len(self.buckets), None
        self.used, self.unagreed, self.dropped = [False] * len(self.params), False, self.dropped if pending else set()
        if self.static is not None and not pending:
            self.static.expected = None
        self._unreduced.clear()
        if set_to_none:
            self.holds = [False] * len(self.params)
            self._markers.clear()  # a marker kept and put back after this clear stands for nothing: refused
            self.owned = [None] * len(self.buckets)
            return
        for index in list(self._markers):  # dropped since marked (model.zero_grad()): nothing to zero, as torch's
            if self.params[index].grad is None:  # clear finds no .grad there (seed 810142)
                self._forget(index)
                self.dropped.add(index)
        self.owned = [(self._new(b) if owned is None else owned).zero_() for b, owned in enumerate(self.owned)]
        for index in reached if pending else reached - self.dropped:  # zeros where reached; dropped: the check's flag
            self.used[index] = self.unagreed = True
        self.mark()

    def _next_backward_afresh(self) -> None:
        self._filled: set[int] = set()  # parameters whose gradient this backward put into a bucket
        self._remaining, self._next, self.overflow = [len(bucket.slots) for bucket in self.buckets], 0, None

    def check_finished(self) -> None:
        """Refuse the gradient of a backward that raised midway (local, as DDP's reducer); drop a raised one's hooks."""
        if self.in_backward:
            raise RuntimeError(checks.POISONED if self._next else checks.UNFINISHED)
        if not in_backward():
            self._end()

    def prepare_step(self) -> bool:
        """Settle every ``.grad`` (inside the step's agreement); whether this rank may step before the ranks agree."""
        self.check_finished()
        for index in range(len(self.params)):
            self.settle(index)
        return not self.late and (
            not self.unagreed or all(self.holds[i] or self.used[i] for i in self.pieces if self.params[i].requires_grad)
        )

    def overflow_found(self, scaled: bool) -> bool | None:
        """The inf/nan verdict ``_summed_flags`` made (None: unknown, changed since), read once, if ``scaled``."""
        found, self.overflow = self.overflow if scaled else None, None
        return bool(_host.read(found, "the summed inf/nan verdict")) if isinstance(found, Tensor) else found

    def agreed(self, everywhere: Sequence[bool], backward: bool = False, *, scaled: bool | None = None) -> None:
        """The ranks agreed which parameters some rank used (``backward``: at its end; else ``scaled``, by a scaler)."""
        self.scaled = self.scaled if scaled is None else scaled
        if self.static is not None:  # static_graph=True: a ValueError on every rank if not the first backward's
            placed = [i for i, p in enumerate(self.params) if p.requires_grad and id(p) in self.slot_of]
            self.static.agreed(everywhere, placed, backward)
            late, self.late = self.late, []  # (a backward since reduced their .grad: the ranks' own no longer)
            self._unplaced.average(self.zero, self.params, [] if backward else [i for i in late if everywhere[i]])
        now = [used and index not in self.dropped for index, used in enumerate(everywhere)]  # (those: the check's)
        self.holds = [held or used for held, used in zip(self.holds, now)]
        self.used, self.unagreed, self.dropped = [False] * len(self.params), False, set()
        for index, (marker, _) in list(self._markers.items()):
            if not self.holds[index] and self.params[index].grad is marker:
                self.params[index].grad = None
                del self._markers[index]
        self.mark()

    def ready(self) -> None:
        """Before ``clip_grad_norm_`` reads: ``prepare_step``, then the used flags agreed if a backward ran since."""
        self.prepare_step()
        if self.unagreed:
            groups = self.zero.agreement_groups
            late = {"parameters placed since the last step {}": tuple(self.late)} if self.late else {}
            self.agreed(agreement.agree_across_ranks(late, groups, "clip_grad_norm_", SAME_TRAINABLE, self.used))

    def hand_set(self) -> list[Tensor]:
        """Parameters whose ``.grad`` the program set (a tensor): clipping and a scaler scale each whole, everywhere."""
        return [p for p in self.params if p.grad is not None and not isinstance(p.grad, GradientMarker)]

    def _new(self, bucket: int, numel: int | None = None) -> Tensor:
        device, dtype = self.store_keys[self.buckets[bucket].key]
        return torch.empty(self.layout.lengths[bucket] if numel is None else numel, dtype=dtype, device=device)

    # ------------------------------------------------------------------------------------- the backward
    def on_grad(self, param: Tensor) -> None:
        """A post-accumulate-grad hook: ``.grad`` into its bucket and released, full buckets launched."""
        if not self.in_backward:
            checks.check_current(self.wrapper)
            self.shared = checks.others_live(self.wrapper)
        index = self.zero.index_of(param)
        if index is not None:
            self.used[index] = True
        if self.no_sync:
            if index is not None and param.grad is not None:
                self._unreduced[index] = weakref.ref(param.grad)
            return  # the local gradient accumulates in .grad until a backward outside no_sync
        if not self.in_backward:
            self.in_backward = True
            self.zero.land_sync()  # buckets no module of the forward read (local: step() launched every one)
            at_end_of_backward(self.flush)
        entry = self.slot_of.get(id(param))
        if entry is None or (grad := param.grad) is None:  # trainable since the plan was made: averaged at the end
            return
        bucket, slot = entry
        self._fill(bucket, slot, param, grad)
        self._launch_ready()
        while self._in_flight and self._in_flight[0][2].done():  # its buffer freed now, not when one is needed
            self._land_oldest()

    def _fill(self, bucket: int, slot: Any, param: Tensor, grad: Tensor) -> None:
        if slot.index in self._filled:  # (not at the tensor hook: torch.autograd.grad runs those too)
            raise RuntimeError(checks.SECOND_GRADIENT.format(index=slot.index))
        plan = self.buckets[bucket]
        whole = bucket not in self._buffers and len(plan.slots) == 1 and plan.numel == grad.numel()
        whole = whole and is_dense(grad) and owns_its_memory(grad)  # no other tensor shares it (autograd may)
        whole = whole and self.store_keys[plan.key] == (grad.device, grad.dtype) and grad.stride() == param.stride()
        scale = 1.0 / (self.zero.world_size * self.zero.replica_count)  # DDP's reducer: times 1/N (not / N)
        if whole:  # the gradient is the bucket (a parameter over the cap): no copy
            self._buffer(bucket, flat_view(grad).mul_(scale))
        elif grad.dtype == (into := view_like(self._buffer(bucket), slot.position, param)).dtype:
            torch.mul(grad.detach(), scale, out=into)  # scaled as it is copied, in one pass, as DDP's reducer does
        else:  # (detached: under backward(create_graph=True) the gradient requires grad, the bucket does not)
            into.copy_(grad.detach()).mul_(scale)
        marker = param.grad = GradientMarker.like(param)  # as torch's .grad holds one (a clear after a raise is seen)
        self._markers[slot.index] = (marker, marker.version)
        self._unreduced.pop(slot.index, None)
        self._filled.add(slot.index)
        self._remaining[bucket] -= 1

    def _buffer(self, bucket: int, gradient: Tensor | None = None) -> Tensor:
        """Bucket ``bucket``'s buffer (``gradient``, or a new one), once fewer than ``max_in_flight`` are in use."""
        if bucket not in self._buffers:
            while len(self._buffers) + len(self._in_flight) >= self.max_in_flight and self._in_flight:
                if self.shared:  # another wrapper's reductions may come first on other ranks: no wait before flushes
                    break
                self._land_oldest()
            self._buffers[bucket] = self._new(bucket, self.buckets[bucket].numel) if gradient is None else gradient
        return self._buffers[bucket]

    def _launch_ready(self, flushing: bool = False) -> None:
        """Launch, in order, every full bucket (``flushing``: every one left, with ``.grad`` not reached)."""
        zero = self.zero
        if self.shared and zero.replicate_group is not None and not flushing:  # hybrid, another wrapper: flush only
            return
        while self._next < len(self.buckets) and (flushing or not self._remaining[self._next]):
            bucket, plan = self._next, self.buckets[self._next]
            for slot in plan.slots if flushing else ():
                grad = (param := self.params[slot.index]).grad
                if slot.index not in self._filled and grad is not None and not isinstance(grad, GradientMarker):
                    self.used[slot.index] = True  # its gradient is reduced and stepped, as DDP + torch.optim would
                    self._fill(bucket, slot, param, grad)
            buffer = self._buffer(bucket)
            del self._buffers[bucket]
            for start, end in gaps(plan, self._filled):  # padding, parameters not reached
                buffer[start:end].zero_()
            reduced = comm.reduce_to_owners_async(
                buffer, plan.route, zero.process_group, zero.collectives, replicas=zero.replicate_group
            )
            self._in_flight.append((bucket, buffer, reduced))
            self._next = bucket + 1

    def _land_oldest(self) -> None:
        """Wait for the oldest reduction; add its owned sums into the owned gradient (copy the first since a clear)."""
        bucket, buffer, reduced = self._in_flight.popleft()
        reduced.wait()
        if (owned := self.owned[bucket]) is None:  # its first landing since zero_grad(): copied into, not added to
            owned = self.owned[bucket] = self._new(bucket)
        at = 0
        for start, end in self.buckets[bucket].owned(self.zero.rank):
            target = owned[at : at + end - start]
            target.add_(buffer[start:end]) if self.landed[bucket] else target.copy_(buffer[start:end])
            at += end - start
        self.landed[bucket] = True

    def _summed_flags(self, flags: list[bool]) -> list[int]:
        """How many ranks set each of ``flags`` (as DDP's used map: an int32 all-reduce behind the buckets', not an
        agreement), and after them ``overflow_found``'s sum (no flags: that sum alone, left unread for the step)."""
        device, what = self.store_keys[self.buckets[0].key][0], "which parameters some rank used"
        watch = self.scaled and not narrowed(self.buckets, self.params, self.store_keys, self.zero.master_dtype)
        checked = amp.nonfinite(self.owned, device) if watch else torch.zeros((), device=device)
        if not flags:  # (static_graph=True: nothing else to sum, so no host read at a backward's end)
            summed = comm.sum_unread(checked, self.zero.agreement_groups)  # (made alike on every rank)
            self.overflow = summed if watch else None
            return []
        *counts, found = comm.sum_flags(flags, device, self.zero.agreement_groups, what, [checked])
        self.overflow = bool(found) if watch else None  # (a step reads it, a change forgets it; narrowed: the step)
        return counts

    def flush(self) -> None:
        """A backward's end: every bucket landed, used flags summed (unplaced gradients averaged), markers put in."""
        self.in_backward, self.dropped, self.unagreed = False, set(), True  # (static: checked by the step)
        for index in set(range(len(self.params))) - self._filled:  # not reached: a hook may have changed its .grad
            self.settle(index, before_backward=True)
        self._launch_ready(flushing=True)
        while self._in_flight:
            self._land_oldest()
        self._next_backward_afresh()
        static = self.static if self.static is not None and self.static.pattern is not None else None
        unplaced = any(p.requires_grad and id(p) not in self.slot_of and p.numel() for p in self.params)
        counts = self._summed_flags([*self.used, unplaced]) if static is None and self.buckets else None
        if counts is not None and not counts[-1]:  # (where no rank holds parameters trainable since the plan)
            self.agreed([count > 0 for count in counts[:-1]], backward=True)
        elif static is None:
            self.agreed(self._unplaced.agree(self.zero, self.params, self.slot_of, self.used), backward=True)
        else:  # a rank alone may hold parameters trainable since the plan (the step agrees on them)
            self._unplaced.agree(self.zero, self.params, self.slot_of, self.used, alone=True)
            if self.scaled and self.buckets:  # the inf/nan sum alone (without a GradScaler: no collective)
                self._summed_flags([])
            static.predict(self.params)  # the first backward's parameters, held as if agreed (the step checks them)
            self.holds = [held or static.used(index) for index, held in enumerate(self.holds)]
            self.mark()
