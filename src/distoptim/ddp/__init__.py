"""DDP communication hooks: ``reduce_to_owners`` (ZeRO-2: each rank receives the averaged gradient of what it owns),
``zero_step`` (a ZeRO step inside DDP's backward, bucket by bucket) and ``post_local_sgd`` (all-reduce during the
warm-up, then local steps). They are registered with ``DistributedDataParallel.register_comm_hook``; the public names
are in ``distoptim.hooks``. They may import ``comm``, ``zero`` and ``averaging``; nothing imports them but
``distoptim.hooks`` and the integrations.
"""
