"""DDP communication hooks (``zero_step``, ``post_local_sgd``, ``reduce_to_owners``), public in ``distoptim.hooks``.
They may import ``comm``, ``zero`` and ``averaging``."""
