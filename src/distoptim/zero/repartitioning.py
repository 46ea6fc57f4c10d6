"""``Partitioning``, a base class of the optimizer (``self`` typed as ``ZeroParts``): who owns what, and placing again
(``placement.place``) after ``add_param_group``, when a parameter is made trainable or given new storage, and where
``ShardedDataParallel`` re-cuts an even partition into its buckets' regions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from distoptim.comm import collectives as comm
from distoptim.zero import placement, validation
from distoptim.zero.buckets import ParameterSync
from distoptim.zero.local_optimizer import (
    CLASS_KEY,
    CompositeOptimizer,
    check_classes_unchanged,
    whole_tensor_weights,
)
from distoptim.zero.overlap import OverlapStepper
from distoptim.zero.partition import Fragment, PartitionPlan
from distoptim.zero.shard import LocalShard, complete_hyperparameters
from distoptim.zero.state_formats import FORMAT_KEY
from distoptim.zero.unowned_state import install_kept

__all__ = ["Partitioning", "ZeroParts"]


class ZeroParts(Protocol):
    """What the base classes (``Partitioning``, ``state_dicts``') read and set of a ZeroRedundancyOptimizer."""

    param_groups: list[dict[str, Any]]
    defaults: dict[str, Any]
    process_group: dist.ProcessGroup
    rank: int
    world_size: int
    partition: str
    master_dtype: torch.dtype | None
    _ready: bool
    _comm_device: torch.device
    _consolidated: Any

    @property
    def gradient_source(self) -> Any: ...

    overlap_stepper: OverlapStepper | None
    optim: Optimizer | None
    _optimizer_class: type[Optimizer]
    _defaults: dict[str, Any]
    _first_added: int
    _settings: placement.PlacementSettings
    _index_cache: tuple[PartitionPlan | None, dict[int, int]]
    _placement: placement.Placement | None
    _sync: ParameterSync | None
    _kept_unowned: dict[int, dict[str, Any]]
    _region_numel: dict[Any, int] | None
    _plan_listeners: list[Callable[[], None]]
    _optimizer_state_dict_pre_hooks: Any
    _optimizer_state_dict_post_hooks: Any
    _optimizer_load_state_dict_pre_hooks: Any
    _optimizer_load_state_dict_post_hooks: Any

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
    def _add_group(self, group: dict[str, Any]) -> None: ...
    def _push_hyperparameters(self) -> None: ...
    def _agreed(self, action: Callable[[], Any]) -> Any: ...
    def _repartition(self, fresh: bool = False, in_place: bool = False) -> None: ...
    def _repartition_if_changed(self) -> None: ...
    def _place_if_stale(self) -> None: ...


def _check_before_adding(zero: ZeroParts) -> None:
    """``add_param_group``'s first check: the sync landed over no write of the user's, the groups' classes unedited."""
    if zero._sync is not None:
        zero._sync.finish()
        zero._sync.check_untouched()
    check_classes_unchanged(zero.param_groups, zero.local_optimizer, zero._optimizer_class)


class Partitioning:
    """ZeroRedundancyOptimizer's plan: who owns what, and placing again (a base class of it)."""

    # what the last placement built (None until the constructor's first)
    _index_cache: tuple[PartitionPlan | None, dict[int, int]]
    _placement: placement.Placement | None = None
    _sync: ParameterSync | None = None
    optim: Optimizer | None = None
    _region_numel: dict[Any, int] | None = None  # even partition: the most elements a region holds, per layout key
    _consolidated: Any

    def add_param_group(self: ZeroParts, param_group: dict[str, Any]) -> None:
        """Add a group on every rank (collective): new parameters are placed, existing ones stay where they are.

        Args:
            param_group: ``{"params": [...], **hyperparameters}``, the same on every rank.

        Raises:
            ValueError: on every rank, when any rank's group is refused (a parameter already held, a bad
                hyperparameter) or the ranks' groups differ.
        """
        if not self._ready:
            self._add_group(param_group)
            return
        group = validation.agreed_param_group(
            param_group,
            self._optimizer_class,
            self.param_groups,
            self._defaults,
            self.process_group,
            sharded_gradients=self.gradient_source is not None,
            master_dtype=self.master_dtype,
            check_existing=lambda: _check_before_adding(self),
            state_format=self.defaults.get(FORMAT_KEY, "fp32"),
        )
        before = _Snapshot(self)
        self._add_group(group)
        try:
            self._repartition()
        except BaseException:  # the optimizer stays as it was: a retry, or the next step, meets no half-added group
            before.restore(self)
            raise

    def _add_group(self: ZeroParts, group: dict[str, Any]) -> None:
        """``Optimizer.add_param_group``; a group naming its own class takes none of the constructor's defaults."""
        if CLASS_KEY not in group:
            Optimizer.add_param_group(cast(Optimizer, self), group)
            return
        constructor_defaults = self.defaults  # but the constructor's state_format, which any class may keep
        self.defaults = {k: v for k, v in constructor_defaults.items() if k == FORMAT_KEY}
        try:
            Optimizer.add_param_group(cast(Optimizer, self), group)
        finally:
            self.defaults = constructor_defaults

    @property
    def plan(self: ZeroParts) -> PartitionPlan:
        """Which rank owns each parameter (global index order)."""
        assert self._placement is not None
        return self._placement.plan

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
        if self._index_cache[0] is not self.plan:
            self._index_cache = (self.plan, {id(p): i for i, p in enumerate(self.global_params)})
        return self._index_cache[1].get(id(param))

    def _repartition(self: ZeroParts, fresh: bool = False, in_place: bool = False) -> None:
        """Place the parameters that have no owner yet (all, ``fresh``; bucket views moved ``in_place``) and rebuild."""
        if self._sync is not None:
            self._sync.finish()
        before = self._placement  # None at construction
        params, previous_shard = self.global_params, None if before is None else before.shard
        whole, costs = whole_tensor_weights(self.param_groups, self._optimizer_class)
        placed = placement.place(
            params,
            self.param_groups,
            self._settings,
            previous=None if fresh or before is None else before.plan,
            region_numel=self._region_numel,
            moving_within=self._sync if in_place else None,
            whole=whole,
            costs=costs,
        )
        self._placement, self._sync = placed, placed.sync
        self.optim = optim = placement.bind_local_optimizer(
            self.optim, self._optimizer_class, self._defaults, placed.shard, previous_shard, self.param_groups
        )
        complete_hyperparameters(self.param_groups, optim.param_groups)
        self._push_hyperparameters()  # the local groups kept their old settings: the global ones are the truth
        if install_kept(self._kept_unowned, placed.plan.owners, optim, placed.shard):  # loaded state, owned now
            self._consolidated = None
        if self.overlap_stepper is not None:
            self.overlap_stepper.rebuild(optim, placed.shard, placed.plan, params, self.param_groups)
        for listener in self._plan_listeners:
            listener()

    def _repartition_if_changed(self: ZeroParts) -> None:
        """A new placement where the last one is stale; then master copies take parameters written outside."""
        self._place_if_stale()
        self.local_shard.reseed_masters()

    def _place_if_stale(self: ZeroParts) -> None:
        """A new placement where the last one is stale; a parameter whose dtype or device changed is refused."""
        assert self._placement is not None
        if placement.is_stale(self._placement, self.global_params):
            placement.check_layout_keys(self._placement, self.global_params)
            self._repartition()

    def use_regions(self: ZeroParts, region_numel: dict[Any, int]) -> None:
        """Cut the even partition into regions of at most ``region_numel[key]`` elements, each split evenly
        (``ShardedDataParallel``'s buckets); before the optimizer has state.

        Args:
            region_numel: the most elements a region holds, per layout key ``(device, dtype)``.

        Raises:
            RuntimeError: the optimizer has state already on some rank (under the even partition), on every rank.
        """
        if region_numel == self._region_numel or self.partition != "even":
            return
        has_state = torch.tensor([float(any(self.local_optimizer.state.values()))])
        if comm.all_reduce_(has_state, self.process_group, "max").item():  # a rank may own no state: ask all
            raise RuntimeError(
                "ShardedDataParallel re-cuts an even partition into buckets, which moves its fragments: wrap the "
                "model before the optimizer has any state (before the first step() and before loading a checkpoint)"
            )
        self._region_numel = region_numel
        self._repartition(fresh=True, in_place=True)  # at wrapping, before any forward through the wrapper


class _Snapshot:
    """What ``add_param_group`` changes once its group is agreed, to put back if placing the group fails."""

    def __init__(self, zero: ZeroParts) -> None:
        self.groups = len(zero.param_groups)
        self.placed = (zero._placement, zero._sync)
        self.optim = optim = zero.local_optimizer  # add_param_group runs after the constructor's placement
        self.local = [list(group["params"]) for group in optim.param_groups]
        self.state = dict(optim.state)
        composite = optim if isinstance(optim, CompositeOptimizer) else None
        self.parts = None if composite is None else (list(composite._order), dict(composite.parts))
        self.formats = None if composite is None else composite.formats

    def restore(self, zero: ZeroParts) -> None:
        del zero.param_groups[self.groups :]
        zero._placement, zero._sync = self.placed
        zero.optim = optim = self.optim
        if isinstance(optim, CompositeOptimizer) and self.parts is not None:  # its groups are its parts'
            optim._order[:], optim.parts = self.parts[0], self.parts[1]
            optim.formats = self.formats
            for kind, part in optim.parts.items():
                del part.param_groups[sum(1 for k, _ in optim._order if k == kind) :]
        else:
            del optim.param_groups[len(self.local) :]
        for group, params in zip(optim.param_groups, self.local):
            group["params"] = params
        optim.state.clear()
        optim.state.update(self.state)
        if zero.overlap_stepper is not None:
            zero.overlap_stepper.rebuild(optim, zero.local_shard, zero.plan, zero.global_params, zero.param_groups)
