"""The gradient side of ``ShardedDataParallel``: each parameter's gradient, as soon as autograd has accumulated it,
goes into its bucket and its ``.grad`` is released; full buckets are reduced to their owners in one fixed order,
and each rank keeps only its owned part (``OwnedGradients``), which ZeRO then clips, scales and steps.

Memory: a rank holds its owned gradient (about 1/N of the gradient) plus the buckets being filled or reduced, at
most ``max_in_flight`` of them while buckets fill in order (a bucket whose parameter this rank did not use is
complete only at the end of the backward, and holds back the launches after it until then). The owned gradient is
one tensor a bucket, allocated as the bucket lands and freed by ``zero_grad()``: the forward and the start of the
backward, where activations peak, hold none of it.

At the end of the backward (the autograd engine's, not a bucket count) the remaining buckets are launched in the
same order on every rank, unused parameters contributing zeros, and the ranks agree, on the control plane, on
which parameters some rank used: a parameter no rank used has no gradient at the step, as under DDP with
``find_unused_parameters``, so an optimizer skips it instead of stepping it with zeros.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from distoptim._backward import at_end_of_backward
from distoptim._flat import flat_view, is_dense, view_like
from distoptim.comm import agreement as _agreement
from distoptim.comm import collectives as comm
from distoptim.sharded_data_parallel.buckets import BucketPlan, store_plan
from distoptim.zero.shard import LocalTensor

if TYPE_CHECKING:
    from distoptim.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["OwnedGradients"]


class OwnedGradients:
    """This rank's owned gradient of ``zero``'s parameters, filled bucket by bucket during each backward."""

    def __init__(
        self,
        zero: ZeroRedundancyOptimizer,
        buckets: Sequence[BucketPlan],
        reduce_dtype: torch.dtype | None,
        max_in_flight: int = 2,
        previous: OwnedGradients | None = None,
    ) -> None:
        self.zero, self.buckets, self.max_in_flight = zero, list(buckets), max_in_flight
        self.params = zero.global_params
        first = [self.params[bucket.slots[0].index] for bucket in self.buckets]
        self.store_keys: dict[Hashable, tuple[torch.device, torch.dtype]] = {
            b.key: (p.device, reduce_dtype or p.dtype) for b, p in zip(self.buckets, first)
        }
        self.layout = store_plan(self.buckets, zero.rank, zero.plan)
        self.owned: list[Tensor | None] = [None] * len(self.buckets)  # each bucket's owned part, once landed
        self.slot_of = {id(self.params[s.index]): (b, s) for b, bucket in enumerate(self.buckets) for s in bucket.slots}
        self.landed = [False] * len(self.buckets)  # since the last clear(): read, and added to rather than copied
        self.used = [False] * len(self.params)  # by this rank, since the last clear()
        self.everywhere: tuple[bool, ...] | None = None  # used by some rank: agreed at the end of each backward
        self.ever = [False] * len(self.params)  # used by some rank in some backward (since construction)
        self.zeroed = False  # the last clear() zeroed the owned gradient (zero_grad(set_to_none=False))
        self.no_sync = False
        self._filled: set[int] = set()  # parameters whose gradient this backward put into a bucket
        self._remaining = [len(bucket.slots) for bucket in self.buckets]
        self._buffers: dict[int, Tensor] = {}
        self._in_flight: deque[tuple[int, Tensor, Any]] = deque()
        self._next = 0
        self._backward = False
        if previous is not None:
            self._take_over(previous)

    # ------------------------------------------------------------------------------- what the step reads
    def grad_of(self, local: LocalTensor) -> Tensor | None:
        """``local``'s piece of the owned gradient (a view), or None when no rank used its parameter or no backward
        has landed it since ``clear()``."""
        where = self.layout.fragments.get((local.index, local.offset))
        if where is None or not self.landed[where[0]]:
            return None
        if not self._was_used(local.index) and not (self.zeroed and self.ever[local.index]):
            return None
        owned, start = self.owned[where[0]], where[1]
        assert owned is not None  # landed
        return view_like(owned, start, local.param) if local.whole else owned[start : start + local.length]

    def _was_used(self, index: int) -> bool:
        return self.everywhere is not None and index < len(self.everywhere) and self.everywhere[index]

    def clear(self, set_to_none: bool = True) -> None:
        """``zero_grad``: forget the owned gradient (the next landing overwrites it) and which parameters were used.
        ``set_to_none=False`` zeroes it instead, as ``zero_grad`` zeroes ``.grad``: a parameter that ever had a
        gradient then has zeros where no rank used it (a plain optimizer steps it with zeros)."""
        self.landed = [not set_to_none] * len(self.buckets)
        self.used = [False] * len(self.params)
        self.everywhere = None
        self.zeroed = not set_to_none
        for bucket, owned in enumerate(self.owned):
            if set_to_none:
                self.owned[bucket] = None
            elif owned is None:
                self.owned[bucket] = self._new_owned(bucket).zero_()
            else:
                owned.zero_()

    def _new_owned(self, bucket: int) -> Tensor:
        device, dtype = self.store_keys[self.buckets[bucket].key]
        return torch.empty(self.layout.lengths[bucket], dtype=dtype, device=device)

    # ------------------------------------------------------------------------------------- the backward
    def on_grad(self, param: Tensor) -> None:
        """A post-accumulate-grad hook: ``param.grad`` into its bucket, ``.grad`` released, full buckets launched."""
        index = self.zero._index_of(param)
        if index is not None:
            self.used[index] = True
        if self.no_sync:
            return  # the local gradient accumulates in .grad until a backward outside no_sync
        if not self._backward:
            self._backward = True
            self.zero.sync_finished()  # buckets no module of the forward read (local: step() launched every one)
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
            and _memory_is_its_own(grad)
        )

    def _buffer(self, bucket: int, gradient: Tensor | None = None) -> Tensor:
        """Bucket ``bucket``'s buffer (``gradient``, or zeros, when it has none yet), once fewer than
        ``max_in_flight`` buckets are filling or in flight."""
        if bucket not in self._buffers:
            while len(self._buffers) + len(self._in_flight) >= self.max_in_flight and self._in_flight:
                self._land_oldest()
            plan = self.buckets[bucket]
            device, dtype = self.store_keys[plan.key]
            self._buffers[bucket] = (
                gradient if gradient is not None else torch.zeros(plan.numel, dtype=dtype, device=device)
            )
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
        ``no_sync`` that this backward did not touch) and landed; the ranks agree on which parameters were used;
        gradients of parameters trainable since the plan was made are averaged in their ``.grad``."""
        self._backward = False
        for bucket in range(self._next, len(self.buckets)):
            for slot in self.buckets[bucket].slots:
                param = self.params[slot.index]
                if slot.index not in self._filled and param.grad is not None:
                    self._fill(bucket, slot, param)
            self._launch(bucket)
        while self._in_flight:
            self._land_oldest()
        self._filled.clear()
        self._remaining = [len(bucket.slots) for bucket in self.buckets]
        self._next = 0
        self._agree_on_use()

    def _agree_on_use(self) -> None:
        """One all-reduce on the control plane: which parameters some rank used (MAX), and that every rank trains
        the same ones (else every rank raises); then the local gradients of the parameters no bucket holds yet
        (made trainable since the plan) are averaged in their ``.grad``, for the step that places them."""
        zero, params = self.zero, self.params
        trainable = tuple(index for index, param in enumerate(params) if param.requires_grad)
        unplaced = [i for i in trainable if id(params[i]) not in self.slot_of and params[i].numel()]
        for index in unplaced:
            self.used[index] = self.used[index] or params[index].grad is not None
        self.everywhere = _agreement.agree_across_ranks(
            {"the parameters that require grad, by index: {}": trainable},
            zero.agreement_groups,
            "backward",
            _agreement.STEP_FIX,
            flags=self.used,
        )
        self.ever = [ever or now for ever, now in zip(self.ever, self.everywhere)]
        for index in unplaced:
            param = params[index]
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            for group in zero.agreement_groups:
                comm.all_reduce_(grad, group)
            param.grad = grad.div_(zero.world_size * zero.replica_count)

    def _take_over(self, previous: OwnedGradients) -> None:
        """After the plan grew: keep what ``previous`` had landed (its buckets come first, laid out alike), and take
        the averaged ``.grad`` of parameters placed since into their new buckets."""
        self.owned[: len(previous.owned)] = previous.owned
        self.landed[: len(previous.landed)] = previous.landed
        self.used[: len(previous.used)] = previous.used
        self.everywhere = previous.everywhere
        self.ever[: len(previous.ever)] = previous.ever
        self.zeroed = previous.zeroed
        for bucket in range(len(previous.buckets), len(self.buckets)):
            plan = self.buckets[bucket]
            buffer = torch.zeros(plan.numel, dtype=self.store_keys[plan.key][1], device=self.store_keys[plan.key][0])
            for slot in plan.slots:
                param = self.params[slot.index]
                if param.grad is not None:
                    view_like(buffer, slot.position, param).copy_(param.grad)
                    param.grad = None
            self._in_flight.append((bucket, buffer, _done(buffer)))
            self.landed[bucket] = False
            self._land_oldest()


def _memory_is_its_own(tensor: Tensor) -> bool:
    """Whether no other tensor shares ``tensor``'s storage (False where torch cannot tell)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None or tensor._base is not None:
        return False
    storage = tensor.untyped_storage()  # this handle holds a reference of its own
    return bool(count(storage._cdata) == 2)


def _done(value: Tensor) -> Any:
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    future.set_result(value)
    return future
