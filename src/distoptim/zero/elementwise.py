"""Which optimizers update each element of a parameter on its own (Adam, SGD, ...), as opposed to whole tensors,
and which couple every parameter in one step (LBFGS), which no shard can do on its own.

For these, every non-scalar state tensor has its parameter's shape, and a parameter may be cut anywhere: loading
checks shapes with it, and an even partition may split parameters across ranks. Exact classes only: a subclass may
change the math. ``distoptim.functional`` classes count as their ``torch.optim`` class.
"""

from __future__ import annotations

import torch

from distoptim.functional import functional_class_for

__all__ = ["ELEMENTWISE_NAMES", "class_name", "is_coupled", "is_elementwise", "torch_class_of"]

_ELEMENTWISE: frozenset[type] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adagrad,
        torch.optim.Adadelta,
        torch.optim.Adamax,
        torch.optim.RMSprop,
        torch.optim.Rprop,
        torch.optim.NAdam,
        torch.optim.RAdam,
    }
)

ELEMENTWISE_NAMES = ", ".join(sorted(f"torch.optim.{cls.__name__}" for cls in _ELEMENTWISE))
"""For messages: the elementwise classes, by name."""


def torch_class_of(optimizer_class: type) -> type:
    """The ``torch.optim`` class behind ``optimizer_class`` (itself unless it is a ``distoptim.functional`` class)."""
    functional = functional_class_for(optimizer_class)
    return optimizer_class if functional is None else functional.spec.torch_cls


def class_name(optimizer_class: type) -> str:
    """A stable dotted name for ``optimizer_class``: ``"torch.optim.Muon"`` for torch's public classes (not the
    private module that defines them), ``module.qualname`` otherwise. Checkpoints store a group's class by this
    name, so that they hold plain data (``torch.load(..., weights_only=True)``) and compare across versions."""
    module, qualname = optimizer_class.__module__, optimizer_class.__qualname__
    if module.startswith("torch.optim.") and getattr(torch.optim, qualname, None) is optimizer_class:
        module = "torch.optim"
    return f"{module}.{qualname}"


def is_elementwise(optimizer_class: type) -> bool:
    """Whether ``optimizer_class`` updates every element independently (its state is shaped like its parameter)."""
    return torch_class_of(optimizer_class) in _ELEMENTWISE


_COUPLED: tuple[type, ...] = (torch.optim.LBFGS,)
"""Classes whose step treats all parameters as one vector (a curvature history and a line search over every
parameter, the closure evaluated several times per step); subclasses included: they keep the coupling."""


def is_coupled(optimizer_class: type) -> bool:
    """Whether ``optimizer_class``'s update of a parameter depends on every other parameter (so a shard differs)."""
    cls = torch_class_of(optimizer_class)
    return isinstance(cls, type) and issubclass(cls, _COUPLED)
