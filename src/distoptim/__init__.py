"""distoptim: distributed optimizers for PyTorch.

``ZeroRedundancyOptimizer`` shards optimizer state across data-parallel ranks (ZeRO stage 1),
``PostLocalSGDOptimizer`` averages models periodically instead of gradients every step,
``DistributedOptimizer`` steps parameters owned by other RPC workers, and ``as_functional_optim``
gives optimizers that take gradients explicitly.
"""

from distoptim.averaging import PostLocalSGDOptimizer
from distoptim.functional import as_functional_optim
from distoptim.rpc import DistributedOptimizer
from distoptim.zero import ZeroRedundancyOptimizer

__all__ = ["DistributedOptimizer", "PostLocalSGDOptimizer", "ZeroRedundancyOptimizer", "as_functional_optim"]
