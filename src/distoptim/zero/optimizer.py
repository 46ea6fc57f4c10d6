"""ZeroRedundancyOptimizer: any ``torch.optim`` optimizer with its state sharded across a process group (ZeRO-1)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.join import Joinable, JoinHook
from torch.optim import Optimizer

from distoptim.comm import collectives as comm
from distoptim.functional import FunctionalOptimizer
from distoptim.zero import amp, clipping, join, placement, repartitioning, state_dicts, stepping, validation
from distoptim.zero.buckets import ParameterSync
from distoptim.zero.local_optimizer import check_classes_unchanged, check_eps_from_first_dtype
from distoptim.zero.overlap import OverlapStepper
from distoptim.zero.shard import LocalShard
from distoptim.zero.state_formats import FORMAT_KEY

__all__ = ["ZeroRedundancyOptimizer"]


class ZeroRedundancyOptimizer(state_dicts.Checkpoints, repartitioning.Partitioning, Optimizer, Joinable):
    """Wrap ``optimizer_class`` so that each rank of ``process_group`` keeps and updates ~1/N of its state (ZeRO-1).

    A drop-in for torch's: ``step()`` takes averaged gradients (DDP's, or ``ShardedDataParallel``'s owned ones),
    steps this rank's share and syncs the parameters. More: ``docs/guides/zero.md``, ``docs/guides/state-formats.md``.

    Args:
        params: as for any ``torch.optim`` optimizer (a group may name its own ``"optimizer_class"``).
        optimizer_class: the ``torch.optim.Optimizer`` subclass (or ``distoptim.functional`` class) to shard.
        process_group: the group to shard over (default None: the world).
        parameters_as_bucket_view: parameters become views into flat buffers synced in place (default False).
        overlap_with_ddp: step inside DDP's backward through ``distoptim.hooks.hook_with_zero_step`` (default False).
        partition: ``"greedy"`` (default, torch's: whole parameters) or ``"even"`` (equal ranges).
        master_dtype: step a copy in this dtype of narrower parameters (default None: the parameters themselves).
        replicate_group: hybrid sharding: the ranks holding this shard elsewhere (default None: no replicas).
        state_format: ``"fp32"`` (default), ``"bf16"`` or ``"int8"``: the state between steps (groups may name theirs).
        **defaults: ``optimizer_class``'s hyperparameters (``lr=1e-3`` ...).

    Raises:
        TypeError: an argument of the wrong kind (a learning rate passed positionally, an optimizer instance).
        ValueError: on every rank, when any rank's arguments are refused or the ranks disagree.

    Example:
        ```python
        optimizer = ZeroRedundancyOptimizer(ddp_model.parameters(), torch.optim.AdamW, lr=1e-3)
        ```"""

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
        state_format: str = "fp32",
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
            state_format=state_format,
        )

        self.rank = comm.group_rank(group)
        self.world_size = comm.group_size(group)
        settings = placement.PlacementSettings(
            group, self.rank, self.world_size, partition, master_dtype, parameters_as_bucket_view, collectives
        )  # the placer places nothing until the constructor's end: add_param_group only records groups until then
        self.placer = repartitioning.Placer(self, settings, local_class, defaults, device)
        shown = defaults if state_format == "fp32" else {**defaults, FORMAT_KEY: state_format}  # each group's default
        super().__init__(groups, shown)
        Joinable.__init__(self)
        self.process_group = group
        self.replicate_group = replicate_group  # hybrid sharding: the ranks holding this shard in other shard groups
        self.replica_count = 1 if replicate_group is None else comm.group_size(replicate_group)
        self.global_rank = comm.global_rank(group, self.rank)
        self.parameters_as_bucket_view = parameters_as_bucket_view
        self.collectives = collectives  # how gradients reach their owners and parameters leave them (comm.py)
        self.partition = partition
        self.master_dtype = master_dtype
        self.overlap_stepper = (
            None if functional_cls is None else OverlapStepper(functional_cls, group, collectives, self, self._stepped)
        )
        self._gradient_source: stepping.GradientSource | None = None  # ShardedDataParallel's store
        self._held_back = False  # this step's local part waits for the gradient store's agreement (step 1b)
        self.joins = join.Joins()  # the Join contexts built over it (an open one refuses SDP)
        self.placer.first_added = len(self.global_params)
        self.placer.repartition()
        self.initialized = True  # as torch's attribute; here the overlap mode needs no DDP warm-up to be ready

    @property
    def global_params(self) -> list[Tensor]:
        """Every parameter this optimizer holds (owned here or not), in global order: group by group."""
        return [param for group in self.param_groups for param in group["params"]]

    @property
    def local_shard(self) -> LocalShard:
        """The tensors this rank's local optimizer steps (parameters it owns whole, views of its fragments)."""
        return self.placer.placed.shard

    @property
    def local_optimizer(self) -> Optimizer:
        """The plain ``torch.optim`` optimizer over this rank's shard (``optim``)."""
        return self.placer.local_optimizer

    @property
    def state(self) -> Any:
        """This rank's shard of the state: the local optimizer's ``state`` (also after ``load_state_dict``)."""
        optim = getattr(self, "optim", None)
        return optim.state if optim is not None else self.__dict__.get("_initial_state")

    @state.setter
    def state(self, value: Any) -> None:  # Optimizer.__init__ assigns an empty state before the shard exists
        self.__dict__["_initial_state"] = value

    def all_ranks(self) -> tuple[list[int], int]:
        """The global ranks of this shard group and its replicas, and how many ranks DDP must average over."""
        ranks = {rank for group in self.agreement_groups for rank in dist.get_process_group_ranks(group)}
        return sorted(ranks), self.world_size * self.replica_count

    @property
    def agreement_groups(self) -> list[dist.ProcessGroup]:
        """The groups whose union must agree on every step: this shard group, and its replicas if any."""
        return [self.process_group] if self.replicate_group is None else [self.process_group, self.replicate_group]

    def step(  # type: ignore[override]
        self, closure: Callable[[], float] | None = None, grad_scaler: Any = None, **kwargs: Any
    ) -> float | None:
        """Step this rank's shard, agreed across ranks, then sync the parameters (collective); returns the loss or None.

        Args:
            closure: re-evaluates the model and returns the loss, run first as ``torch.optim`` does (default None).
            grad_scaler: passed by ``torch.amp.GradScaler.step(zero)``: ranks skip alike (``amp.py``; default None).
            **kwargs: passed to the local optimizer's ``step``.

        Raises:
            ValueError: on every rank, when a rank raised (naming it), settings differ or a dtype or device changed.
            RuntimeError: in overlap mode, when no hook stepped since the last ``step()``.
        """
        if self.overlap_stepper is not None:  # the DDP comm hook stepped during backward: only confirm it did
            return self.overlap_stepper.explicit_step(closure, grad_scaler, kwargs)
        self.joins.notify(self)
        return self._step(closure, kwargs, grad_scaler)

    def _step(
        self, closure: Callable[[], float] | None, kwargs: dict[str, Any], grad_scaler: Any, joined: bool = False
    ) -> float | None:
        """``step()`` past the overlap mode and Join's notice; ``joined``: a joined rank's, run by Join's hook."""
        self._stepped()  # a consolidated state is stale from here: a step that raises may have moved the shards
        self.land_sync()
        try:  # 1. the local part on every rank (SDP under a GradScaler: all but the local step), agreed
            (loss, verdict), scaled, found_inf, flags = self._agreed_step(
                lambda: self._prepare(closure, kwargs, grad_scaler, hold=joined),
                (lambda: self._step_local(kwargs)) if joined else None,
                grad_scaler is not None,
            )
            if self._gradient_source is not None:  # 1b. which parameters some rank used; then the ranks that held
                self._gradient_source.agreed(flags[:-1], scaled=grad_scaler is not None)  # back their local part
                if flags[-1]:
                    (_, verdict), scaled, found_inf, _ = self._agreed_step(
                        lambda: (
                            None,
                            self._attach_and_step(kwargs, grad_scaler) if self._held_back else verdict,
                        ),
                        scaler=grad_scaler is not None,
                    )
            if verdict is not None:
                verdict.record(found_inf)
            if scaled and not found_inf:  # 2. a GradScaler's step (SDP's) where no rank's owned gradient held one
                waits = verdict is not None and not verdict.step_now
                repartitioning.agreed(self, lambda: self._step_local(kwargs) if waits else None)
        finally:
            self.local_shard.detach_grads()  # no stale gradient piece outlives the step
        self.sync_parameters()  # 3. every rank's updated shard to every rank
        return loss

    def _stepped(self) -> None:
        """At each step's start (one that raises may move the shards) and the DDP hook's: a consolidation is stale."""
        self.placer.consolidated = None

    def _prepare(
        self, closure: Callable[[], float] | None, kwargs: dict[str, Any], grad_scaler: Any, hold: bool = False
    ) -> stepping.Prepared:
        """Everything a step does locally (with a ``grad_scaler``, or ``hold`` under Join: all but the local step)."""
        self._held_back = False
        try:  # inside the agreement: every rank raises if one does
            if self._gradient_source is not None:
                self._gradient_source.check_finished()
            self.local_shard.check_synced()  # the last step raised after this rank's local step: not to be retried
            (placer := self.placer).sync.check_untouched()  # the sync step() finished first overwrote no user write
            check_classes_unchanged(self.param_groups, self.local_optimizer, placer.optimizer_class)
            check_eps_from_first_dtype(self.param_groups, placer.optimizer_class, self.master_dtype)  # loads, edits
            if (formats := getattr(self.local_optimizer, "formats", None)) is not None:  # before the step: no mark
                formats.check_unchanged(self.param_groups)
        except Exception:
            if closure is not None:  # the others run it (its backward's collectives) before they hear of this,
                self._closure_as_the_others(closure)  # placed again first as they are (fuzz seed 763022)
            raise
        self.placer.repartition_if_changed()
        loss: float | None = None
        if closure is not None:  # torch.optim's order, its backward first: an error there updated nothing
            with torch.enable_grad():
                loss = closure()
            self.local_shard.reseed_masters()  # what it wrote into the parameters (a constraint) is stepped from
        validation.check_unowned_have_no_grad(self.placer.placed.unowned)
        self.placer.push_hyperparameters()
        if self._gradient_source is not None and not self._gradient_source.prepare_step():
            self._held_back = True  # this rank cannot tell yet which of its parameters some rank used: step 1b
            return loss, None
        return loss, self._attach_and_step(kwargs, grad_scaler, hold)

    def _closure_as_the_others(self, closure: Callable[[], float]) -> None:
        """Run the closure of a rank whose checks raised over the placement the others make, so its backward matches."""
        try:
            self.placer.repartition_if_changed()
        except Exception:
            return  # this rank's own error is the one raised
        with torch.enable_grad():
            closure()

    def _attach_and_step(self, kwargs: dict[str, Any], grad_scaler: Any, hold: bool = False) -> amp.Verdict | None:
        """Attach the gradients, check and unscale them under a scaler; step unless the scaler skips or ``hold``."""
        shard, source = self.local_shard, self._gradient_source
        whole = self._whole_grads()  # before any store piece is in .grad
        shard.attach_grads()
        held = lambda: amp.once_each([p.grad for p in whole if p.grad is not None], shard.source_grads())
        alike = source is None and not self.joins.open  # DDP's .grad: each rank decides on the same values
        summed = None if source is None else source.overflow_found(grad_scaler is not None)
        summed = None if whole else summed  # .grad set by hand (alike everywhere, or refused): checked where stepped
        verdict = amp.check_and_unscale(grad_scaler, self, shard.step_grads, source is not None, held, alike, summed)
        if (verdict is None or verdict.step_now) and not hold:
            self._step_local(kwargs)
        return verdict

    def _whole_grads(self) -> list[Tensor]:
        """The parameters whose ``.grad`` clipping and a scaler scale whole: all under DDP, else those set by hand."""
        return self.global_params if self._gradient_source is None else self._gradient_source.hand_set()

    def _step_local(self, kwargs: dict[str, Any]) -> None:
        stepping.step_local_optimizer(self.local_optimizer, self.local_shard, self.param_groups, kwargs)

    def _agreed_step(
        self,
        action: Callable[[], stepping.Prepared],
        joined_step: Callable[[], object] | None = None,
        scaler: bool = False,
    ) -> tuple[stepping.Prepared, bool, bool, tuple[bool, ...]]:
        count = 0 if self._gradient_source is None else len(self.global_params) + 1

        def store_flags(done: stepping.Prepared | None) -> tuple[bool, ...]:  # the parameters used; a held-back part
            source = self._gradient_source
            return (False,) * count if done is None or source is None else (*source.used, self._held_back)

        groups = self.agreement_groups
        return stepping.agreed_step(action, self.placer.fingerprint, groups, joined_step, store_flags, scaler)

    def agreed_after_placing(self, action: Callable[[], Any] = lambda: None) -> Any:
        """Place again where stale, then run ``action``, agreed across ranks (the DDP hooks' step); returns its result.

        Args:
            action: what to run after placing (default: nothing).

        Raises:
            ValueError: on every rank, if placing or ``action`` raised on any rank or the ranks' settings differ.
        """

        def place_then_act() -> Any:
            if self.overlap_stepper is not None:
                self.overlap_stepper.check_formats()
            self.placer.repartition_if_changed()
            validation.check_unowned_have_no_grad(self.placer.placed.unowned)  # as step() does
            return action()

        return repartitioning.agreed(self, place_then_act)

    def sync_parameters(self) -> None:
        """Bring every rank's updated shard to every rank (collective; ``step()`` ends with it)."""
        self.placer.sync.sync_parameters()
        self.local_shard.unsynced = False

    def sync_finished(self) -> None:
        """Wait for any parameter sync still in flight (local); raises if a parameter was written meanwhile."""
        self.land_sync()
        self.placer.sync.check_untouched_here()

    def land_sync(self) -> None:
        """``sync_finished`` without its local check (an agreement follows: the next step, a checkpoint)."""
        self.placer.sync.finish()

    @property
    def gradient_source(self) -> stepping.GradientSource | None:
        """Where the step reads the gradient instead of ``.grad`` (``attach_gradient_source``), or None."""
        return self._gradient_source

    @property
    def placed_sync(self) -> ParameterSync:
        """The parameter sync the current placement built (a gradient source's ``sync`` wraps it)."""
        return self.placer.placed.sync

    def attach_gradient_source(self, source: stepping.GradientSource) -> None:
        """Read the gradient from ``source`` (``ShardedDataParallel``), not ``.grad``, and sync through its ``sync``.

        Args:
            source: the gradient's one owner (``stepping.GradientSource``).
        """
        self._gradient_source, self.local_shard.source, self.placer.sync = source, source.grad_of, source.sync
        if source.replanned not in self.placer.listeners:
            self.placer.listeners.append(source.replanned)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """Once this rank runs out of inputs, step its shard with its ``.grad`` as it stands, as torch's ZeRO does.

        Args:
            **kwargs: ``Join``'s keyword arguments (none are used).

        Raises:
            NotImplementedError: under ``ShardedDataParallel`` or hybrid sharding, on every rank as ``Join`` is built.
        """
        return self.joins.add(join.hook(self, lambda: self._step(None, {}, None, joined=True)))

    @property
    def join_device(self) -> torch.device:
        """The device of Join's own collectives: the parameters' (asked of the first joinable: refused as that)."""
        self.joins.check_not_first(self)
        return self.global_params[0].device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """The group of Join's own collectives: the one ZeRO shards over."""
        return self.process_group

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False, *, grad_scale: Any = None
    ) -> Tensor:
        """Clip the whole gradient as ``torch.nn.utils.clip_grad_norm_`` does (collective); returns the total norm.

        Args:
            max_norm: the largest total norm the gradient may have.
            norm_type: the order of the norm (default 2.0; ``math.inf`` for the largest element).
            error_if_nonfinite: raise when the total norm is inf or nan (default False, as torch's).
            grad_scale: the loss scale the gradients still carry where ``scaler.unscale_(zero)`` cannot run (fp16
                gradients, ``ShardedDataParallel``): the norm and the clipping are the unscaled ones (default None).

        Raises:
            RuntimeError: a non-finite norm with ``error_if_nonfinite`` (on every rank), or in overlap mode.
        """
        if self.overlap_stepper is not None:
            raise RuntimeError(clipping.IN_OVERLAP_MODE)
        if self._gradient_source is not None:  # (a re-placement rebuilds the store: a raised backward's state first)
            self._gradient_source.check_finished()
        self.placer.repartition_if_changed(refusal_deferred=True)  # a newly trainable parameter needs an owner
        if self._gradient_source is not None:  # every rank alike: which parameters some rank used (those placed now)
            self._gradient_source.ready()
        shard, group, device = self.local_shard, self.process_group, self.placer.comm_device
        whole = self._whole_grads()
        return clipping.clip_shard(shard, whole, max_norm, norm_type, error_if_nonfinite, group, device, grad_scale)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of all parameters, owned or not (and ``ShardedDataParallel``'s owned gradient).

        Args:
            set_to_none: set each ``.grad`` to None rather than to zeros (default True, as torch's).

        Raises:
            RuntimeError: in overlap mode, when gradients arrived but no hook stepped (the hook is missing).
        """
        if self.overlap_stepper is not None:
            self.overlap_stepper.check_stepped()
        if self._gradient_source is not None:
            self._gradient_source.clear(set_to_none)
        super().zero_grad(set_to_none)
        if self.overlap_stepper is not None:
            self.overlap_stepper.record_grads()
