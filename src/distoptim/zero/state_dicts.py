"""A ZeroRedundancyOptimizer's checkpoints, and its part under ``Join``.

Two formats: ``torch.optim``'s (``consolidate_state_dict`` gathers every shard onto one rank, which then has a
plain ``state_dict()``; ``load_state_dict`` cuts such a dict to each rank's shard, at any world size and partition)
and DCP's (``sharded_state_dict``: every rank its fragments, with their global offsets). The formats themselves are
``checkpoint/consolidated.py`` (torch.optim's) and ``checkpoint/dcp_state.py`` (DCP's); this module applies them
to an optimizer. The two base classes here type ``self`` as ``ZeroParts``: the members of the optimizer they read,
named in one protocol rather than by importing the class they are part of.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.join import JoinHook
from torch.optim import Optimizer

from distoptim.checkpoint import consolidated as checkpoint
from distoptim.checkpoint import dcp_state as sharded
from distoptim.zero import stepping
from distoptim.zero.local_optimizer import CLASS_KEY
from distoptim.zero.overlap import OverlapStepper
from distoptim.zero.partition import UNOWNED
from distoptim.zero.shard import LocalShard, stitch
from distoptim.zero.state_formats import decoded

__all__ = ["JOIN_WITH_SDP", "Checkpoints", "Joining", "ZeroJoinHook", "ZeroParts"]

JOIN_WITH_SDP = (
    "Join (uneven inputs) is not supported with ShardedDataParallel: a joined rank would have to shadow every "
    "bucket's reduction and the parameter sync; give every rank the same number of batches (drop the last, uneven "
    "one: DistributedSampler(drop_last=True)), or use DDP under Join([ddp, zero])"
)


class ZeroParts(Protocol):
    """What checkpoints and Join read of a ZeroRedundancyOptimizer."""

    param_groups: list[dict[str, Any]]
    process_group: dist.ProcessGroup
    rank: int
    world_size: int
    overlap_stepper: OverlapStepper | None
    replicate_group: dist.ProcessGroup | None
    _consolidated: Any
    _sync: Any
    _comm_device: torch.device

    @property
    def gradient_source(self) -> Any: ...

    _optimizer_class: type[Optimizer]
    _defaults: dict[str, Any]
    _optimizer_state_dict_pre_hooks: Any
    _optimizer_state_dict_post_hooks: Any
    _optimizer_load_state_dict_pre_hooks: Any
    _optimizer_load_state_dict_post_hooks: Any

    @property
    def global_params(self) -> list[Tensor]: ...
    @property
    def local_shard(self) -> LocalShard: ...
    @property
    def local_optimizer(self) -> Optimizer: ...
    @property
    def agreement_groups(self) -> list[dist.ProcessGroup]: ...
    def owner_of(self, param: Tensor) -> int: ...
    def sync_finished(self) -> None: ...
    def land_sync(self) -> None: ...
    def sync_parameters(self) -> None: ...
    def _push_hyperparameters(self) -> None: ...
    def _masters_follow_parameters(self) -> None: ...
    def _place_for_load(self) -> None: ...
    def _agreed(self, action: Callable[[], Any]) -> Any: ...
    def _fingerprint(self) -> Any: ...
    def _prepare(
        self, closure: Callable[[], float] | None, kwargs: dict[str, Any], grad_scaler: Any, hold: bool = False
    ) -> stepping.Prepared: ...
    def _step_local(self, closure: Callable[[], float] | None, kwargs: dict[str, Any]) -> float | None: ...


class Checkpoints:
    """ZeroRedundancyOptimizer's checkpoint methods (a base class of it: ``self`` is the optimizer)."""

    def consolidate_state_dict(self: ZeroParts, to: int = 0) -> None:
        """Gather every rank's shard onto rank ``to``, on its CPU (collective; only ``to`` receives anything).

        Shards travel in messages of at most ``checkpoint.STAGING_BYTES`` through one reused staging buffer on the
        communication device: no GPU holds the whole state, no sender a second copy of its shard.

        Args:
            to: the group rank that receives the whole state (default 0).

        Raises:
            ValueError: on every rank, when any rank names no valid rank or the ranks name different ones (a
                TypeError on the rank whose ``to`` is not an int), or when the parameters' dtype or device changed
                since the optimizer was built (``model.to(torch.float64)``).

        Example:
            ```python
            zero.consolidate_state_dict(to=0)             # on every rank
            if rank == 0:
                torch.save(zero.state_dict(), "optim.pt")
            ```
        """
        _consolidate(self, to)

    def state_dict(self: ZeroParts) -> dict[str, Any]:
        """The whole optimizer state in ``torch.optim``'s format, on the rank that consolidated it.

        Runs the hooks registered with ``register_state_dict_pre_hook`` / ``register_state_dict_post_hook`` as
        ``torch.optim`` does: pre-hooks first, post-hooks last (one returning a dict replaces the result).

        Raises:
            RuntimeError: this rank holds no consolidated state (``consolidate_state_dict(to=this rank)`` first).

        Example:
            ```python
            zero.consolidate_state_dict(to=0)
            state = zero.state_dict() if rank == 0 else None
            ```
        """
        return _state_dict(self)

    def load_state_dict(self: ZeroParts, state_dict: dict[str, Any]) -> None:
        """Load a global (``torch.optim``-format) dict on every rank; each keeps only its own shard's state.

        The whole dict is checked first (same verdict on every rank). Load pre-hooks (which get a shallow copy and
        may return a replacement) run before, load post-hooks after, as in ``torch.optim``.

        Args:
            state_dict: what ``state_dict()`` returned (or a plain ``torch.optim`` optimizer's), at any world size.

        Raises:
            ValueError: on every rank, when the dict was saved by another optimizer class or for other parameters,
                or when the parameters' dtype or device changed since the optimizer was built (``model.to(...)``).

        Example:
            ```python
            zero.load_state_dict(torch.load("optim.pt"))  # on every rank
            ```
        """
        _load_consolidated(self, state_dict)

    def sharded_state_dict(self: ZeroParts) -> dict[str, Any]:
        """This rank's fragments of the state (master weights included) and the hyperparameters, for
        ``torch.distributed.checkpoint`` or ``distoptim.checkpoint``; a load at any world size and partition reads
        only what overlaps its own fragments. Fragments without state yet get placeholders that a load fills in and
        a save leaves out.

        Collective (one small all-reduce: it waits for a parameter sync in flight, then places parameters given new
        storage since the last step again, as a step would, so that master copies follow them).

        Raises:
            ValueError: on every rank, when the parameters' dtype or device changed since the optimizer was built
                (``model.to(torch.float64)``).

        Example:
            ```python
            distoptim.checkpoint.save({"model": model.state_dict(), "optim": zero.sharded_state_dict()}, path)
            ```
        """
        return _sharded_state(self)

    def load_sharded_state_dict(self: ZeroParts, state_dict: dict[str, Any]) -> None:
        """Finish a load into ``sharded_state_dict()``'s dict (the state was loaded in place).

        Args:
            state_dict: the dict ``sharded_state_dict()`` returned, after ``dcp.load`` / ``checkpoint.load``.

        Raises:
            ValueError: the dict is not a loaded sharded state, or was saved for other parameters or another
                optimizer class; on every rank, when the parameters' dtype or device changed since the optimizer
                was built (``model.to(...)``).

        Example:
            ```python
            state = {"model": model.state_dict(), "optim": zero.sharded_state_dict()}
            distoptim.checkpoint.load(state, path)
            model.load_state_dict(state["model"])
            zero.load_sharded_state_dict(state["optim"])
            ```
        """
        _load_sharded(self, state_dict)


class Joining:
    """ZeroRedundancyOptimizer's part under ``torch.distributed.algorithms.join.Join`` (a base class of it)."""

    def join_hook(self: ZeroParts, **kwargs: Any) -> JoinHook:
        """While this rank has run out of inputs, step its shard with its ``.grad`` as it stands and shadow the
        others' step (their agreements and parameter sync), as torch's ZeRO join hook does.

        DDP's join hook discards the average the joined rank takes part in, so its ``.grad`` is whatever it last
        held (the last average, if nothing clears it), or what an earlier joinable's hook sets (torch's own test
        sets DDP's gradient there and matches DDP). In overlap mode DDP's join hook runs the comm hook on zero
        buckets, which hands the joined rank the true average, and the shard is stepped with it.

        Args:
            **kwargs: ``Join``'s keyword arguments (none are used).

        Raises:
            NotImplementedError: under ``ShardedDataParallel`` or hybrid sharding (``replicate_group``), on every
                rank, when ``Join`` is built.

        Example:
            ```python
            with Join([ddp, zero]):
                for batch in uneven_loader:
                    ...
            ```
        """
        if self.gradient_source is not None:
            raise NotImplementedError(JOIN_WITH_SDP)
        if self.replicate_group is not None:
            raise NotImplementedError(
                "Join (uneven inputs) is not supported with hybrid sharding (replicate_group): a joined rank would "
                "step its shard with its stale .grad while its replica in another shard group, still training, "
                "steps the same elements with the true average, and the replicas would part. Give every rank the "
                "same number of batches (DistributedSampler(drop_last=True))"
            )
        return ZeroJoinHook(self)

    @property
    def join_device(self: ZeroParts) -> torch.device:
        """The device of Join's own collectives: the parameters'."""
        return self.global_params[0].device

    @property
    def join_process_group(self: ZeroParts) -> dist.ProcessGroup:
        """The group of Join's own collectives: the one ZeRO shards over."""
        return self.process_group


def _consolidate(zero: ZeroParts, to: int) -> None:
    checkpoint.agree_on_target(to, zero.world_size, zero.process_group)
    _land_and_agree_untouched(zero)
    zero._masters_follow_parameters()
    mine = zero.local_shard.global_state(decoded(zero.local_optimizer.state))  # torch.optim's format: decoded
    merged = checkpoint.gather_state(mine, to, zero.process_group, zero._comm_device)
    if merged is not None:
        merged = {**_made_at_construction(zero), **stitch(merged, zero.global_params)}
    zero._consolidated = None if merged is None else dict(sorted(merged.items()))


def _made_at_construction(zero: ZeroParts) -> dict[int, dict[str, Tensor]]:
    """The state the optimizer class makes at construction (Adagrad's ``sum``) for the parameters no rank owns
    (frozen when placed): torch's optimizer holds it for them too, so a consolidated dict holds it as torch's does."""
    made: dict[int, dict[str, Tensor]] = {}
    index = 0
    for group in zero.param_groups:
        settings = {key: value for key, value in group.items() if key not in ("params", CLASS_KEY)}
        optimizer_class = group.get(CLASS_KEY, zero._optimizer_class)
        defaults = zero._defaults if optimizer_class is zero._optimizer_class else {}
        unowned = {index + i: p for i, p in enumerate(group["params"]) if zero.owner_of(p) == UNOWNED}
        index += len(group["params"])
        probe = torch.zeros(1, requires_grad=True)
        if not unowned or not optimizer_class([{"params": [probe], **settings}], **defaults).state:
            continue
        fresh = optimizer_class([{"params": [p.detach() for p in unowned.values()], **settings}], **defaults)
        made.update(zip(unowned, (fresh.state[p] for p in fresh.param_groups[0]["params"])))
    return made


def _state_dict(zero: ZeroParts) -> dict[str, Any]:
    for pre_hook in zero._optimizer_state_dict_pre_hooks.values():
        pre_hook(zero)
    if zero._consolidated is None:
        raise RuntimeError(
            "Optimizer state has not been consolidated on this rank. Please call "
            f"`consolidate_state_dict(to={zero.rank})` on all ranks beforehand if you meant to save the global state "
            f"(rank {zero.rank} holds no consolidated optimizer state: consolidate after the last step)"
        )
    result = {"state": dict(zero._consolidated), "param_groups": checkpoint.saved_param_groups(zero.param_groups)}
    return checkpoint.apply_hooks(zero._optimizer_state_dict_post_hooks.values(), zero, result)


def _load_consolidated(zero: ZeroParts, state_dict: Any) -> None:
    zero.land_sync()  # the load may write master weights into the parameters
    zero._place_for_load()
    state_dict = state_dict.copy() if isinstance(state_dict, dict) else state_dict
    state_dict = checkpoint.apply_hooks(zero._optimizer_load_state_dict_pre_hooks.values(), zero, state_dict)
    by_param, hyperparameters = checkpoint.select_shard_on_every_rank(
        state_dict, zero.param_groups, zero._optimizer_class, zero.process_group
    )
    _refuse_stranded_state(zero, by_param)
    for group, saved in zip(zero.param_groups, hyperparameters):
        group.update(saved)
    local_state = zero.local_shard.local_state(by_param)
    zero._push_hyperparameters()
    local_groups = checkpoint.global_param_groups(zero.local_optimizer.param_groups)
    zero.local_optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})
    zero._consolidated = None
    for post_hook in zero._optimizer_load_state_dict_post_hooks.values():
        post_hook(zero)


def _refuse_stranded_state(zero: ZeroParts, by_param: dict[Tensor, dict[str, Any]]) -> None:
    """A parameter frozen when placed has no owner, so state it trained with would be dropped, and it would train
    from fresh state once unfrozen (the same dict on every rank: the same verdict). State a fresh optimizer makes
    (``step`` 0) is made again when the parameter gets an owner."""
    for index, param in enumerate(zero.global_params):
        state = by_param.get(param)
        if state is None or zero.owner_of(param) != UNOWNED or float(state.get("step", 1)) == 0:
            continue
        raise ValueError(
            f"load_state_dict: parameter {index} has optimizer state from training, but it had requires_grad=False "
            "when this ZeroRedundancyOptimizer placed it, so no rank owns it and its state would be dropped: set "
            "requires_grad=True on it (on every rank) before load_state_dict and freeze it after (a parameter "
            "frozen after it has an owner keeps its owner and its state)"
        )


def _land_and_agree_untouched(zero: ZeroParts) -> None:
    """Land the sync and raise on every rank if a parameter was written while it was in flight (after the last
    step, no step's agreement follows to see it: a checkpoint must not save the ranks' differing values)."""
    zero.land_sync()
    if zero._sync.watches_writes:  # the same on every rank
        zero._agreed(zero._sync.check_untouched)


def _sharded_state(zero: ZeroParts) -> dict[str, Any]:
    _land_and_agree_untouched(zero)
    zero._masters_follow_parameters()
    shard, state = zero.local_shard, zero.local_optimizer.state
    placeholders = sharded.template_state(shard, zero.local_optimizer.step, state)
    formats = getattr(zero.local_optimizer, "formats", None)
    state = state if formats is None else formats.as_kept(state)  # the keys a step gives, before one ran too
    groups = pickle.dumps(checkpoint.saved_param_groups(zero.param_groups))
    return sharded.sharded_state(shard, state, placeholders, groups, zero.global_params)


def _load_sharded(zero: ZeroParts, state_dict: dict[str, Any]) -> None:
    zero.land_sync()
    zero._place_for_load()  # write_back below writes into the pieces the placement holds
    saved_groups = sharded.load_param_groups(state_dict, zero.param_groups, zero._optimizer_class)
    for group, saved in zip(zero.param_groups, saved_groups):
        group.update(saved)
    zero._push_hyperparameters()
    sharded.install_loaded(zero.local_shard, zero.local_optimizer.state, state_dict)
    zero.local_shard.write_back()
    zero._consolidated = None


class ZeroJoinHook(JoinHook):
    """A joined rank's step, as torch's: its shard stepped with its ``.grad`` as it stands, inside the others'
    agreements, then their parameter sync. In overlap mode DDP's own join hook runs the comm hook, which steps."""

    def __init__(self, zero: ZeroParts) -> None:
        self.zero = zero

    def main_hook(self) -> None:
        zero, stepper = self.zero, self.zero.overlap_stepper
        if stepper is not None:  # after DDP's join hook (Join([ddp, zero]))
            stepper.run_deferred()
            return
        zero.land_sync()
        try:  # the local step waits for the agreement: where another rank steps under a GradScaler, all refuse
            stepping.agreed_step(
                lambda: zero._prepare(None, {}, None, hold=True),
                zero._fingerprint,
                zero.agreement_groups,
                joined_step=lambda: zero._step_local(None, {}),
            )
        finally:
            zero.local_shard.detach_grads()
        zero.sync_parameters()
        zero._consolidated = None
