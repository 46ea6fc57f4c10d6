"""DDP communication hooks that average gradients: the plain all-reduce, and post-local SGD (global averaging for a
warm-up, then local or none; pair it with an averager whose ``warmup_steps`` equals ``start_localSGD_iter``).
"""

# No `from __future__ import annotations`: DDP checks the hooks' annotations against the real classes.

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import GradBucket, ProcessGroup

from distoptim._backward import at_end_of_backward, in_backward
from distoptim.comm import averaging as comm

__all__ = ["PostLocalSGDState", "allreduce_hook", "averaged_ranks", "post_localSGD_hook"]


class PostLocalSGDState:
    """State of :func:`post_localSGD_hook`.

    Args:
        process_group: group for the warm-up's global all-reduce; ``None`` is the default (world) group.
        subgroup: group after warm-up; ``None``: per-node ones (``LOCAL_WORLD_SIZE``), made collectively then.
        start_localSGD_iter: number of iterations that all-reduce globally.
        post_local_gradient_allreduce: after warm-up, all-reduce within ``subgroup`` (default True) or not at all.

    ``iter`` counts backward passes. An unpickled state uses the default group and per-node subgroups.

    Raises:
        ValueError: ``start_localSGD_iter`` is negative.

    Example:
        ```python
        state = PostLocalSGDState(None, None, start_localSGD_iter=100, post_local_gradient_allreduce=False)
        ddp.register_comm_hook(state, post_localSGD_hook)
        ...
        checkpoint = {"hook": state.state_dict(), ...}   # to resume: state.load_state_dict(checkpoint["hook"])
        ```
    """

    __slots__ = (
        "_counting",
        "iter",
        "post_local_gradient_allreduce",
        "process_group",
        "start_localSGD_iter",
        "subgroup",
    )

    def __init__(
        self,
        process_group: ProcessGroup | None,
        subgroup: ProcessGroup | None,
        start_localSGD_iter: int,
        post_local_gradient_allreduce: bool = True,
    ) -> None:
        if start_localSGD_iter < 0:
            raise ValueError(f"start_localSGD_iter must be >= 0, got {start_localSGD_iter}")
        self.process_group, self.subgroup = process_group, subgroup
        self.start_localSGD_iter = start_localSGD_iter
        self.post_local_gradient_allreduce = post_local_gradient_allreduce
        self.iter = 0
        self._counting = False  # the end of this backward is scheduled to count it

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        """Count one iteration per backward: at its end (DDP's static-graph first iteration marks no bucket last);
        outside a backward (a joined rank's), at the bucket DDP marks last.

        Args:
            bucket: the bucket the hook was called with.
        """
        if not in_backward():
            self.iter += int(bucket.is_last())
        elif not self._counting:
            self._counting = True
            at_end_of_backward(self._count)

    def _count(self) -> None:
        self.iter += 1
        self._counting = False

    def local_subgroup(self) -> ProcessGroup:
        """The group used after warm-up, creating per-node subgroups on first use when none was given."""
        if self.subgroup is None:
            group = comm.default_group(self.process_group)
            self.subgroup = comm.split_group(group, comm.node_subgroup_size(comm.group_size(group)))
        return self.subgroup

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue the schedule (the groups are rebuilt, not saved)."""
        return {"iter": self.iter}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the schedule from ``state_dict()`` of an earlier run.

        Args:
            state_dict: ``{"iter": n}`` with ``n >= 0``, as ``state_dict()`` returned.

        Raises:
            ValueError: anything else.
        """
        iteration = state_dict.get("iter") if isinstance(state_dict, dict) else None
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise ValueError(f"expected PostLocalSGDState.state_dict(), {{'iter': n >= 0}}, got {state_dict!r}")
        self.iter = iteration

    def __getstate__(self) -> dict[str, Any]:
        return {
            "start_localSGD_iter": self.start_localSGD_iter,
            "post_local_gradient_allreduce": self.post_local_gradient_allreduce,
            "iter": self.iter,
            "had_groups": self.process_group is not None or self.subgroup is not None,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        if state.get("had_groups", False):
            warnings.warn(
                "process groups do not pickle: the unpickled PostLocalSGDState uses the default group and per-node "
                "subgroups; set .process_group and .subgroup again to use other groups",
                UserWarning,
                stacklevel=2,
            )
        self.process_group = self.subgroup = None
        self.start_localSGD_iter = state["start_localSGD_iter"]
        self.post_local_gradient_allreduce = state["post_local_gradient_allreduce"]
        self.iter = state["iter"]
        self._counting = False


def averaged_ranks(state: Any) -> list[int] | None:
    """The global ranks a post-local-SGD hook with ``state`` (ours, or torch's) averages this rank's gradients with
    after warm-up (ours without a subgroup yet: the per-node one it would make); None where that is unknown."""
    if not all(hasattr(state, name) for name in ("subgroup", "post_local_gradient_allreduce", "start_localSGD_iter")):
        return None
    if not state.post_local_gradient_allreduce:
        return [dist.get_rank()]
    if state.subgroup is not None:
        return dist.get_process_group_ranks(state.subgroup)
    if not isinstance(state, PostLocalSGDState):
        return None
    ranks = dist.get_process_group_ranks(comm.default_group(state.process_group))
    with warnings.catch_warnings():  # local_subgroup() warns when it makes the groups
        warnings.simplefilter("ignore")
        size = comm.node_subgroup_size(len(ranks))
    start = ranks.index(dist.get_rank()) // size * size  # dist.new_subgroups cuts consecutive blocks
    return ranks[start : start + size]


def allreduce_hook(process_group: ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default reduction as a comm hook (and the overlap hooks' inner hook): the bucket averaged, in a future.

    Args:
        process_group: the hook's state, as ``register_comm_hook`` passes it: the group, or ``None`` for the world.
        bucket: DDP's gradient bucket.

    Raises:
        TypeError: ``process_group`` is neither a ``ProcessGroup`` nor ``None``.

    Example:
        ```python
        ddp.register_comm_hook(None, allreduce_hook)   # the same as DDP's own reduction
        ```
    """
    return comm.allreduce_mean_async(bucket.buffer(), comm.default_group(process_group))


def post_localSGD_hook(state: PostLocalSGDState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket globally before ``start_localSGD_iter``, then within the subgroup (or not), in a future.

    Args:
        state: the ``PostLocalSGDState`` given to ``register_comm_hook``; its ``iter`` advances once per backward.
        bucket: DDP's gradient bucket.

    Raises:
        TypeError: ``state`` is not a ``PostLocalSGDState``.

    Example:
        ```python
        ddp.register_comm_hook(PostLocalSGDState(None, None, start_localSGD_iter=100), post_localSGD_hook)
        ```
    """
    if not isinstance(state, PostLocalSGDState):
        raise TypeError(
            "post_localSGD_hook needs a PostLocalSGDState as its state: "
            f"ddp.register_comm_hook(PostLocalSGDState(...), post_localSGD_hook), got {type(state).__name__}"
        )
    warming_up = state.iter < state.start_localSGD_iter
    state.maybe_increase_iter(bucket)
    if warming_up:
        return allreduce_hook(state.process_group, bucket)
    if not state.post_local_gradient_allreduce:
        return comm.completed_future(bucket.buffer())
    return comm.allreduce_mean_async(bucket.buffer(), state.local_subgroup())
