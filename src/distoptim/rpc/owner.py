"""The owners' half of ``DistributedOptimizer``, run through RPC on the workers that hold the parameters: one
``LocalOptimizer`` per trainer and owner; the module-level functions are the RPC entry points."""

from __future__ import annotations

import copy
import pickle
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import Tensor
from torch.distributed.rpc import PyRRef
from torch.optim import Optimizer

from distoptim.functional.optimizers import registered_functional_optim

Hyperparameters = dict[str, Any]

_OWNER_LOCK = threading.Lock()
"""One per process: steps, state reads and loads of every ``LocalOptimizer`` here (one per trainer) run in turn."""


class _GradientsAsArgument:
    """A ``torch.optim`` optimizer behind the functional interface; ``.grad`` holds the gradient only during a step."""

    def __init__(self, optimizer_class: type[Optimizer], params: list[Tensor], *args: Any, **kwargs: Any) -> None:
        self.params = params
        self.optimizer = optimizer_class(params, *args, **kwargs)
        if len(self.optimizer.param_groups) != 1:
            raise ValueError(
                f"{optimizer_class.__name__} made {len(self.optimizer.param_groups)} param groups; one is supported"
            )
        self.state: dict[Tensor, Any] = self.optimizer.state  # the same objects: nothing here rebinds them
        self.param_group: dict[str, Any] = self.optimizer.param_groups[0]

    def step(self, gradients: list[Tensor | None]) -> None:
        saved = [param.grad for param in self.params]
        try:
            for param, grad in zip(self.params, gradients, strict=True):
                param.grad = grad
            self.optimizer.step()
        finally:
            for param, grad in zip(self.params, saved, strict=True):
                param.grad = grad


class LocalOptimizer:
    """The owner's half of a DistributedOptimizer: its parameters and one optimizer (functional or adapted)."""

    def __init__(
        self, optimizer_class: type, param_rrefs: list[PyRRef[Tensor]], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        self.params: list[Tensor] = [rref.local_value() for rref in param_rrefs]
        if len(set(self.params)) != len(self.params):
            raise ValueError("a parameter appears more than once in params_rref")
        functional_class = registered_functional_optim(optimizer_class)
        if functional_class is not None:
            self.optimizer: Any = functional_class(self.params, *args, **kwargs)
        else:
            self.optimizer = _GradientsAsArgument(optimizer_class, self.params, *args, **kwargs)

    def hyperparameters(self) -> Hyperparameters:
        return {key: value for key, value in self.optimizer.param_group.items() if key != "params"}

    def step(self, context_id: int, hyperparameters: Hyperparameters | None) -> None:
        recorded = recorded_gradients(context_id) or {}  # None: this owner took no part (the caller checked the id)
        gradients = [recorded.get(param) for param in self.params]
        with _OWNER_LOCK:
            if hyperparameters is not None:
                self.optimizer.param_group.update(hyperparameters)
            if any(grad is not None for grad in gradients):
                self.optimizer.step(gradients)

    def state(self) -> list[dict[str, Any] | None]:
        """Each parameter's state (None: not stepped yet), copied to the CPU so RPC needs no device map."""
        with _OWNER_LOCK:
            return [_cpu_copy(self.optimizer.state[p]) if p in self.optimizer.state else None for p in self.params]

    def load(self, states: list[dict[str, Any] | None], hyperparameters: Hyperparameters) -> None:
        """Replace the state of every parameter (None: no state) and the hyperparameters."""
        with _OWNER_LOCK:
            group = self.optimizer.param_group
            group.update(hyperparameters)
            for param, param_state in zip(self.params, states, strict=True):
                if param_state is None:
                    self.optimizer.state.pop(param, None)
                else:
                    self.optimizer.state[param] = {k: _cast_like(param, group, k, v) for k, v in param_state.items()}


def recorded_gradients(context_id: int) -> dict[Tensor, Tensor] | None:
    """The gradients this worker recorded in distributed autograd context ``context_id``; None for an unknown id."""
    try:
        return dist_autograd.get_gradients(context_id)
    except RuntimeError:
        return None


def _cpu_copy(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _cpu_copy(item) for key, item in value.items()}
    return copy.deepcopy(value)


def _cast_like(param: Tensor, group: dict[str, Any], key: str, value: Any) -> Any:
    """As torch.optim loads state: to the param's device (and float dtype); ``step`` on CPU unless capturable/fused."""
    if not isinstance(value, Tensor):
        return copy.deepcopy(value)
    if key == "step":
        if group.get("capturable") or group.get("fused"):
            return value.to(dtype=torch.float32, device=param.device, copy=True)
        return value.detach().clone()
    if value.is_floating_point():
        return value.to(dtype=param.dtype, device=param.device, copy=True)
    return value.to(device=param.device, copy=True)


@dataclass
class RemoteFailure:
    """An owner-side exception in transit: pickled if it pickles, else its type name and message."""

    pickled: bytes | None
    description: str
    remote_traceback: str

    @classmethod
    def capture(cls, exc: Exception) -> RemoteFailure:
        try:
            pickled: bytes | None = pickle.dumps(exc)
        except Exception:
            pickled = None
        where = rpc.get_worker_info().name
        return cls(pickled, f"{type(exc).__name__}: {exc}", f"on RPC worker {where}:\n{traceback.format_exc()}")

    def reraise(self) -> NoReturn:
        exc: BaseException
        try:
            exc = pickle.loads(self.pickled) if self.pickled is not None else RuntimeError(self.description)
        except Exception:
            exc = RuntimeError(self.description)
        raise exc from _RemoteTraceback(self.remote_traceback)


class _RemoteTraceback(Exception):
    """Carries the owner's traceback as the ``__cause__`` of the re-raised exception."""


def invoke(function: Callable[..., Any], *args: Any) -> Any:
    """Runs on the owner; returns the result, or the exception as a value so that its type survives the trip."""
    try:
        return function(*args)
    except Exception as exc:
        return RemoteFailure.capture(exc)


def create(
    optimizer_class: type, param_rrefs: list[PyRRef[Tensor]], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[PyRRef[LocalOptimizer], Hyperparameters]:
    local = LocalOptimizer(optimizer_class, param_rrefs, args, kwargs)
    return rpc.RRef(local), local.hyperparameters()


def call(local: PyRRef[LocalOptimizer], method: str, *args: Any) -> Any:
    """Runs ``local``'s ``method`` (``step``, ``state``, ``load``) on the owner that holds it."""
    return getattr(local.local_value(), method)(*args)
