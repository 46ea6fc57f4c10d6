"""distoptim: distributed optimizers for PyTorch (ZeRO sharding, ShardedDataParallel, post-local SGD, RPC and
functional optimizers)."""

import re

import torch

__version__ = "0.2.0"

MINIMUM_TORCH = (2, 11)
"""The oldest torch release the whole test suite has passed on (2.11 and 2.13 are tested)."""


def _check_torch_version(version: str) -> None:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or tuple(map(int, match.groups())) < MINIMUM_TORCH:
        raise ImportError(
            f"distoptim needs torch >= {'.'.join(map(str, MINIMUM_TORCH))}, found torch {version}; "
            "upgrade it (pip install 'torch>=2.11'; the README says how to get the CPU-only build)"
        )


_check_torch_version(str(torch.__version__))

from distoptim.averaging import PostLocalSGDOptimizer  # noqa: E402 (after the version check)
from distoptim.functional import as_functional_optim  # noqa: E402
from distoptim.rpc import DistributedOptimizer  # noqa: E402
from distoptim.sharded_data_parallel import ShardedDataParallel  # noqa: E402
from distoptim.zero import ZeroRedundancyOptimizer  # noqa: E402

__all__ = [
    "DistributedOptimizer",
    "PostLocalSGDOptimizer",
    "ShardedDataParallel",
    "ZeroRedundancyOptimizer",
    "__version__",
    "as_functional_optim",
]
