"""Registering functional optimizers of your own: the counterpart of ``torch.distributed.optim.utils``.

``functional_optim_map`` is the one table that ``as_functional_optim``, ``DistributedOptimizer`` and ZeRO's overlap
mode read (``distoptim.functional`` owns it); ``register_functional_optim`` adds an entry.
"""

from distoptim.functional.optimizers import as_functional_optim, functional_optim_map, register_functional_optim

__all__ = ["as_functional_optim", "functional_optim_map", "register_functional_optim"]
