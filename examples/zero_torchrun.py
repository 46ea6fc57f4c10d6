"""DDP + ZeroRedundancyOptimizer launched by torchrun (one node or several), with a sharded checkpoint at the end.

torchrun starts the processes and sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT; ``dist.init_process_group()`` reads them (``env://``). Each rank then keeps about 1/WORLD_SIZE of
AdamW's state, and at the end writes only its own shard of it into a sharded checkpoint (torch.distributed.checkpoint
through ``distoptim.checkpoint``; on several machines the directory must be on a file system they all see).
Each rank prints one line with a checksum of its parameters: they agree on every rank.

One machine, 2 processes (gloo on CPU; NCCL, one GPU per process, when there are GPUs):

    torchrun --nproc-per-node=2 examples/zero_torchrun.py --steps 20 --checkpoint-dir /tmp/zero-checkpoint

Two machines of 2 processes each (run on both; HOST is the first machine's address):

    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 --rdzv-id=job1 \
        examples/zero_torchrun.py --checkpoint-dir /shared/zero-checkpoint

Started with plain ``python``, it runs as a single rank.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ZeroRedundancyOptimizer, checkpoint


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial model on every rank
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch at ``step``: each rank sees different data."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=generator)
    return x, x[:, :4].cos()


def checksum(model: nn.Module) -> str:
    """A position-weighted sum of all parameters: equal on ranks holding equal parameters."""
    flat = torch.cat([p.detach().reshape(-1).double().cpu() for p in model.parameters()])
    return f"{float((flat * torch.linspace(1.0, 2.0, len(flat), dtype=torch.float64)).sum()):.12e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--checkpoint-dir", default="zero-checkpoint")
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and local_rank < torch.cuda.device_count()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if "RANK" in os.environ:  # torchrun: rank, world size and where to meet come from the environment (env://)
        dist.init_process_group("nccl" if cuda else "gloo")
    else:  # plain `python`: a group of one
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        model = make_model().to(device)
        ddp = DDP(model, device_ids=[local_rank] if cuda else None)
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.01)
        for step in range(args.steps):
            x, y = (t.to(device) for t in batch(rank, step))
            zero.zero_grad()
            loss = nn.functional.mse_loss(ddp(x), y)
            loss.backward()  # DDP averages the gradients over all ranks, across nodes
            zero.step()  # each rank steps its shard, then the parameters are synced

        # torch.distributed.checkpoint, made crash-safe: every rank writes its own shard of the optimizer state (the
        # replicated model is written once) into a hidden sibling directory, renamed into place once all finished.
        checkpoint.save({"model": model.state_dict(), "optim": zero.sharded_state_dict()}, args.checkpoint_dir)
        node = os.environ.get("GROUP_RANK", "0")  # torchrun's node rank
        line = f"rank {rank}/{world_size} node {node} local_rank {local_rank}: loss {loss.item():.6f} "
        # one write: torchrun runs its workers unbuffered, where print writes the text and the newline separately
        sys.stdout.write(f"{line}checksum {checksum(model)} saved {args.checkpoint_dir}\n")
        sys.stdout.flush()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
