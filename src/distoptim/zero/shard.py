"""This rank's shard as its local optimizer sees it: one tensor per owned fragment (the parameter, a 1-D view, or a
master copy), and its state in global form (a partial fragment's keyed ``(index, offset)`` until ``stitch``)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from distoptim._flat import copy_each_, flat_view
from distoptim.zero.partition import PartitionPlan

__all__ = [
    "MASTERS_IGNORED",
    "MASTER_KEY",
    "LocalShard",
    "LocalTensor",
    "complete_hyperparameters",
    "copy_hyperparameters",
    "has_master",
    "stitch",
]

MASTER_KEY = "master_weight"
MASTERS_IGNORED = (
    "the checkpoint carries master weights but this optimizer keeps none (master_dtype=None): they are ignored and "
    "the parameters stay as they are; build the optimizer with the saving run's master_dtype to keep them"
)
UNSYNCED = (
    "ZeroRedundancyOptimizer: the last step raised after this rank's local optimizer began to step its shard and "
    "before the parameters were synced, so the ranks' parameters and optimizer states are apart: a retry would step "
    "the shard twice, and a checkpoint of them cannot be trusted. Resume from an earlier checkpoint: load the model's "
    "parameters and zero.load_state_dict(...)"
)
GLOBAL_ONLY = frozenset({"params", "param_names"})  # not hyperparameters: the local groups do not carry them


@dataclass(frozen=True)
class LocalTensor:
    """Elements ``[offset, offset + length)`` of global parameter ``index``, stepped as ``tensor`` (maybe a master)."""

    index: int
    param: Tensor
    offset: int
    length: int
    tensor: Tensor
    master: bool = False

    @property
    def whole(self) -> bool:
        return self.offset == 0 and self.length == self.param.numel()

    def grad_from(self, grad: Tensor | None) -> Tensor | None:
        """This piece of a gradient of the whole parameter (None stays None), in the parameter's dtype."""
        return grad if grad is None or self.whole else fragment_of(grad, self.param, self.offset, self.length)

    def grad_for_step(self, grad: Tensor | None) -> Tensor | None:
        """This piece of ``grad`` as the local optimizer steps it: upcast to the master's dtype for a master copy."""
        piece = self.grad_from(grad)
        return piece.to(self.tensor.dtype) if self.master and piece is not None else piece

    def param_piece(self) -> Tensor:
        """The parameter's elements this tensor stands for (a view)."""
        param = self.param.detach()
        return param if self.whole else flat_view(param)[self.offset : self.offset + self.length]


def copy_hyperparameters(sources: Sequence[dict[str, Any]], targets: Sequence[dict[str, Any]]) -> None:
    """Every setting but ``params`` (and names) of each source param group into the matching target group."""
    for source, target in zip(sources, targets):
        target.update((k, v) for k, v in source.items() if k not in GLOBAL_ONLY)


def complete_hyperparameters(targets: Sequence[dict[str, Any]], sources: Sequence[dict[str, Any]]) -> None:
    """Give each global (``targets``) group the settings only the local optimizer's defaults filled in."""
    for source, target in zip(sources, targets):
        target.update((k, v) for k, v in source.items() if k != "params" and k not in target)


def fragment_of(tensor: Tensor, param: Tensor, offset: int, length: int) -> Tensor:
    """Elements ``[offset, offset + length)`` of ``tensor`` in ``param``'s memory order (a view when laid out alike)."""
    if tensor.stride() != param.stride():
        tensor = torch.empty_like(param, dtype=tensor.dtype, device=tensor.device).copy_(tensor)
    return flat_view(tensor)[offset : offset + length]


class LocalShard:
    """The local tensors of one rank for one partition plan, grouped like the global param groups."""

    def __init__(
        self,
        plan: PartitionPlan,
        param_groups: Sequence[dict[str, Any]],
        rank: int,
        master_dtype: torch.dtype | None = None,
    ) -> None:
        self.groups: list[list[LocalTensor]] = []
        self.master_dtype = master_dtype
        index = 0
        for group in param_groups:
            local: list[LocalTensor] = []
            for param in group["params"]:
                for fragment in plan.fragments[index]:
                    if fragment.rank == rank:
                        local.append(_local_tensor(index, param, fragment.offset, fragment.length, master_dtype))
                index += 1
            self.groups.append(local)
        self.locals = [t for group in self.groups for t in group]
        self.detached = [t for t in self.locals if t.tensor is not t.param]  # needs .grad given
        self.masters = [t for t in self.detached if t.master]
        self.source: Callable[[LocalTensor], Tensor | None] | None = None  # a gradient store (ShardedDataParallel's)
        self.unsynced = False  # stepped since the parameters were last synced (set by step_local_optimizer)
        self._given_back: list[tuple[Tensor, Tensor | None]] = []  # a whole parameter's .grad during a step
        self._attached: list[Tensor] = []  # the source's pieces during a step, as it holds them
        self._masters_into = [t.param if t.whole else t.param_piece() for t in self.masters]
        self._masters_from = [t.tensor for t in self.masters]
        params = [p for group in param_groups for p in group["params"]]  # those an even partition cuts, by index:
        self._cut = [(i, p) for i, (p, pieces) in enumerate(zip(params, plan.fragments)) if len(pieces) > 1]

    def param_groups(self, global_groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """The local optimizer's param groups: each global group's settings over this rank's tensors of it."""
        return [
            {**{k: v for k, v in group.items() if k not in GLOBAL_ONLY}, "params": [t.tensor for t in local]}
            for group, local in zip(global_groups, self.groups)
        ]

    def check_synced(self) -> None:
        """Refuse, until a resume, what a shard stepped since the last sync makes wrong: a retry, a checkpoint."""
        if self.unsynced:
            raise RuntimeError(UNSYNCED)

    def attach_grads(self) -> None:
        """Give every fragment view and master copy its piece of the gradient (every tensor, from a ``source``)."""
        if self.source is not None:
            self._given_back = [(t.param, t.param.grad) for t in self.locals if t.tensor is t.param]
            pieces = [self.source(local) for local in self.locals]  # all read before any whole .grad is replaced
            self._attached = [piece for piece in pieces if piece is not None]
            for local, piece in zip(self.locals, pieces):
                local.tensor.grad = None if piece is None else piece.to(local.tensor.dtype)
            return
        self._align_grads()
        for local in self.detached:
            local.tensor.grad = local.grad_for_step(local.param.grad)

    def detach_grads(self) -> None:
        """Drop the pieces again, so that no stale gradient outlives ``zero_grad``."""
        for local in self.detached if self.source is None else self.locals:
            local.tensor.grad = None
        for param, grad in self._given_back:  # what .grad held before the step (a source's marker, or the user's)
            param.grad = grad
        self._given_back, self._attached = [], []

    def write_back(self) -> None:
        """Round every master copy into its parameter (after a step)."""
        copy_each_(self._masters_into, self._masters_from)

    def reseed_masters(self) -> None:
        """Re-seed every master copy whose parameter piece was written outside the optimizer: bits, not ``_version``,
        decide (``.data`` writes), on the device (no host read)."""
        with torch.no_grad():
            for into, master in zip(self._masters_into, self._masters_from):
                written = torch.ne(_bits(into), _bits(master.to(into.dtype))).any()
                torch.where(written, into, master, out=master)

    def source_grads(self) -> list[Tensor]:
        """The source's pieces of the gradient as it holds them (before any upcast), after ``attach_grads``."""
        return list(self._attached)

    def step_grads(self) -> list[Tensor]:
        """The gradients the local optimizer is about to step with (after ``attach_grads``)."""
        return [grad for grad in (t.tensor.grad for t in self.locals) if grad is not None]

    def owned_grads(self) -> list[Tensor]:
        """This rank's pieces of the gradient (views where the layouts agree), for clipping."""
        if self.source is not None:
            return [grad for grad in map(self.source, self.locals) if grad is not None]
        self._align_grads()
        pieces = (t.grad_from(t.param.grad) for t in self.locals)
        return [grad for grad in pieces if grad is not None]

    def _align_grads(self) -> None:
        """Lay out any gradient unlike its split parameter like it, so that its pieces are views of ``.grad``."""
        _refuse_sparse_gradients(self._cut)
        for local in self.detached:
            grad = local.param.grad
            if not local.whole and grad is not None and grad.stride() != local.param.stride():
                local.param.grad = torch.empty_like(local.param).copy_(grad)

    def global_state(self, state: dict[Tensor, dict[str, Any]]) -> dict[Any, dict[str, Any]]:
        """The local optimizer's ``state`` keyed by index (``(index, offset)`` when partial), masters included."""
        exported = {}
        for local in self.locals:
            entry = dict(state.get(local.tensor, {}))
            if local.master:
                entry[MASTER_KEY] = local.tensor.detach()
            if entry:
                exported[local.index if local.whole else (local.index, local.offset)] = entry
        return exported

    def local_state(self, by_param: dict[Tensor, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """Saved whole-parameter entries cut to this shard (copies), keyed by position in the local optimizer; master
        weights are loaded into the master copies here (a missing one is taken from its parameter)."""
        entries = {i: slice_entry(by_param[t.param], t) for i, t in enumerate(self.locals) if t.param in by_param}
        missing = []
        for position, local in enumerate(self.locals):
            saved = entries.get(position, {}).pop(MASTER_KEY, None)
            if not local.master:
                continue
            if saved is None:
                missing.append(local.index)
                saved = local.param_piece()
            with torch.no_grad():
                local.tensor.copy_(saved)
        if missing:
            warnings.warn(
                f"the state dict has no master weights for parameters {sorted(set(missing))[:5]}; their master copies "
                "start from the (rounded) parameters, so the run does not continue bit for bit",
                stacklevel=3,
            )
        if any(MASTER_KEY in entry and not has_master(p.dtype, self.master_dtype) for p, entry in by_param.items()):
            warnings.warn(MASTERS_IGNORED, stacklevel=3)  # by_param is global: the same verdict on every rank
        return entries

    def move_state(self, state: dict[Tensor, Any], previous: LocalShard | None) -> None:
        """Re-key ``state`` from ``previous``'s tensors to this shard's (same fragment: same state), masters kept."""
        if previous is None:
            return
        now = {(t.index, t.offset, t.length): t for t in self.locals}
        for old in previous.locals:
            entry = state.pop(old.tensor, None)
            new = now.get((old.index, old.offset, old.length))
            if new is None:
                continue
            if entry is not None:
                state[new.tensor] = entry
            if old.master and new.master:
                with torch.no_grad():
                    new.tensor.copy_(old.tensor)


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _refuse_sparse_gradients(cut: Sequence[tuple[int, Tensor]]) -> None:
    """An even partition cuts parameters, which a sparse gradient cannot be (refused inside the step's agreement)."""
    sparse = [(index, param) for index, param in cut if param.grad is not None and param.grad.is_sparse]
    if sparse:
        (index, param), *_ = sparse
        raise ValueError(
            f"partition='even' cuts parameters into pieces, and a sparse gradient cannot be cut: parameter {index} "
            f"(shape {tuple(param.shape)}) has one (nn.Embedding or nn.EmbeddingBag with sparse=True). "
            "Use partition='greedy' (each parameter stepped whole by one rank, its sparse gradient as torch.optim "
            "steps it), or build the embedding with sparse=False"
        )


def _bits(tensor: Tensor) -> Tensor:
    return tensor.view(_BITS[tensor.element_size()])


def has_master(dtype: torch.dtype, master_dtype: torch.dtype | None) -> bool:
    """Whether a parameter of ``dtype`` is stepped through a master copy: only a narrower floating-point one."""
    return master_dtype is not None and dtype.is_floating_point and dtype.itemsize < master_dtype.itemsize


def _local_tensor(index: int, param: Tensor, offset: int, length: int, master_dtype: torch.dtype | None) -> LocalTensor:
    whole = offset == 0 and length == param.numel()
    piece = param.detach() if whole else flat_view(param)[offset : offset + length]
    if has_master(param.dtype, master_dtype):
        copy = torch.empty_like(piece, dtype=master_dtype).copy_(piece)
        return LocalTensor(index, param, offset, length, copy, master=True)
    return LocalTensor(index, param, offset, length, param if whole else piece)


def stitch(state: dict[Any, dict[str, Any]], params: Sequence[Tensor]) -> dict[int, dict[str, Any]]:
    """Merge partial fragments' entries (keyed ``(index, offset)``) into whole-parameter entries keyed ``index``: a
    1-D tensor is the fragment's piece of a parameter-shaped one; anything else (a step count) is taken once."""
    merged: dict[int, dict[str, Any]] = {key: entry for key, entry in state.items() if isinstance(key, int)}
    for (index, offset), entry in sorted((k, v) for k, v in state.items() if isinstance(k, tuple)):
        whole = merged.setdefault(index, {})
        param = params[index]
        for name, value in entry.items():
            if not (isinstance(value, Tensor) and value.dim() == 1):
                whole.setdefault(name, value)
                continue
            if name not in whole:
                whole[name] = torch.empty_like(param, dtype=value.dtype, device=value.device)
            flat_view(whole[name])[offset : offset + value.numel()].copy_(value)
    return merged


def slice_entry(entry: dict[str, Any], local: LocalTensor) -> dict[str, Any]:
    """A saved whole-parameter entry cut to ``local``'s fragment (copies, never aliases of the caller's dict)."""
    if local.whole:
        return {k: v.clone() if isinstance(v, Tensor) else v for k, v in entry.items()}
    return {
        k: fragment_of(v, local.param, local.offset, local.length).clone()
        if isinstance(v, Tensor) and v.shape == local.param.shape and v.dim() > 0
        else (v.clone() if isinstance(v, Tensor) else v)
        for k, v in entry.items()
    }
