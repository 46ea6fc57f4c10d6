"""A sharded checkpoint saved by one number of ranks and resumed by another: training continues where it stopped.

Phase 1 trains on ``--save-world-size`` ranks and saves model, optimizer and step with ``distoptim.checkpoint``
(torch.distributed.checkpoint, made crash-safe): each rank writes only its own shard of the optimizer state
(``zero.sharded_state_dict()``). Phase 2 starts
``--resume-world-size`` new ranks, each reading only the bytes of its new shard (``load_sharded_state_dict``), and
trains on. Every step uses the same global batch, split evenly across the ranks, so the run is the same training
as one without the interruption, whatever the world sizes.

Run (2 local processes, then 3; gloo on CPU, NCCL when there is a GPU per rank):

    python examples/sharded_checkpoint.py --save-world-size 2 --resume-world-size 3 --steps 10 --dir /tmp/ckpt
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.distributed as dist
from _local import checksum, launch, say
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ZeroRedundancyOptimizer, checkpoint

GLOBAL_BATCH = 48  # split evenly over 1, 2, 3, 4, 6, 8, 12, 16, 24 or 48 ranks


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial model on every rank
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(GLOBAL_BATCH, 8, generator=torch.Generator().manual_seed(step))
    return x, torch.stack([x[:, 0].sin() * x[:, 1].cos(), x[:, 2].tanh()], dim=1)


def train(rank: int, world_size: int, device: torch.device, directory: str, steps: int, resume: bool) -> None:
    model = make_model().to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, partition="even", lr=3e-3)
    first = 0
    if resume:  # every rank reads only what overlaps its new shard
        state = {"model": model.state_dict(), "optim": zero.sharded_state_dict(), "step": 0}
        checkpoint.load(state, directory)  # dcp.load, after checking on every rank that the checkpoint is complete
        model.load_state_dict(state["model"])
        zero.load_sharded_state_dict(state["optim"])
        first = state["step"]
        if rank == 0:
            say(f"resumed at step {first} on {world_size} ranks")

    share = GLOBAL_BATCH // world_size
    for step in range(first, first + steps):
        x, y = (t[rank * share : (rank + 1) * share].to(device) for t in global_batch(step))
        zero.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()  # the mean over equal shares: the gradient of the whole batch's loss
        zero.step()
        whole = loss.detach() / world_size
        dist.all_reduce(whole)  # the whole batch's loss: comparable across world sizes
        if rank == 0:
            say(f"step {step} on {world_size} ranks: loss {whole.item():.4f}")

    if not resume:  # each rank writes its own shard (the replicated model and step are written once)
        state = {"model": model.state_dict(), "optim": zero.sharded_state_dict(), "step": first + steps}
        checkpoint.save(state, directory)  # dcp.save into a hidden sibling, renamed into place when complete
        if rank == 0:
            say(f"saved step {first + steps} by {world_size} ranks to {directory}")
    else:
        last = first + steps
        say(f"rank {rank}/{world_size}: step {last} loss {whole.item():.6f} checksum {checksum(model)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save-world-size", type=int, default=2)
    parser.add_argument("--resume-world-size", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="steps before the save, and again after the resume")
    parser.add_argument("--dir", help="checkpoint directory (default: a temporary one)")
    args = parser.parse_args()
    for size in (args.save_world_size, args.resume_world_size):
        if GLOBAL_BATCH % size:
            parser.error(f"world sizes must divide the global batch of {GLOBAL_BATCH}, got {size}")
    with tempfile.TemporaryDirectory() as scratch:
        directory = args.dir or scratch
        launch(train, args.save_world_size, directory, args.steps, False)
        launch(train, args.resume_world_size, directory, args.steps, True)


if __name__ == "__main__":
    main()
