"""A ZeroRedundancyOptimizer's checkpoints, in ``torch.optim``'s format (``checkpoint/consolidated.py``) and DCP's."""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable, Collection
from typing import Any, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from distoptim.checkpoint import consolidated as checkpoint
from distoptim.checkpoint import dcp_state as sharded
from distoptim.comm.objects import all_gather_objects
from distoptim.zero.local_optimizer import CLASS_KEY
from distoptim.zero.partition import UNOWNED
from distoptim.zero.repartitioning import ZeroParts, agreed
from distoptim.zero.shard import MASTER_KEY, MASTERS_IGNORED, has_master, stitch
from distoptim.zero.state_formats import decoded, is_trained

__all__ = ["Checkpoints"]


class Checkpoints:
    """ZeroRedundancyOptimizer's checkpoint methods (a base class of it: ``self`` is the optimizer)."""

    def consolidate_state_dict(self: ZeroParts, to: int = 0) -> None:
        """Gather every rank's shard onto rank ``to``, on its CPU (collective; only ``to`` receives anything).

        Args:
            to: the group rank that receives the whole state (default 0).

        Raises:
            ValueError: on every rank, for a bad or differing ``to`` (TypeError: not an int), a changed dtype or device.
        """
        checkpoint.agree_on_target(to, self.world_size, self.process_group)
        _ready_to_read(self, lambda: self.local_shard.check_synced())
        mine = self.local_shard.global_state(decoded(self.local_optimizer.state))  # torch.optim's format: decoded
        merged = checkpoint.gather_state(mine, to, self.process_group, self.placer.comm_device)
        if merged is not None:
            merged = stitch(merged, self.global_params)
            merged.update(_made_at_construction(self, merged.keys() | self.placer.kept_unowned.keys()))
            merged.update((i, _on_cpu(entry)) for i, entry in self.placer.kept_unowned.items() if i not in merged)
        self.placer.consolidated = None if merged is None else dict(sorted(merged.items()))

    def state_dict(self: ZeroParts) -> dict[str, Any]:
        """The whole optimizer state in ``torch.optim``'s format, on the rank that consolidated it (with its hooks).

        Raises:
            RuntimeError: this rank holds no consolidated state (``consolidate_state_dict(to=this rank)`` first).
        """
        torch_self = cast(Optimizer, self)
        for pre_hook in torch_self._optimizer_state_dict_pre_hooks.values():
            pre_hook(torch_self)
        consolidated = self.placer.consolidated
        if consolidated is None:
            raise RuntimeError(
                "Optimizer state has not been consolidated on this rank. Please call "
                f"`consolidate_state_dict(to={self.rank})` on all ranks beforehand if you meant to save the global "
                f"state (rank {self.rank} holds no consolidated optimizer state: consolidate after the last step)"
            )
        result = {"state": dict(consolidated), "param_groups": checkpoint.saved_param_groups(self.param_groups)}
        return checkpoint.apply_hooks(torch_self._optimizer_state_dict_post_hooks.values(), self, result)

    def load_state_dict(self: ZeroParts, state_dict: dict[str, Any]) -> None:
        """Load a global (``torch.optim``-format) dict on every rank, each keeping its shard's state, with its hooks.

        Args:
            state_dict: what ``state_dict()`` returned (or a plain ``torch.optim`` optimizer's), at any world size.

        Raises:
            ValueError: on every rank, for a dict of another class or parameters, a changed dtype or device, or
                trained state of an unowned frozen parameter.
        """
        self.land_sync()  # the load may write master weights into the parameters
        agreed(self, self.placer.place_if_stale)  # master weights go into the parameters' present storage
        state_dict = state_dict.copy() if isinstance(state_dict, dict) else state_dict
        torch_self = cast(Optimizer, self)
        state_dict = checkpoint.apply_hooks(torch_self._optimizer_load_state_dict_pre_hooks.values(), self, state_dict)
        by_param, hyperparameters = checkpoint.select_shard_on_every_rank(
            state_dict, self.param_groups, self.placer.optimizer_class, self.process_group
        )
        _refuse_stranded_state(self, _trained_in(self, by_param), "load_state_dict")
        _keep_unowned(self, by_param)
        for group, saved in zip(self.param_groups, hyperparameters):
            group.update(saved)
        local_state = self.local_shard.local_state(by_param)
        self.placer.push_hyperparameters()
        local_groups = checkpoint.global_param_groups(self.local_optimizer.param_groups)
        self.local_optimizer.load_state_dict({"state": local_state, "param_groups": local_groups})
        self.placer.consolidated = None
        self.local_shard.unsynced = False  # resumed: a step may follow (LocalShard.check_synced)
        for post_hook in torch_self._optimizer_load_state_dict_post_hooks.values():
            post_hook(torch_self)

    def sharded_state_dict(self: ZeroParts) -> dict[str, Any]:
        """This rank's fragments of the state and the hyperparameters, for DCP or ``distoptim.checkpoint`` (collective).

        Raises:
            ValueError: on every rank, when the parameters' dtype or device changed since construction.
        """
        placeholders = _ready_to_read(  # inside its agreement: a placeholder step raising on some rank raises on all
            self,
            lambda: sharded.template_state(self.local_shard, self.local_optimizer.step, self.local_optimizer.state),
        )
        shard, state = self.local_shard, self.local_optimizer.state
        formats = getattr(self.local_optimizer, "formats", None)
        state = state if formats is None else formats.as_kept(state)  # the keys a step gives, before one ran too
        groups = pickle.dumps(_naming_saved(self, checkpoint.saved_param_groups(self.param_groups), state))
        return sharded.sharded_state(shard, state, placeholders, groups, self.global_params)

    def load_sharded_state_dict(self: ZeroParts, state_dict: dict[str, Any]) -> None:
        """Finish a load into ``sharded_state_dict()``'s dict (the state was loaded in place).

        Args:
            state_dict: the dict ``sharded_state_dict()`` returned, after ``dcp.load`` / ``checkpoint.load``.

        Raises:
            ValueError: on every rank, when the dict is not a loaded sharded state, was saved for other parameters or
                class, holds state keys the hyperparameters do not make, or the parameters' dtype or device changed.
        """
        self.land_sync()

        def place_and_check() -> list[dict[str, Any]]:  # write_back below writes into the pieces the placement holds
            self.placer.place_if_stale()
            saved = sharded.load_param_groups(state_dict, self.param_groups, self.placer.optimizer_class)
            sharded.check_state_keys(self.local_shard, saved, self.param_groups, state_dict)
            return saved

        saved_groups = agreed(self, place_and_check)  # a key the template lacks refused on every rank alike
        trained = {index for saved in saved_groups for index in saved.pop(sharded.TRAINED, ())}  # none in older saves
        mastered = {
            i for saved in saved_groups for i in (saved.pop(sharded.STATE_KEYS, None) or {}).get(MASTER_KEY, ())
        }
        _refuse_stranded_state(self, trained, "load_sharded_state_dict")
        if any(not has_master(self.global_params[i].dtype, self.master_dtype) for i in mastered):
            warnings.warn(MASTERS_IGNORED, stacklevel=2)  # as a consolidated load warns (LocalShard.local_state)
        for group, saved in zip(self.param_groups, saved_groups):
            group.update(saved)
        self.placer.push_hyperparameters()
        sharded.install_loaded(self.local_shard, self.local_optimizer.state, state_dict)
        _made_again(self)
        self.placer.kept_unowned.clear()  # a sharded save holds no state for them: they have what this optimizer made
        self.local_shard.write_back()
        self.placer.consolidated = None
        self.local_shard.unsynced = False  # resumed: a step may follow (LocalShard.check_synced)


def _made_at_construction(zero: ZeroParts, present: Collection[int]) -> dict[int, dict[str, Tensor]]:
    """The construction state (Adagrad's ``sum``) torch's holds for the constructor's parameters not in ``present``."""
    made: dict[int, dict[str, Tensor]] = {}
    index = 0
    for group in zero.param_groups:
        missing = {
            index + i: p
            for i, p in enumerate(group["params"])
            if index + i not in present and index + i < zero.placer.first_added
        }
        index += len(group["params"])
        if not missing:
            continue
        masters = zero.master_dtype  # the class steps the master copies: its state is made for them
        made_over = [
            p.detach().to(masters or p.dtype) if has_master(p.dtype, masters) else p.detach() for p in missing.values()
        ]
        made.update((i, entry) for i, entry in zip(missing, _made_for(zero, group, made_over)) if entry is not None)
    return made


def _made_again(zero: ZeroParts) -> None:
    """Encoded entries loaded at step 0 made again as the class makes them (plain until a first step encodes them):
    a sharded save encodes them, rounding Adagrad's ``sum``, so that its keys do not depend on whether a step ran."""
    state = zero.local_optimizer.state
    for group, pieces in zip(zero.param_groups, zero.local_shard.groups):
        loaded = [
            t
            for t in pieces
            if not is_trained(e := state.get(t.tensor)) and any(k.endswith((".bf16", ".int8")) for k in e or ())
        ]
        if not loaded:
            continue
        for local, made in zip(loaded, _made_for(zero, group, [t.tensor.detach() for t in loaded])):
            state[local.tensor] = dict(made or {})


def _made_for(zero: ZeroParts, group: dict[str, Any], tensors: list[Tensor]) -> list[dict[str, Any] | None]:
    """The state ``group``'s class (and settings) makes at construction for each of ``tensors`` (None: none)."""
    settings = {key: value for key, value in group.items() if key not in ("params", CLASS_KEY)}
    optimizer_class = group.get(CLASS_KEY, zero.placer.optimizer_class)
    defaults = zero.placer.defaults if optimizer_class is zero.placer.optimizer_class else {}
    fresh = cast(torch.optim.Optimizer, optimizer_class([{"params": tensors, **settings}], **defaults))
    return [fresh.state.get(p) for p in fresh.param_groups[0]["params"]]


def _on_cpu(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().to("cpu", copy=True) if isinstance(v, Tensor) else v for k, v in entry.items()}


def _trained_in(zero: ZeroParts, by_param: dict[Tensor, dict[str, Any]]) -> set[int]:
    """The parameters no rank owns whose loaded state differs from what the class makes at construction."""
    params, owners = zero.global_params, zero.plan.owners
    trained = {i for i, param in enumerate(params) if owners[i] == UNOWNED and is_trained(by_param.get(param))}
    made = _made_at_construction(zero, set(range(len(params))) - trained) if trained else {}
    return {index for index in trained if not _same_state(by_param[params[index]], made.get(index, {}))}


def _naming_saved(
    zero: ZeroParts, groups: list[dict[str, Any]], state: dict[Tensor, dict[str, Any]]
) -> list[dict[str, Any]]:
    """The groups naming their parameters trained on some rank, and the keys saved for them (what a load may drop)."""
    trained = [t.index for t in zero.local_shard.locals if is_trained(zero.local_optimizer.state.get(t.tensor))]
    mine = (trained, sharded.held_keys(zero.local_shard, state), zero.local_shard.unsynced)
    everyone = all_gather_objects(mine, zero.process_group, zero.placer.comm_device)
    anywhere = {index for indices, _, _ in everyone for index in indices}
    held: dict[int, set[str]] = {}
    for _, keys, _ in everyone:
        for index, names in keys.items():
            held.setdefault(index, set()).update(names)
    apart = any(unsynced for _, _, unsynced in everyone)
    if zero.replicate_group is not None:  # DCP keeps one shard group's groups: each must say it
        apart = any(all_gather_objects(apart, zero.replicate_group, zero.placer.comm_device))
    return [
        {
            **group,
            sharded.TRAINED: [i for i in group["params"] if i in anywhere],
            sharded.STATE_KEYS: sharded.keys_by_name(group["params"], held),
            **({sharded.APART: True} if apart else {}),  # a load refuses it
        }
        for group in groups
    ]


def _keep_unowned(zero: ZeroParts, by_param: dict[Tensor, dict[str, Any]]) -> None:
    """Keep copies of the loaded entries of parameters no rank owns, as torch's does, until a placement owns them."""
    kept, owners = zero.placer.kept_unowned, zero.plan.owners
    kept.clear()
    kept.update(
        (index, {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in entry.items() if k != MASTER_KEY})
        for index, param in enumerate(zero.global_params)
        if owners[index] == UNOWNED and param.numel() and (entry := by_param.get(param))
    )


def _refuse_stranded_state(zero: ZeroParts, trained: Collection[int], method: str) -> None:
    """Refuse trained state of a parameter frozen when placed: no rank owns it, so the state would be dropped."""
    params, owners = zero.global_params, zero.plan.owners
    stranded = sorted(i for i in trained if owners[i] == UNOWNED and params[i].numel())  # zero-sized: no state kept
    if stranded:
        raise ValueError(
            f"{method}: parameter {stranded[0]} has optimizer state from training, but it had requires_grad=False "
            "when this ZeroRedundancyOptimizer placed it, so no rank owns it and its state would be dropped: set "
            "requires_grad=True on it (on every rank) before loading and freeze it after"
        )


def _same_state(loaded: dict[str, Any], made: dict[str, Any]) -> bool:
    return loaded.keys() == made.keys() and all(_same_value(value, made[key]) for key, value in loaded.items())


def _same_value(value: Any, fresh: Any) -> bool:
    if not isinstance(fresh, Tensor) or not isinstance(value, Tensor):
        return isinstance(fresh, Tensor) == isinstance(value, Tensor) and bool(value == fresh)
    return value.shape == fresh.shape and torch.equal(value.to(fresh.device, fresh.dtype), fresh)


def _ready_to_read(zero: ZeroParts, then: Callable[[], Any] = lambda: None) -> Any:
    """Land the sync (refusing writes made during it), place again where stale, then run ``then``, all agreed."""
    zero.land_sync()
    if zero.placer.sync.watches_writes:  # the same on every rank
        agreed(zero, zero.placer.sync.check_untouched)

    def place_then() -> Any:
        zero.placer.repartition_if_changed()
        return then()

    return agreed(zero, place_then)
