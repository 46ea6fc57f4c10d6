"""The end-of-backward coordination across ``ShardedDataParallel`` wrappers: which stores a backward (graph task)
reached, so that each launches its last buckets before any waits (two wrapped models in one backward); the place of
each bucket reduction among all reductions on its process group; and the control-plane agreement, at each flush, on
which parameters some rank used and that every rank reduced in the same order."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from distoptim.comm import agreement
from distoptim.comm import collectives as comm

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class Store(Protocol):
    """What coordination reads of a store, ``gradients.OwnedGradients`` (a protocol: that module imports this one)."""

    zero: Any
    params: list[Tensor]
    slot_of: dict[int, Any]
    used: list[bool]
    everywhere: Any
    _places: list[int]
    _deferred: bool

    def _launch_the_rest(self) -> None: ...


_ACTIVE: list[tuple[Store, int]] = []  # the stores a backward (graph task) reached, until their flush
_LAUNCHES: dict[int, int] = {}  # id(process group) -> how many bucket reductions every store has launched on it
_ORDER = (
    "the places of this model's bucket reductions among all ShardedDataParallel reductions on its process group "
    "{} (two wrapped models in one backward, with parameters some ranks do not use, reduced in a different order "
    "on different ranks, so that their sums were mixed up: give each model's ZeroRedundancyOptimizer a process "
    "group of its own, dist.new_group(), or use every parameter on every rank)"
)


def reached(store: Store) -> None:
    """``store``'s first gradient of the current backward: it is flushed with the others that backward reached.
    A second store on its process group in this backward: from now on no store on the group launches before the
    flush (a bucket ready on some ranks only, by a parameter some ranks do not use, would put their reductions in a
    different order on different ranks)."""
    task = torch._C._current_graph_task_id()
    group = store.zero.process_group
    sharing = [s for s, t in _ACTIVE if t == task and s.zero.process_group is group]
    _ACTIVE.append((store, task))
    for each in [*sharing, store] if sharing else ():
        each._deferred = True


def next_place(group: ProcessGroup | None) -> int:
    """The place of a bucket reduction being launched on ``group`` among all SDP reductions on it."""
    key = id(group)
    place = _LAUNCHES.get(key, 0)
    _LAUNCHES[key] = place + 1
    return place


def launch_the_rest(store: Store) -> None:
    """``store``'s flush: every other store the current backward reached, then ``store``, launches its last
    buckets, before any of them waits for anything."""
    task = torch._C._current_graph_task_id()
    for other in [s for s, t in _ACTIVE if t == task] + [store]:
        other._deferred = False
        other._launch_the_rest()
    _ACTIVE[:] = [(s, t) for s, t in _ACTIVE if s is not store and t == task]


def forget(store: Store) -> None:
    """``store``'s backward raised (its flush will never run): it is no longer one the current backward reached."""
    _ACTIVE[:] = [(s, t) for s, t in _ACTIVE if s is not store]


def agree_on_use(store: Store) -> None:
    """One all-reduce on the control plane: which parameters some rank used (MAX), and that every rank trains
    the same ones (else every rank raises); then the local gradients of the parameters no bucket holds yet
    (made trainable since the plan) are averaged in their ``.grad``, for the step that places them."""
    zero, params = store.zero, store.params
    trainable = tuple(index for index, param in enumerate(params) if param.requires_grad)
    unplaced = [i for i in trainable if id(params[i]) not in store.slot_of and params[i].numel()]
    for index in unplaced:
        store.used[index] = store.used[index] or params[index].grad is not None
    places, store._places = tuple(store._places), []
    store.everywhere = agreement.agree_across_ranks(
        {
            "the parameters that require grad, by index: {}": trainable,
            _ORDER: places,
        },
        zero.agreement_groups,
        "backward",
        agreement.STEP_FIX,
        flags=store.used,
    )
    for index in unplaced:
        param = params[index]
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        for group in zero.agreement_groups:
            comm.all_reduce_(grad, group)
        param.grad = grad.div_(zero.world_size * zero.replica_count)
