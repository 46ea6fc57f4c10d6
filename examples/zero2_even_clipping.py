"""ZeRO-2: even shards, gradients reduced only to their owners (``ShardedDataParallel``), ZeRO-aware clipping.

``partition="even"`` cuts the parameters into ``world_size`` equal ranges (a parameter may straddle two ranks);
``ShardedDataParallel`` replaces DDP, so each rank receives and keeps the averaged gradient of its own range only;
``zero.clip_grad_norm_`` clips by the norm of the whole averaged gradient (one scalar all-reduce), which
``torch.nn.utils.clip_grad_norm_`` cannot compute from the owned gradients.

Run (2 local processes on 127.0.0.1; gloo on CPU, NCCL when there is a GPU per rank):

    python examples/zero2_even_clipping.py --world-size 2 --steps 20
"""

from __future__ import annotations

import argparse

import torch
from _local import checksum, launch, say
from torch import nn

from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial model on every rank
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch at ``step`` (each rank its own data)."""
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1000 * step + rank))
    return x, x[:, :16].sin().sum(dim=1, keepdim=True)


def train(rank: int, world_size: int, device: torch.device, steps: int) -> None:
    model = make_model().to(device)
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, partition="even", parameters_as_bucket_view=True, lr=3e-3
    )
    sdp = ShardedDataParallel(model, zero)  # ZeRO-2: no rank receives or keeps the whole averaged gradient

    for step in range(steps):
        x, y = (t.to(device) for t in batch(rank, step))
        zero.zero_grad()
        loss = nn.functional.mse_loss(sdp(x), y)
        loss.backward()  # each rank holds the averaged gradient of what it owns, and only that
        norm = zero.clip_grad_norm_(1.0)  # the norm of the whole averaged gradient, equal on every rank
        zero.step()  # each rank steps its range, then the ranges are gathered into every rank's parameters
        if rank == 0 and (step % 10 == 0 or step == steps - 1):
            say(f"step {step}: loss {loss.item():.4f} (rank 0's batch), gradient norm {norm.item():.4f}")

    owned = zero.plan.loads()[rank]  # elements of each AdamW moment this rank keeps
    total = sum(zero.plan.numels)
    summary = f"owns {owned} of {total} loss {loss.item():.6f} norm {norm.item():.6e} checksum {checksum(model)}"
    say(f"rank {rank}/{world_size}: {summary}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    launch(train, args.world_size, args.steps)


if __name__ == "__main__":
    main()
