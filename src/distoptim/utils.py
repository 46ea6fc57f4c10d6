"""Registering functional optimizers of your own: the counterpart of ``torch.distributed.optim.utils``."""

from distoptim.functional.optimizers import as_functional_optim, functional_optim_map, register_functional_optim

__all__ = ["as_functional_optim", "functional_optim_map", "register_functional_optim"]
