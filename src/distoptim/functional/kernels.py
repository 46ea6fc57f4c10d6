"""The table that maps each supported ``torch.optim`` optimizer onto its functional kernel (``optimizers`` runs it):
its hyperparameters (``torch.optim``'s order and defaults) and per-parameter state. A torch upgrade that renames a
kernel argument fails at import, not at the first step."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import torch
from torch import Tensor
from torch.optim.adadelta import adadelta
from torch.optim.adagrad import adagrad
from torch.optim.adam import adam
from torch.optim.adamax import adamax
from torch.optim.rmsprop import rmsprop
from torch.optim.rprop import rprop
from torch.optim.sgd import sgd

ParamGroup = dict[str, Any]
StateInit = Callable[[Tensor, ParamGroup], Tensor]


def _step_counter(param: Tensor, group: ParamGroup) -> Tensor:
    # torch.optim keeps `step` on the CPU (capturable and fused off) in `optimizer._get_scalar_dtype()`.
    return torch.zeros((), dtype=torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32)


def _zeros(param: Tensor, group: ParamGroup) -> Tensor:
    return torch.zeros_like(param, memory_format=torch.preserve_format)


def _filled_with(hyperparameter: str) -> StateInit:
    """State initialised to a hyperparameter's value (complex parameters: value + value*j, as torch.optim does)."""

    def init(param: Tensor, group: ParamGroup) -> Tensor:
        value = group[hyperparameter]
        fill = complex(value, value) if param.is_complex() else value
        return torch.full_like(param, fill, memory_format=torch.preserve_format)

    return init


@dataclass(frozen=True)
class KernelSpec:
    """How one ``torch.optim`` optimizer maps onto its functional kernel: one row of this table."""

    torch_cls: type[torch.optim.Optimizer]
    kernel: Callable[..., None]
    defaults: dict[str, Any]  # constructor hyperparameters, in torch.optim's positional order, with its defaults
    state: dict[str, StateInit]  # per-parameter state torch.optim creates lazily, in its order
    kernel_state: tuple[str, ...]  # state lists the kernel takes after (params, grads), in the kernel's order
    optional: dict[str, str] = field(default_factory=dict)  # state kept only while param_group[flag] is truthy
    pairs: dict[str, tuple[str, str]] = field(default_factory=dict)  # tuple hyperparameters the kernel takes split
    init_only: frozenset[str] = frozenset()  # hyperparameters used to create state, not passed to the kernel
    fixed: dict[str, Any] = field(default_factory=dict)  # param_group entries that are not constructor arguments
    eager_state: bool = False  # state created at construction for every parameter (Adagrad), not at first step

    def __post_init__(self) -> None:
        for name in [*self.defaults, *self.fixed, "foreach", "maximize"]:
            if name not in self.kernel_params and name not in self.pairs and name not in self.init_only:
                raise TypeError(f"{self.kernel.__name__}() takes no argument {name!r}")

    @cached_property
    def kernel_params(self) -> frozenset[str]:
        return frozenset(inspect.signature(self.kernel).parameters) - {"params"}


_BETAS = {"betas": ("beta1", "beta2")}
_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False}

SGD = KernelSpec(
    torch.optim.SGD,
    sgd,
    {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False},
    state={},  # the kernel creates `momentum_buffer` from the first gradient; it is written back after the step
    kernel_state=("momentum_buffer",),
    optional={"momentum_buffer": "momentum"},
)
ADAM = KernelSpec(
    torch.optim.Adam,
    adam,
    {**_ADAM_DEFAULTS, "decoupled_weight_decay": False},
    {"step": _step_counter, "exp_avg": _zeros, "exp_avg_sq": _zeros, "max_exp_avg_sq": _zeros},
    ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"),
    optional={"max_exp_avg_sq": "amsgrad"},
    pairs=_BETAS,
)
ADAMW = replace(  # torch.optim.AdamW is Adam with decoupled weight decay, run by the same kernel
    ADAM,
    torch_cls=torch.optim.AdamW,
    defaults={**_ADAM_DEFAULTS, "weight_decay": 1e-2},
    fixed={"decoupled_weight_decay": True},
)
ADAGRAD = KernelSpec(
    torch.optim.Adagrad,
    adagrad,
    {"lr": 1e-2, "lr_decay": 0.0, "weight_decay": 0.0, "initial_accumulator_value": 0.0, "eps": 1e-10},
    {"step": _step_counter, "sum": _filled_with("initial_accumulator_value")},
    ("sum", "step"),
    init_only=frozenset({"initial_accumulator_value"}),
    eager_state=True,
)
ADADELTA = KernelSpec(
    torch.optim.Adadelta,
    adadelta,
    {"lr": 1.0, "rho": 0.9, "eps": 1e-6, "weight_decay": 0.0},
    {"step": _step_counter, "square_avg": _zeros, "acc_delta": _zeros},
    ("square_avg", "acc_delta", "step"),
)
ADAMAX = KernelSpec(
    torch.optim.Adamax,
    adamax,
    {"lr": 2e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    {"step": _step_counter, "exp_avg": _zeros, "exp_inf": _zeros},
    ("exp_avg", "exp_inf", "step"),
    pairs=_BETAS,
)
RMSPROP = KernelSpec(
    torch.optim.RMSprop,
    rmsprop,
    {"lr": 1e-2, "alpha": 0.99, "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.0, "centered": False},
    {"step": _step_counter, "square_avg": _zeros, "momentum_buffer": _zeros, "grad_avg": _zeros},
    ("square_avg", "grad_avg", "momentum_buffer", "step"),
    optional={"momentum_buffer": "momentum", "grad_avg": "centered"},
)
RPROP = KernelSpec(
    torch.optim.Rprop,
    rprop,
    {"lr": 1e-2, "etas": (0.5, 1.2), "step_sizes": (1e-6, 50.0)},
    {"step": _step_counter, "prev": _zeros, "step_size": _filled_with("lr")},
    ("prev", "step_size", "step"),
    pairs={"etas": ("etaminus", "etaplus"), "step_sizes": ("step_size_min", "step_size_max")},
    init_only=frozenset({"lr"}),  # Rprop's lr is only the initial step size
)
