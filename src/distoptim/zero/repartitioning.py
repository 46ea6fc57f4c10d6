"""``Placer``, the optimizer's placement, rebuilt when the parameters change; ``Partitioning``, its public methods."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from distoptim._backward import in_backward
from distoptim.checkpoint.consolidated import GlobalState
from distoptim.comm import collectives as comm
from distoptim.comm.agreement import Fingerprint, run_agreed
from distoptim.zero import placement, stepping, validation
from distoptim.zero.buckets import ParameterSync
from distoptim.zero.local_optimizer import CLASS_KEY, CompositeOptimizer, check_classes_unchanged
from distoptim.zero.overlap import OverlapStepper
from distoptim.zero.param_input import check_names_alike, normalize_param_groups
from distoptim.zero.partition import Fragment, PartitionPlan
from distoptim.zero.shard import LocalShard, complete_hyperparameters, copy_hyperparameters
from distoptim.zero.state_formats import FORMAT_KEY

__all__ = ["Partitioning", "Placer", "ZeroParts", "agreed"]


class Placer:
    """Where a ZeroRedundancyOptimizer's parameters live, its local optimizer and its loaded or gathered state."""

    sync: ParameterSync  # the placement's, or the gradient source's around it (from the constructor's placement on)

    def __init__(
        self,
        zero: ZeroParts,
        settings: placement.PlacementSettings,
        optimizer_class: type[Optimizer],
        defaults: dict[str, Any],
        comm_device: torch.device,
    ) -> None:
        self.zero, self.settings = zero, settings  # the optimizer: its groups are the truth the placement follows
        self.optimizer_class, self.defaults = optimizer_class, defaults  # the constructor's class and hyperparameters
        self.comm_device = comm_device  # where this rank's messages live: its parameters' GPU under NCCL, else the CPU
        self.placement: placement.Placement | None = None  # None until the constructor's first placement
        self.optim: Optimizer | None = None
        self.region_numel: dict[Any, int] | None = None  # even partition: the most elements a region holds, per key
        self.listeners: list[Callable[[], None]] = []  # told after every repartition (ShardedDataParallel)
        self.kept_unowned: GlobalState = {}  # loaded state of parameters no rank owns (state_dicts)
        self.consolidated: GlobalState | None = None  # what consolidate_state_dict gathered here, until it is stale
        self.first_added = 0  # the constructor's parameters: those after it came in add_param_group (set by it)

    @property
    def placed(self) -> placement.Placement:
        """What the last placement built (the constructor's first on): plan, shard, sync, the unowned parameters."""
        assert self.placement is not None
        return self.placement

    @property
    def local_optimizer(self) -> Optimizer:
        assert self.optim is not None
        return self.optim

    def fingerprint(self) -> Any:
        """What every rank must step with alike: which parameters are trainable, and every hyperparameter."""
        return validation.step_fingerprint(self.placed.trainable, self.zero.param_groups)

    def push_hyperparameters(self) -> None:
        """``param_groups`` (what schedulers and users edit) into the local optimizer's: the one direction."""
        copy_hyperparameters(self.zero.param_groups, self.local_optimizer.param_groups)

    def repartition(self, fresh: bool = False, in_place: bool = False) -> None:
        """Place the parameters that have no owner yet (all, ``fresh``; bucket views moved ``in_place``) and rebuild."""
        before, groups = self.placement, self.zero.param_groups  # None at construction
        if before is not None:
            self.sync.finish()
        params, previous_shard = self.zero.global_params, None if before is None else before.shard
        placed = placement.place(
            params,
            groups,
            self.settings,
            self.optimizer_class,
            previous=None if fresh or before is None else before.plan,
            region_numel=self.region_numel,
            moving_within=self.sync if in_place else None,
        )
        self.placement, self.sync = placed, placed.sync
        placed.shard.unsynced = previous_shard is not None and previous_shard.unsynced  # (a step raised since)
        self.optim = optim = placement.bind_local_optimizer(
            self.optim, self.optimizer_class, self.defaults, placed.shard, previous_shard, groups
        )
        complete_hyperparameters(groups, optim.param_groups)
        self.push_hyperparameters()  # the local groups kept their old settings: the global ones are the truth
        if placement.install_kept(self.kept_unowned, placed, optim):  # loaded state, owned now
            self.consolidated = None
        if (stepper := self.zero.overlap_stepper) is not None:
            stepper.rebuild(optim, placed, params, groups)
        for listener in self.listeners:
            listener()

    def repartition_if_changed(self, refusal_deferred: bool = False) -> None:
        """``place_if_stale``, then master copies take parameters written outside; with ``refusal_deferred`` (clipping,
        outside an agreement) a refused change is left for the step to refuse: the old ranges still cover the norm."""
        params, placed = self.zero.global_params, self.placed
        if refusal_deferred and placement.is_stale(placed, params) and placement.layout_change(placed, params):
            return
        self.place_if_stale()
        self.placed.shard.reseed_masters()

    def place_if_stale(self) -> None:
        """A new placement where the last one is stale; a change ``placement.layout_change`` names is refused."""
        if placement.is_stale(self.placed, self.zero.global_params):
            if (change := placement.layout_change(self.placed, self.zero.global_params)) is not None:
                raise ValueError(change)
            if (source := self.zero.gradient_source) is not None:  # a raised backward: refused, not rebuilt away
                source.check_finished()
            self.repartition()


class ZeroParts(Protocol):
    """What ``Partitioning``, ``state_dicts`` and ``agreed`` read and set of a ZeroRedundancyOptimizer: public only."""

    param_groups: list[dict[str, Any]]
    defaults: dict[str, Any]
    process_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup | None
    rank: int
    world_size: int
    partition: str
    master_dtype: torch.dtype | None
    overlap_stepper: OverlapStepper | None
    placer: Placer

    @property
    def gradient_source(self) -> Any: ...
    @property
    def agreement_groups(self) -> list[dist.ProcessGroup]: ...
    @property
    def global_params(self) -> list[Tensor]: ...
    @property
    def plan(self) -> PartitionPlan: ...
    @property
    def local_shard(self) -> LocalShard: ...
    @property
    def local_optimizer(self) -> Optimizer: ...
    def index_of(self, param: Tensor) -> int | None: ...
    def land_sync(self) -> None: ...


def agreed(zero: ZeroParts, action: Callable[[], Any]) -> Any:
    """``action()`` on every rank, agreed across ``zero``'s ranks with its step's fingerprint; returns its result.
    In overlap mode a rank outside any backward is joined: DDP's join hook runs the comm hook there."""
    joined = zero.overlap_stepper is not None and not in_backward()
    return stepping.agreed(action, zero.placer.fingerprint, zero.agreement_groups, joined)


def _agreed_group(zero: ZeroParts, param_group: Any) -> dict[str, Any]:
    """``param_group`` normalised once every rank has checked it and all agree on it (``add_param_group``)."""
    placer, groups = zero.placer, zero.param_groups

    def normalized() -> dict[str, Any]:
        placer.sync.finish()  # first the groups there are: the sync landed over no write, the classes unedited
        placer.sync.check_untouched()
        check_classes_unchanged(groups, placer.local_optimizer, placer.optimizer_class)
        (checked,) = normalize_param_groups([param_group], first=len(groups))
        check_names_alike([checked], groups[0])
        validation.try_optimizer_class(placer.optimizer_class, [*groups, checked], placer.defaults, zero.master_dtype)
        validation.check_state_formats([checked], zero.defaults.get(FORMAT_KEY, "fp32"), first=len(groups))
        with_grad = [i for i, p in enumerate(checked["params"]) if p.grad is not None]
        if zero.gradient_source is not None and with_grad:
            raise ValueError(
                f"add_param_group under ShardedDataParallel: parameters {with_grad[:5]} of the new group already "
                "have a .grad, which ShardedDataParallel did not average (they were not held in that backward): "
                "add the group before the backward, or clear their .grad first"
            )
        return checked

    def what_it_is(checked: dict[str, Any]) -> Fingerprint:
        return validation.fingerprint([checked], placer.defaults, first_group=len(groups))

    return run_agreed(normalized, zero.process_group, "add_param_group", then_agree_on=what_it_is)


def _add_group(zero: ZeroParts, group: dict[str, Any]) -> None:
    """``Optimizer.add_param_group``; a group naming its own class takes none of the constructor's defaults."""
    constructor_defaults = zero.defaults
    if CLASS_KEY in group:  # but the constructor's state_format, which any class may keep
        zero.defaults = {k: v for k, v in constructor_defaults.items() if k == FORMAT_KEY}
    try:
        Optimizer.add_param_group(cast(Optimizer, zero), group)
    finally:
        zero.defaults = constructor_defaults


class Partitioning:
    """ZeroRedundancyOptimizer's plan: who owns what, and placing again (a base class of it, over its ``placer``)."""

    def add_param_group(self: ZeroParts, param_group: dict[str, Any]) -> None:
        """Add a group on every rank (collective): new parameters are placed, existing ones stay where they are.

        Args:
            param_group: ``{"params": [...], **hyperparameters}``, the same on every rank.

        Raises:
            ValueError: on every rank, when any rank refuses the group (a parameter held already ...) or they differ.
        """
        placer = self.placer
        if placer.placement is None:  # Optimizer.__init__'s groups: only recorded, placed at the constructor's end
            _add_group(self, param_group)
            return
        group = _agreed_group(self, param_group)
        restore = _snapshot(placer)
        _add_group(self, group)
        try:
            placer.repartition()
        except BaseException:  # the optimizer stays as it was: a retry, or the next step, meets no half-added group
            restore()
            raise

    @property
    def optim(self: ZeroParts) -> Optimizer | None:
        """The plain ``torch.optim`` optimizer over this rank's shard, as torch's attribute (``local_optimizer``)."""
        return self.placer.optim

    @property
    def plan(self: ZeroParts) -> PartitionPlan:
        """Which rank owns each parameter (global index order)."""
        return self.placer.placed.plan

    def owner_of(self: ZeroParts, param: Tensor) -> int:
        """The rank that owns ``param`` whole: -1 for a frozen one, -2 for one split (see ``fragments_of``).

        Args:
            param: one of this optimizer's parameters.

        Raises:
            ValueError: this optimizer does not hold ``param``.
        """
        if (index := self.index_of(param)) is None:
            raise ValueError(f"this ZeroRedundancyOptimizer does not hold that parameter (shape {tuple(param.shape)})")
        return self.plan.owners[index]

    def fragments_of(self: ZeroParts, param: Tensor) -> tuple[Fragment, ...] | None:
        """Which ranks own which elements of ``param`` (memory order); None when this optimizer does not hold it.

        Args:
            param: a tensor, one of this optimizer's parameters or not.
        """
        index = self.index_of(param)
        return None if index is None else self.plan.fragments[index]

    def index_of(self: ZeroParts, param: Tensor) -> int | None:
        """``param``'s global index (None when this optimizer does not hold it).

        Args:
            param: a tensor, one of this optimizer's parameters or not.
        """
        return self.placer.placed.index.get(id(param))

    def use_regions(self: ZeroParts, region_numel: dict[Any, int]) -> None:
        """Cut the even partition into regions (``ShardedDataParallel``'s buckets), each split evenly, before any state.

        Args:
            region_numel: the most elements a region holds, per layout key ``(device, dtype)``.

        Raises:
            RuntimeError: on every rank, when the optimizer has state already on some rank (even partition).
        """
        if region_numel == self.placer.region_numel or self.partition != "even":
            return
        has_state = torch.tensor([float(any(self.local_optimizer.state.values()))], device=self.placer.comm_device)
        if comm.all_reduce_(has_state, self.process_group, "max").item():  # a rank may own no state: ask all
            raise RuntimeError(
                "ShardedDataParallel re-cuts an even partition into buckets, which moves its fragments: wrap the "
                "model before the optimizer has any state (before the first step() and before loading a checkpoint)"
            )
        self.placer.region_numel = region_numel
        self.placer.repartition(fresh=True, in_place=True)  # at wrapping, before any forward through the wrapper


def _snapshot(placer: Placer) -> Callable[[], None]:
    """What ``add_param_group`` changes once its group is agreed, and a function putting it back if placing fails."""
    groups, placed, optim = len(placer.zero.param_groups), (placer.placement, placer.sync), placer.local_optimizer
    local, state = [list(group["params"]) for group in optim.param_groups], dict(optim.state)
    kept, consolidated = dict(placer.kept_unowned), placer.consolidated  # placing may take them
    composite = optim if isinstance(optim, CompositeOptimizer) else None
    parts = None if composite is None else (list(composite._order), dict(composite.parts), composite.formats)

    def restore() -> None:
        del placer.zero.param_groups[groups:]
        placer.placement, placer.sync = placed
        placer.optim = optim
        placer.kept_unowned, placer.consolidated = kept, consolidated
        if composite is not None and parts is not None:  # its groups are its parts'
            composite._order[:], composite.parts, composite.formats = parts
            for kind, part in composite.parts.items():
                del part.param_groups[sum(1 for k, _ in composite._order if k == kind) :]
        else:
            del optim.param_groups[len(local) :]
        for group, params in zip(optim.param_groups, local):
            group["params"] = params
        optim.state.clear()
        optim.state.update(state)
        if (stepper := placer.zero.overlap_stepper) is not None:
            stepper.rebuild(optim, placer.placed, placer.zero.global_params, placer.zero.param_groups)

    return restore
