"""Every call to ``torch.distributed``'s communication: the only package that talks to other ranks (its modules:
``docs/layout.md``). It imports torch and distoptim's ``_flat`` only, so any package may use it."""
