"""SCAFFOLD: replaced by the functional-optimizers work."""

from typing import Any

__all__ = ["as_functional_optim"]


def as_functional_optim(optim_cls: Any, *args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError
