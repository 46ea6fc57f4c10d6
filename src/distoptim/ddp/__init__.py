"""DDP communication hooks: ``zero_step`` (a ZeRO step inside DDP's backward, bucket by bucket), ``post_local_sgd``
(all-reduce during the warm-up, then local steps) and ``reduce_to_owners`` (deprecated: an all-reduce now). They
are registered with ``DistributedDataParallel.register_comm_hook``; the public names are in ``distoptim.hooks``. They
may import ``comm``, ``zero`` and ``averaging``; nothing imports them but ``distoptim.hooks`` and the integrations.
"""
