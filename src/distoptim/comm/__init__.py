"""Every call to ``torch.distributed``'s communication: the only package that talks to other ranks.

``collectives`` (ZeRO's gradient reductions and parameter syncs, chunked or point to point per backend) with ``p2p``
(gloo's point-to-point transfers) and ``relay`` (the same through aggregators, where the owners' shares are
unequal), ``averaging`` (the averagers' one all-reduce of parameters), ``agreement`` (one
small all-reduce so that every rank raises the same error or none does), ``objects`` (picklable objects over the
control plane) and ``groups`` (the control-plane group, group ranks and sizes). It imports torch only, and
``distoptim._flat`` for flat views: no other distoptim package, so every other package may use it.
"""
