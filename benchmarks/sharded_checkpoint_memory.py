"""Peak extra memory of a sharded save (``dcp.save`` of ``sharded_state_dict()``) and load (``dcp.load`` into a new
optimizer's ``sharded_state_dict()``, at another partition) on every rank, against that rank's own shard.

.venv/bin/python benchmarks/sharded_checkpoint_memory.py --world-sizes 2 4 --params-millions 20

Measured as ``consolidation_memory.py`` measures (VmHWM growth after resetting it, glibc serving large allocations
with their own mmaps): the checkpoint is written with even partition and loaded with greedy, so every rank reads
byte ranges other ranks wrote. The load's figure excludes the new optimizer's own state, created before the load.
"""

from __future__ import annotations

import ctypes
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed.checkpoint as dcp
from consolidation_memory import _M_MMAP_THRESHOLD, _tensor_bytes, measure_peak, model_config

from distoptim import ZeroRedundancyOptimizer
from distoptim.demo.config import GPTConfig
from distoptim.demo.model import GPT
from tests._dist import run_on_ranks


def _rank(rank: int, world_size: int, config: GPTConfig, path: str) -> dict[str, float]:
    ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 64 << 10)
    torch.manual_seed(0)
    model = GPT(config)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, partition="even", lr=1e-4)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    zero.step()
    zero.zero_grad()
    state = zero.sharded_state_dict()
    saved, save_s = measure_peak(lambda: dcp.save({"optim": state}, checkpoint_id=path))
    shard = _tensor_bytes(zero.state)
    del zero

    fresh = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, partition="greedy", lr=1e-4)
    target = {"optim": fresh.sharded_state_dict()}  # creates the new optimizer's (own) state
    loaded, load_s = measure_peak(lambda: dcp.load(target, checkpoint_id=path))
    fresh.load_sharded_state_dict(target["optim"])
    return {"shard": shard, "save": saved, "save_s": save_s, "new_shard": _tensor_bytes(fresh.state), "load": loaded,
            "load_s": load_s}  # fmt: skip


def main() -> None:
    args, config = model_config(__doc__)
    print(f"{'world':>5} {'rank':>4} {'shard MB':>9} {'save extra MB':>13} {'new shard MB':>12} {'load extra MB':>13}")
    for world_size in args.world_sizes:
        with tempfile.TemporaryDirectory() as directory:
            rows = run_on_ranks(_rank, world_size, config, str(Path(directory) / "ckpt"), timeout=600)
        for rank, row in enumerate(rows):
            print(
                f"{world_size:>5} {rank:>4} {row['shard'] / 1e6:>9.1f} {row['save'] / 1e6:>13.1f} "
                f"{row['new_shard'] / 1e6:>12.1f} {row['load'] / 1e6:>13.1f}"
            )


if __name__ == "__main__":
    main()
