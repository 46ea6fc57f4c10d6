"""DistributedOptimizer: each owner's ``LocalOptimizer`` (``rpc/owner.py``) is handed a distributed-autograd
context's gradients by ``step(context_id)``, nothing parked in ``.grad`` (``docs/guides/rpc.md``)."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import Tensor
from torch.distributed.rpc import PyRRef  # what rpc.remote returns; rpc.RRef subclasses it for annotations only
from torch.optim import Optimizer

from distoptim.functional.optimizers import registered_functional_optim
from distoptim.rpc import owner as on_owner

__all__ = ["DistributedOptimizer"]


@dataclass
class _Owner:
    name: str
    indices: list[int]  # positions in params_rref of the parameters this worker owns
    local: PyRRef[on_owner.LocalOptimizer]  # RRef to its LocalOptimizer


def _on_owners(calls: Iterable[tuple[str, Callable[..., Any], tuple[Any, ...]]]) -> list[Any]:
    """Run ``function(*args)`` on every named worker concurrently; wait for all, then raise the first failure."""
    futures = [rpc.rpc_async(name, on_owner.invoke, args=(function, *args)) for name, function, args in calls]
    outcomes: list[Any] = []
    for future in futures:
        try:
            outcomes.append(future.wait())
        except Exception as exc:  # the call itself failed (worker gone, timeout), not the function on the owner
            outcomes.append(exc)
    for outcome in outcomes:
        if isinstance(outcome, on_owner.RemoteFailure):
            outcome.reraise()
        if isinstance(outcome, Exception):
            raise outcome
    return outcomes


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(value, b[key]) for key, value in a.items())
    return bool(a == b)


class DistributedOptimizer(Optimizer):
    """Optimize parameters spread over RPC workers, one local optimizer on each owner.

    Args:
        optimizer_class: a ``torch.optim`` class, a functional one, or one given to ``register_functional_optim``.
        params_rref: RRefs to the parameters to optimize, wherever they live.
        *args: the optimizer's hyperparameters by position; none by default (``optimizer_class``'s defaults apply).
        **kwargs: the optimizer's hyperparameters by name (``lr=1e-3`` ...); they reach every owner.

    Raises:
        TypeError: ``optimizer_class`` is not a class, neither a ``torch.optim.Optimizer`` nor a functional
            optimizer, or needs a closure in ``step``; an entry of ``params_rref`` is not an RRef.
        ValueError: ``params_rref`` is empty.
        Exception: an owner's error building its optimizer, with its own type (remote traceback as ``__cause__``).

    Example, on a trainer after ``rpc.init_rpc``::

        optimizer = DistributedOptimizer(torch.optim.Adam, param_rrefs, lr=1e-3)
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, [loss_fn(model(batch))])
            optimizer.step(context_id)
    """

    def __init__(self, optimizer_class: type, params_rref: Sequence[PyRRef[Tensor]], *args: Any, **kwargs: Any) -> None:
        _check_optimizer_class(optimizer_class)
        params_rref = list(params_rref)
        if not params_rref:
            raise ValueError("DistributedOptimizer got an empty params_rref")
        indices_by_owner: dict[str, list[int]] = {}
        for index, rref in enumerate(params_rref):
            if not isinstance(rref, PyRRef):
                raise TypeError(
                    f"params_rref must hold RRefs to parameters, got {type(rref).__name__}; wrap each in "
                    "torch.distributed.rpc.RRef(param) on the worker that owns it"
                )
            indices_by_owner.setdefault(rref.owner_name(), []).append(index)
        created = _on_owners(
            (name, on_owner.create, (optimizer_class, [params_rref[i] for i in indices], args, kwargs))
            for name, indices in indices_by_owner.items()
        )
        hyperparameters: on_owner.Hyperparameters = created[0][1]
        super().__init__([{"params": []}], hyperparameters)  # param_groups[0]: the hyperparameters, no tensors
        self._owners = [
            _Owner(name, indices, local)
            for (name, indices), (local, _) in zip(indices_by_owner.items(), created, strict=True)
        ]
        self._num_params = len(params_rref)
        self._shipped = copy.deepcopy(hyperparameters)
        self.remote_optimizers: list[PyRRef[Any]] = [owner.local for owner in self._owners]
        """RRefs to the optimizer on each owner (as in torch's class)."""
        self.is_functional_optim = registered_functional_optim(optimizer_class) is not None
        """Whether the owners run a ``distoptim.functional`` optimizer (else ``optimizer_class`` behind an adapter)."""

    def step(self, context_id: int) -> None:  # type: ignore[override]
        """Apply the gradients of distributed autograd context ``context_id`` on every owner; wait for all.

        Args:
            context_id: the ``dist_autograd.context()`` whose backward recorded the gradients; params without one stay.

        Raises:
            TypeError: ``context_id`` is not an int.
            RuntimeError: no distributed autograd context has that id (``step`` called outside its ``with`` block).
            Exception: an owner's error, with its own type (remote traceback as ``__cause__``).
        """
        if isinstance(context_id, bool) or not isinstance(context_id, int):
            raise TypeError(
                f"context_id must be an int (from dist_autograd.context()), got {type(context_id).__name__}"
            )
        if on_owner.recorded_gradients(context_id) is None:
            raise RuntimeError(
                f"unknown distributed autograd context id {context_id}: call step() inside the "
                "`with dist_autograd.context() as context_id:` block whose backward pass recorded the gradients"
            )
        current = self._hyperparameters()
        changed = None if _same(current, self._shipped) else current  # the owners keep what they were sent last
        _on_owners((owner.name, on_owner.call, (owner.local, "step", context_id, changed)) for owner in self._owners)
        self._shipped = copy.deepcopy(current)

    def state_dict(self) -> dict[str, Any]:
        """Every owner's state, gathered through RPC, as ``torch.optim`` would save it for ``params_rref``."""
        gathered = _on_owners([(owner.name, on_owner.call, (owner.local, "state")) for owner in self._owners])
        state: dict[int, Any] = {}
        for owner, states in zip(self._owners, gathered, strict=True):
            state.update((i, s) for i, s in zip(owner.indices, states, strict=True) if s is not None)
        group = {**copy.deepcopy(self._hyperparameters()), "params": list(range(self._num_params))}
        return {"state": dict(sorted(state.items())), "param_groups": [group]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a ``state_dict()`` (or a one-group ``torch.optim`` state dict over the same parameters).

        Args:
            state_dict: ``{"state": ..., "param_groups": [one group]}``, parameters numbered as in ``params_rref``.

        Raises:
            ValueError: other keys, more than one param group, another number of parameters, or unknown ids.
        """
        if not isinstance(state_dict, dict) or set(state_dict) != {"state", "param_groups"}:
            raise ValueError("state_dict must be a dict with exactly the keys 'state' and 'param_groups'")
        groups = state_dict["param_groups"]
        if len(groups) != 1:
            raise ValueError(f"state_dict has {len(groups)} param groups; DistributedOptimizer has one")
        ids = list(groups[0]["params"])
        if len(ids) != self._num_params:
            raise ValueError(f"state_dict covers {len(ids)} parameters; this optimizer has {self._num_params}")
        if unknown := set(state_dict["state"]) - set(ids):
            raise ValueError(f"state_dict has state for unknown parameter ids {sorted(unknown)}")
        hyperparameters = {key: value for key, value in groups[0].items() if key != "params"}
        states = [state_dict["state"].get(param_id) for param_id in ids]
        _on_owners(
            (owner.name, on_owner.call, (owner.local, "load", [states[i] for i in owner.indices], hyperparameters))
            for owner in self._owners
        )
        self.param_groups[0].update(copy.deepcopy(hyperparameters))
        self._shipped = copy.deepcopy(self._hyperparameters())

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported (a ``NotImplementedError``): the parameters are fixed by ``params_rref`` at construction.

        Args:
            param_group: ignored.
        """
        if getattr(self, "_owners", None) is None:  # Optimizer.__init__ adding the hyperparameter group
            super().add_param_group(param_group)
            return
        raise NotImplementedError("DistributedOptimizer has one param group; build another optimizer instead")

    def _hyperparameters(self) -> on_owner.Hyperparameters:
        return {key: value for key, value in self.param_groups[0].items() if key != "params"}


def _check_optimizer_class(optimizer_class: Any) -> None:
    if not isinstance(optimizer_class, type):
        raise TypeError(f"optimizer_class must be a class such as torch.optim.SGD, got {optimizer_class!r}")
    if registered_functional_optim(optimizer_class) is not None:  # built-in or registered by the user
        return
    if not issubclass(optimizer_class, Optimizer):
        raise TypeError(f"{optimizer_class.__name__} is neither a torch.optim.Optimizer nor a functional optimizer")
    closure = inspect.signature(optimizer_class.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise TypeError(f"{optimizer_class.__name__}.step needs a closure; it cannot step from an autograd context")
