"""Which optimizers update each element of a parameter on its own (Adam, SGD, ...: their state is shaped like the
parameter, which may be cut anywhere; exact classes only), and which couple every parameter in one step (LBFGS)."""

from __future__ import annotations

import torch
from torch.optim import LBFGS, SGD, Adadelta, Adagrad, Adam, Adamax, AdamW, NAdam, RAdam, RMSprop, Rprop

from distoptim.functional import functional_class_for

__all__ = ["class_name", "is_coupled", "is_elementwise", "torch_class_of"]

_ELEMENTWISE: frozenset[type] = frozenset({SGD, Adam, AdamW, Adagrad, Adadelta, Adamax, RMSprop, Rprop, NAdam, RAdam})


def torch_class_of(optimizer_class: type) -> type:
    """The ``torch.optim`` class behind ``optimizer_class`` (itself unless it is a ``distoptim.functional`` class)."""
    functional = functional_class_for(optimizer_class)
    return optimizer_class if functional is None else functional.spec.torch_cls


def class_name(optimizer_class: type) -> str:
    """A stable dotted name for ``optimizer_class`` (``"torch.optim.Muon"``): how checkpoints store a group's class."""
    module, qualname = optimizer_class.__module__, optimizer_class.__qualname__
    if module.startswith("torch.optim.") and getattr(torch.optim, qualname, None) is optimizer_class:
        module = "torch.optim"
    return f"{module}.{qualname}"


def is_elementwise(optimizer_class: type) -> bool:
    """Whether ``optimizer_class`` updates every element independently (its state is shaped like its parameter)."""
    return torch_class_of(optimizer_class) in _ELEMENTWISE


_COUPLED: tuple[type, ...] = (LBFGS,)  # one step over all parameters as one vector; subclasses too


def is_coupled(optimizer_class: type) -> bool:
    """Whether ``optimizer_class``'s update of a parameter depends on every other parameter (so a shard differs)."""
    cls = torch_class_of(optimizer_class)
    return isinstance(cls, type) and issubclass(cls, _COUPLED)
