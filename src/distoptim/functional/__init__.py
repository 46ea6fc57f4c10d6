"""Functional optimizers: ``torch.optim`` update rules that take gradients as arguments. Imports torch only."""

from distoptim.functional.optimizers import (
    FunctionalAdadelta,
    FunctionalAdagrad,
    FunctionalAdam,
    FunctionalAdamax,
    FunctionalAdamW,
    FunctionalOptimizer,
    FunctionalRMSprop,
    FunctionalRprop,
    FunctionalSGD,
    as_functional_optim,
    functional_class_for,
)

__all__ = [
    "FunctionalAdadelta",
    "FunctionalAdagrad",
    "FunctionalAdam",
    "FunctionalAdamW",
    "FunctionalAdamax",
    "FunctionalOptimizer",
    "FunctionalRMSprop",
    "FunctionalRprop",
    "FunctionalSGD",
    "as_functional_optim",
    "functional_class_for",
]
