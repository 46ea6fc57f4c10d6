"""ZeroRedundancyOptimizer: any ``torch.optim`` optimizer with its state sharded across a process group (ZeRO-1).

It composes three pieces: a partition plan (``partition``: who owns which parameter), a local optimizer over the
owned parameters (plain ``torch.optim``), and a sync strategy (``buckets``: how updated shards reach every rank).
A step is: hyperparameters global -> local, local step, sync, local-added keys back to the global view.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.optim import Optimizer

from distoptim import _agreement as agreement
from distoptim.functional import FunctionalOptimizer
from distoptim.zero import amp, checkpoint, clipping, comm, sharded, validation
from distoptim.zero.buckets import BucketViewSync, ParameterSync, StagedSync, layouts_from_plan
from distoptim.zero.overlap import OverlapStepper
from distoptim.zero.partition import UNOWNED, Fragment, PartitionPlan, partition_parameters
from distoptim.zero.shard import LocalShard, copy_hyperparameters, stitch

__all__ = ["ZeroRedundancyOptimizer"]

_T = TypeVar("_T")
_Prepared = tuple[float | None, amp.Verdict | None]  # a step's loss, and its GradScaler verdict if any


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Wrap ``optimizer_class`` so that each rank of ``process_group`` keeps and updates ~1/N of its state (ZeRO-1).

    Every trainable element is owned by one rank (``partition``). ``step()`` expects gradients already averaged
    across ranks (DDP does this; with ``distoptim.hooks.reduce_to_owners_hook`` only the owned ones are, which is
    ZeRO-2): each rank steps what it owns with its local optimizer, then the updated parameters are synced to every
    rank. A drop-in for ``torch.distributed.optim.ZeroRedundancyOptimizer``; ``clip_grad_norm_`` clips the whole
    gradient from the owned parts.

    Args:
        params: the parameters to optimize, as for any ``torch.optim`` optimizer: an iterable of tensors or of
            param-group dicts. Every rank must pass the same parameters (shapes, dtypes, ``requires_grad``, groups)
            in the same order; a mismatch raises on every rank.
        optimizer_class: the ``torch.optim.Optimizer`` subclass to shard (``torch.optim.AdamW`` ...), or a
            ``distoptim.functional`` class. Pass the class, not an instance.
        process_group: the group to shard over; ``None`` is the default (world) group.
        parameters_as_bucket_view: parameters become views into flat (device, dtype) buffers: the sync is in place.
        overlap_with_ddp: step inside DDP's backward through ``distoptim.hooks.hook_with_zero_step`` (or
            ``hook_with_zero_step_interleaved``) registered on the DDP model; ``optimizer_class`` must have a
            functional counterpart (SGD, Adam, AdamW, Adagrad, Adadelta, Adamax, RMSprop, Rprop).
        partition: ``"greedy"`` (default, torch's: each parameter whole on one rank, sorted-greedy by size) or
            ``"even"`` (each (device, dtype) cut into ``world_size`` equal ranges; parameters may straddle ranks; the
            largest shard is within ``world_size - 1`` elements of the ideal). ``"even"`` needs an optimizer whose
            update is elementwise (SGD, Adam, AdamW, Adagrad, Adadelta, Adamax, RMSprop, Rprop, NAdam, RAdam).
        master_dtype: step a copy in this dtype (``torch.float32`` for a bf16 model) of this rank's fragments of
            lower-precision parameters, rounded into them after each step; ``None`` (default): step the parameters.
        **defaults: ``optimizer_class``'s hyperparameters (``lr=1e-3`` ...); they must agree across ranks.

    ``param_groups`` is the global view that schedulers and users edit; ``optim`` the local optimizer, ``state`` its
    shard. Checkpoints: ``consolidate_state_dict`` + ``state_dict`` (``torch.optim``'s format, on one rank) or
    ``sharded_state_dict`` (DCP, every rank its shard); either loads at any world size and partition. ``GradScaler``
    drives it like any optimizer (``scaler.step(zero)``).

    Example, inside an initialised process group::

        model = DDP(make_model())
        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
        for batch in loader:
            optimizer.zero_grad()
            loss_fn(model(batch)).backward()
            optimizer.step()
        distoptim.checkpoint.save({"model": model.state_dict(), "optim": optimizer.sharded_state_dict()}, path)
    """

    _step_supports_amp_scaling = True  # torch.amp.GradScaler hands step() its verdict and scale (see zero/amp.py)

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[Optimizer] | type[FunctionalOptimizer],
        process_group: dist.ProcessGroup | None = None,
        parameters_as_bucket_view: bool = False,
        overlap_with_ddp: bool = False,
        *,
        partition: str = "greedy",
        master_dtype: torch.dtype | None = None,
        replicate_group: dist.ProcessGroup | None = None,
        **defaults: Any,
    ) -> None:
        group = comm.default_group(process_group)
        local_class, groups, device, functional_cls, collectives = validation.check_construction(
            params,
            optimizer_class,
            group,
            defaults,
            parameters_as_bucket_view=parameters_as_bucket_view,
            overlap_with_ddp=overlap_with_ddp,
            partition=partition,
            master_dtype=master_dtype,
            replicate_group=replicate_group,
        )

        self._ready = False  # until then, add_param_group only records groups (Optimizer.__init__ calls it)
        super().__init__(groups, defaults)
        Joinable.__init__(self)
        self.process_group = group
        self.replicate_group = replicate_group  # hybrid sharding: the ranks holding this shard in other shard groups
        self.replica_count = 1 if replicate_group is None else comm.group_size(replicate_group)
        self._ddp_group_checked = False  # reduce_to_owners_hook checks DDP's group against ours once
        self._comm_device = device  # where this rank's messages live: its parameters' GPU under NCCL, else the CPU
        self.rank = comm.group_rank(group)
        self.world_size = comm.group_size(group)
        self.global_rank = comm.global_rank(group, self.rank)
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self.collectives = collectives  # how gradients reach their owners and parameters leave them (comm.py)
        self.partition = partition
        self.master_dtype = master_dtype
        self._optimizer_class = local_class
        self.overlap_stepper = None if functional_cls is None else OverlapStepper(functional_cls, group, self)
        self._defaults = defaults
        self._plan: PartitionPlan | None = None
        self._index_cache: tuple[PartitionPlan | None, dict[int, int]] = (None, {})
        self._sync: ParameterSync | None = None
        self._routes: dict[tuple[Any, ...], Any] = {}  # the gradient routes of DDP buckets under this plan
        self._shard: LocalShard | None = None
        self._region_numel: dict[Any, int] | None = None  # even partition: the most elements a region holds, per key
        self._plan_listeners: list[Callable[[], None]] = []  # told after every repartition (ShardedDataParallel)
        self._gradient_store: Any = None  # ShardedDataParallel's owned gradient, when it holds the gradient
        self._consolidated: checkpoint.GlobalState | None = None
        self.optim: Optimizer | None = None
        self._ready = True
        self._repartition()
        self.initialized = True  # as torch's attribute; here the overlap mode needs no DDP warm-up to be ready

    # ----------------------------------------------------------------------------------------------- views
    @property
    def global_params(self) -> list[Tensor]:
        """Every parameter this optimizer holds (owned here or not), in global order: group by group."""
        return [param for group in self.param_groups for param in group["params"]]

    @property
    def plan(self) -> PartitionPlan:
        """Which rank owns each parameter (global index order)."""
        assert self._plan is not None
        return self._plan

    def owner_of(self, param: Tensor) -> int:
        """The rank that owns ``param`` whole: -1 for a frozen one, -2 for one split (see ``fragments_of``)."""
        if (index := self._index_of(param)) is None:
            raise ValueError(f"this ZeroRedundancyOptimizer does not hold that parameter (shape {tuple(param.shape)})")
        return self.plan.owners[index]

    def fragments_of(self, param: Tensor) -> tuple[Fragment, ...] | None:
        """Which ranks own which elements of ``param`` (memory order); None when this optimizer does not hold it."""
        index = self._index_of(param)
        return None if index is None else self.plan.fragments[index]

    def _index_of(self, param: Tensor) -> int | None:
        """``param``'s global index (None when not held), from a table rebuilt with the plan."""
        if self._index_cache[0] is not self.plan:
            self._index_cache = (self.plan, {id(p): i for i, p in enumerate(self.global_params)})
        return self._index_cache[1].get(id(param))

    @property
    def local_shard(self) -> LocalShard:
        """The tensors this rank's local optimizer steps (parameters it owns whole, views of its fragments)."""
        assert self._shard is not None
        return self._shard

    @property
    def local_optimizer(self) -> Optimizer:
        assert self.optim is not None
        return self.optim

    @property
    def state(self) -> Any:
        """This rank's shard of the state: the local optimizer's ``state`` (also after ``load_state_dict``)."""
        optim = getattr(self, "optim", None)
        return optim.state if optim is not None else self.__dict__.get("_initial_state")

    @state.setter
    def state(self, value: Any) -> None:  # Optimizer.__init__ assigns an empty state before the shard exists
        self.__dict__["_initial_state"] = value

    def all_ranks(self) -> tuple[list[int], int]:
        """The global ranks of this shard group and of its replicas, and how many ranks they span in all (the shard
        groups times the replicas): the ranks DDP must average gradients over."""
        ranks = set(dist.get_process_group_ranks(self.process_group))
        if self.replicate_group is not None:
            ranks |= set(dist.get_process_group_ranks(self.replicate_group))
        return sorted(ranks), self.world_size * self.replica_count

    @property
    def agreement_groups(self) -> list[dist.ProcessGroup]:
        """The groups whose union must agree on every step: this shard group, and its replicas if any."""
        return [self.process_group] if self.replicate_group is None else [self.process_group, self.replicate_group]

    # ------------------------------------------------------------------------------------------ the step
    def step(  # type: ignore[override]
        self, closure: Callable[[], float] | None = None, grad_scaler: Any = None, **kwargs: Any
    ) -> float | None:
        """Local step on this rank's shard (``closure`` and ``kwargs`` go to the local optimizer), then sync.

        Before the sync the ranks agree (one small all-reduce on the control plane) that the local part succeeded
        everywhere, with the same parameters trainable and the same hyperparameters: if it raised on one rank, or a
        setting was changed on one rank only, every rank raises instead of waiting in the sync or stepping with
        different settings. ``grad_scaler`` is passed by ``torch.amp.GradScaler.step`` (see ``zero/amp.py``)."""
        if self.overlap_stepper is not None:  # the DDP comm hook stepped during backward: only confirm it did
            return self.overlap_stepper.explicit_step(closure, grad_scaler, kwargs)
        Join.notify_join_context(self)
        self.sync_finished()
        try:
            (loss, verdict), scaled, found_inf = self._agreed_step(
                lambda: self._prepare_and_step(closure, kwargs, grad_scaler)
            )
            if verdict is not None:
                verdict.record(found_inf)
            if scaled and not found_inf:  # a GradScaler's step, and no rank's owned gradient held an inf or nan
                self._agreed(lambda: None if verdict is None else self._step_local_optimizer(None, kwargs))
        finally:
            self.local_shard.detach_grads()  # no stale gradient piece outlives the step
        self._pull_hyperparameters()
        self.sync_parameters()
        self._consolidated = None
        return loss

    def _agreed_step(self, action: Callable[[], _Prepared]) -> tuple[_Prepared, bool, bool]:
        """``action()`` (``_prepare_and_step``, or nothing on a joined rank), agreed; then whether any rank steps
        under a GradScaler, and whether any of those found an inf or nan (every rank then skips)."""
        prepared, (scaled, found_inf) = agreement.run_step_agreed(
            action,
            self._step_fingerprint,
            self.agreement_groups,
            flags=lambda done: (False, False) if done is None or done[1] is None else (True, done[1].found_here),
        )
        return prepared, scaled, found_inf

    def _prepare_and_step(
        self, closure: Callable[[], float] | None, kwargs: dict[str, Any], grad_scaler: Any
    ) -> tuple[float | None, amp.Verdict | None]:
        """Everything a step does locally; with a ``grad_scaler``, everything but the local optimizer's step, which
        waits for the ranks' verdict on inf/nan."""
        self._repartition_if_changed()
        loss: float | None = None
        if closure is not None and self.local_shard.detached:  # pieces and master copies take .grad when attached
            with torch.enable_grad():
                loss, closure = closure(), None
        validation.check_unowned_have_no_grad(self._unowned)
        self._push_hyperparameters()
        self.local_shard.attach_grads()
        sharded_in_memory = self._gradient_store is not None
        verdict = amp.check_and_unscale(grad_scaler, self, self.local_shard.step_grads, sharded_in_memory)
        if verdict is None:
            local_loss = self._step_local_optimizer(closure, kwargs)
            loss = loss if closure is None else local_loss
        return loss, verdict

    def _step_local_optimizer(self, closure: Callable[[], float] | None, kwargs: dict[str, Any]) -> float | None:
        loss: float | None = self.local_optimizer.step(closure, **kwargs)
        self.local_shard.write_back()
        return loss

    def _agreed(self, action: Callable[[], _T]) -> _T:
        """``action()`` on this rank, then the step's agreement (collective; a joined rank agrees on doing nothing)."""
        return agreement.run_step_agreed(action, self._step_fingerprint, self.agreement_groups)[0]

    def _step_fingerprint(self) -> agreement.Fingerprint:
        """What every rank must step with alike: which parameters are trainable, and every hyperparameter."""
        return validation.step_fingerprint(self._trainability, self.param_groups)

    def sync_parameters(self) -> None:
        """Bring every rank's updated shard to every rank (collective; ``step()`` ends with it)."""
        assert self._sync is not None
        self._sync.sync_parameters()

    def sync_finished(self) -> None:
        """Wait for any parameter sync still in flight (``ShardedDataParallel(overlap_param_sync=True)`` leaves the
        sync of later buckets to finish during the next forward): after it every parameter holds its value."""
        assert self._sync is not None
        self._sync.finish()

    def _push_hyperparameters(self) -> None:
        copy_hyperparameters(self.param_groups, self.local_optimizer.param_groups)

    def _pull_hyperparameters(self) -> None:
        copy_hyperparameters(self.local_optimizer.param_groups, self.param_groups)

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False, *, grad_scale: Any = None
    ) -> Tensor:
        """Clip the gradient by its total norm, as ``torch.nn.utils.clip_grad_norm_`` would on the whole gradient
        (collective: one scalar all-reduce; returns the total norm, the same on every rank).

        Each rank measures and scales the gradient of what it owns, so it is right with gradients reduced to their
        owners (``reduce_to_owners_hook``) too; gradients a rank does not own are left as they are. Norms accumulate
        in float32. Call it between ``backward()`` and ``step()`` on every rank. ``grad_scale``: the loss scale the
        gradients still carry (``scaler.get_scale()`` where ``scaler.unscale_(zero)`` cannot run, as for fp16
        gradients): the norm and the clipping are then those of the unscaled gradient.
        """
        if self.overlap_stepper is not None:
            raise RuntimeError(
                "ZeroRedundancyOptimizer(overlap_with_ddp=True) cannot clip: its step already ran inside DDP's "
                "backward, so clip_grad_norm_ would clip gradients the step has used and report a norm as if it had "
                "worked. Build it with overlap_with_ddp=False (with reduce_to_owners_hook for ZeRO-2) to clip"
            )
        grads, group, device = self.local_shard.owned_grads(), self.process_group, self._comm_device
        return clipping.clip_grad_norm_(grads, max_norm, norm_type, error_if_nonfinite, group, device, grad_scale)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of all parameters, owned or not."""
        if self.overlap_stepper is not None:
            self.overlap_stepper.check_stepped()
        if self._gradient_store is not None:
            self._gradient_store.clear()
        super().zero_grad(set_to_none)
        if self.overlap_stepper is not None:
            self.overlap_stepper.record_grads()

    # ------------------------------------------------------------------------------------ partitioning
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group on every rank (collective): new parameters are placed, existing ones stay where they are."""
        if not self._ready:
            super().add_param_group(param_group)
            return
        group = validation.agreed_param_group(
            param_group, self._optimizer_class, self.param_groups, self._defaults, self.process_group
        )
        super().add_param_group(group)
        self._repartition()

    def _repartition(self, fresh: bool = False) -> None:
        """Place the parameters that have no owner yet and rebuild what depends on the plan.

        Runs at construction, from ``add_param_group`` and when ``step()`` sees a change of ``requires_grad``.
        Parameters that already have an owner keep it, and their state, even when frozen since (a frozen parameter
        has no gradient, so its owner skips it as a plain optimizer would).
        """
        params = self.global_params
        self._trainability = tuple(p.requires_grad for p in params)
        self._plan = partition_parameters(
            [p.numel() for p in params],
            list(self._trainability),
            self.world_size,
            previous=None if fresh else self._plan,
            mode=self.partition,
            keys=[(p.device, p.dtype) for p in params],
            region_numel=self._region_numel,
        )
        self._unowned = [
            p
            for p, owner, trainable in zip(params, self._plan.owners, self._trainability)
            if owner == UNOWNED and not trainable
        ]
        if self._sync is not None:
            self._sync.finish()
            self._sync.release()  # before the shard's views are made: bucket views replace the parameters' storage
        strategy = BucketViewSync if self.parameters_as_bucket_view else StagedSync
        layouts = layouts_from_plan(self._plan.layouts, self._plan.fragments, params)
        self._sync = strategy(layouts, self.process_group, self.collectives)
        self._routes.clear()
        previous, self._shard = self._shard, LocalShard(self._plan, self.param_groups, self.rank, self.master_dtype)
        local_groups = self._shard.param_groups(self.param_groups)
        if self.optim is None:
            self.optim = self._optimizer_class(local_groups, **self._defaults)
        else:
            self._shard.move_state(self.optim.state, previous)  # kept for every fragment that stays here
            for local_group, group in zip(self.optim.param_groups, local_groups):
                local_group["params"] = group["params"]
            for new_group in local_groups[len(self.optim.param_groups) :]:
                self.optim.add_param_group(new_group)
        self._pull_hyperparameters()
        if self.overlap_stepper is not None:
            self.overlap_stepper.rebuild(self.optim, self._shard, self._plan, params, self.param_groups)
        self._bound = self._storages()
        for listener in self._plan_listeners:
            listener()

    def _use_regions(self, region_numel: dict[Any, int]) -> None:
        """Cut the even partition into regions of at most ``region_numel[key]`` elements, each split evenly
        (``ShardedDataParallel``'s buckets). Only before the optimizer has state: the fragments change."""
        if region_numel == self._region_numel or self.partition != "even":
            return
        if any(self.local_optimizer.state.values()):
            raise RuntimeError(
                "ShardedDataParallel re-cuts an even partition into buckets, which moves its fragments: wrap the model "
                "before the optimizer has any state (before the first step() and before loading a checkpoint)"
            )
        self._region_numel = region_numel
        self._repartition(fresh=True)

    def _storages(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self.global_params)

    def _repartition_if_changed(self) -> None:
        """Before a step: gradual unfreezing (a parameter made trainable since the last step gets an owner; detected
        locally, as torch does: every rank must change ``requires_grad`` alike, before the same step), and
        parameters given new storage since the plan was bound (``param.data = ...``, ``model.to(...)`` copying):
        fragment views and bucket views would otherwise step and sync the old memory. Both keep owners and state."""
        if tuple(p.requires_grad for p in self.global_params) != self._trainability or self._storages() != self._bound:
            self._repartition()

    # -------------------------------------------------------------------------------------- checkpoints
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's shard onto rank ``to``, on its CPU (collective; only ``to`` receives anything).

        Shards travel in messages of at most ``checkpoint.STAGING_BYTES`` through one reused staging buffer on the
        communication device: no GPU holds the whole state, no sender a second copy of its shard.
        """
        checkpoint.agree_on_target(to, self.world_size, self.process_group)
        self.sync_finished()
        mine = self.local_shard.global_state(self.local_optimizer.state)
        merged = checkpoint.gather_state(mine, to, self.process_group, self._comm_device)
        self._consolidated = None if merged is None else dict(sorted(stitch(merged, self.global_params).items()))

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer state in ``torch.optim``'s format, on the rank that consolidated it.

        Runs the hooks registered with ``register_state_dict_pre_hook`` / ``register_state_dict_post_hook`` as
        ``torch.optim`` does: pre-hooks first, post-hooks last (one returning a dict replaces the result).
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        if self._consolidated is None:
            raise RuntimeError(
                f"rank {self.rank} holds no consolidated optimizer state: call consolidate_state_dict(to={self.rank}) "
                "on all ranks (after the last step) before state_dict()"
            )
        state_dict = {
            "state": dict(self._consolidated),
            "param_groups": checkpoint.global_param_groups(self.param_groups),
        }
        return checkpoint.apply_hooks(self._optimizer_state_dict_post_hooks.values(), self, state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a global (``torch.optim``-format) dict on every rank; each keeps only its own shard's state.

        The whole dict is checked first (same verdict on every rank): a dict saved by another optimizer class or for
        other parameters raises a ``ValueError``. Load pre-hooks (which get a shallow copy and may return a
        replacement) run before, load post-hooks after, as in ``torch.optim``.
        """
        self.sync_finished()  # the load may write master weights into the parameters
        state_dict = state_dict.copy() if isinstance(state_dict, dict) else state_dict
        state_dict = checkpoint.apply_hooks(self._optimizer_load_state_dict_pre_hooks.values(), self, state_dict)
        by_param, hyperparameters = checkpoint.select_shard_on_every_rank(
            state_dict, self.param_groups, self._optimizer_class, self.process_group
        )
        for group, saved in zip(self.param_groups, hyperparameters):
            group.update(saved)
        local_state = self.local_shard.local_state(by_param)
        self._push_hyperparameters()
        local_groups = checkpoint.global_param_groups(self.local_optimizer.param_groups)
        self.local_optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})
        self._consolidated = None
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's fragments of the state (master weights included) and the hyperparameters, for
        ``torch.distributed.checkpoint``: ``dcp.save({"optim": zero.sharded_state_dict()}, checkpoint_id=path)``;
        to resume (any world size, either partition), ``dcp.load`` into a new one's, then ``load_sharded_state_dict``.
        Fragments without state yet get placeholders that a load fills in and a save leaves out."""
        self.sync_finished()
        shard, state = self.local_shard, self.local_optimizer.state
        placeholders = sharded.template_state(shard, self.local_optimizer.step, state)
        groups = pickle.dumps(checkpoint.global_param_groups(self.param_groups))
        return sharded.sharded_state(shard, state, placeholders, groups, self.global_params)

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Finish ``dcp.load`` into ``sharded_state_dict()``'s dict (the state was loaded in place)."""
        self.sync_finished()
        saved_groups = sharded.load_param_groups(state_dict, self.param_groups, self._optimizer_class)
        for group, saved in zip(self.param_groups, saved_groups):
            group.update(saved)
        self._push_hyperparameters()
        sharded.install_loaded(self.local_shard, self.local_optimizer.state, state_dict)
        self.local_shard.write_back()
        self._consolidated = None

    # --------------------------------------------------------------------------------------------- join
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """While this rank has run out of inputs, shadow the others' parameter sync. Its shard stays as it is with
        ``step()`` (DDP discards a joined rank's gradients); in overlap mode DDP's join hook runs the comm hook on zero
        buckets, which hands the joined rank the true average, so its shard keeps being stepped."""
        if self._gradient_store is not None:
            raise NotImplementedError(
                "Join (uneven inputs) is not supported with ShardedDataParallel: a joined rank would have to shadow "
                "every bucket's reduction and the parameter sync; give every rank the same number of batches (drop "
                "the last, uneven one: DistributedSampler(drop_last=True)), or use DDP with reduce_to_owners_hook"
            )
        return _ZeroJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.global_params[0].device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        return self.process_group


class _ZeroJoinHook(JoinHook):
    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self.zero = zero

    def main_hook(self) -> None:  # in overlap mode the comm hook syncs, and DDP's own join hook shadows it
        if self.zero.overlap_stepper is None:
            _, scaled, found_inf = self.zero._agreed_step(lambda: (None, None))
            if scaled and not found_inf:
                self.zero._agreed(lambda: None)
            self.zero.sync_parameters()
