"""One rank of a 2-rank run that trains a step, saves a sharded checkpoint with ``distoptim.checkpoint`` and loads
it back, then exits (``tests/test_checkpoint_exit.py`` runs it many times: every exit code must be 0).

Usage: ``python tests/_checkpoint_exit_worker.py DIRECTORY`` with the launcher variables (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) set.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

from distoptim import ZeroRedundancyOptimizer, checkpoint


def main() -> None:
    directory = sys.argv[1]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, partition="even", lr=1e-2)
    model(torch.randn(4, 8)).square().sum().backward()
    zero.step()
    checkpoint.save({"model": model.state_dict(), "optim": zero.sharded_state_dict()}, directory)
    state = {"model": model.state_dict(), "optim": zero.sharded_state_dict()}
    checkpoint.load(state, directory)
    zero.load_sharded_state_dict(state["optim"])


if __name__ == "__main__":
    main()
