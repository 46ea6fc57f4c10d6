"""Post-local SGD: DDP all-reduces gradients for a warm-up, then ranks step locally and average their models
every ``--period`` steps.

``post_localSGD_hook`` does DDP's gradient all-reduce until ``start_localSGD_iter``; after it, each rank keeps its
own gradient here (``post_local_gradient_allreduce=False``; with ``True`` it all-reduces within each node, which on
one machine is every rank). ``PostLocalSGDOptimizer`` steps the local optimizer, then its
``PeriodicModelAverager`` averages the parameters whenever its schedule (same warm-up) says so. Between averagings
the ranks' models differ; right after one they are equal.

Run (2 local processes on 127.0.0.1; gloo on CPU, NCCL when there is a GPU per rank):

    python examples/post_local_sgd.py --world-size 2 --steps 16 --warmup 4 --period 4
"""

from __future__ import annotations

import argparse

import torch
from _local import checksum, launch, say
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import PostLocalSGDOptimizer
from distoptim.averagers import PeriodicModelAverager
from distoptim.hooks import PostLocalSGDState, post_localSGD_hook


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial model on every rank
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch at ``step`` (each rank its own data)."""
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1000 * step + rank))
    return x, x[:, :1].sin() * x[:, 1:2].cos()


def train(rank: int, world_size: int, device: torch.device, steps: int, warmup: int, period: int) -> None:
    model = make_model().to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    state = PostLocalSGDState(None, None, start_localSGD_iter=warmup, post_local_gradient_allreduce=False)
    ddp.register_comm_hook(state, post_localSGD_hook)
    local = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    optimizer = PostLocalSGDOptimizer(local, PeriodicModelAverager(period=period, warmup_steps=warmup))

    averaged = "never"
    for step in range(steps):
        x, y = (t.to(device) for t in batch(rank, step))
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()  # gradients all-reduced during the warm-up, local after it
        optimizer.step()  # a local step, then the model average when one is due
        if step >= warmup and (step - warmup) % period == 0:  # the averager's schedule: the ranks agree here
            averaged = f"{step} {checksum(model)}"
            if rank == 0:
                say(f"step {step}: models averaged; loss {loss.item():.4f} (rank 0's batch)")
    now = checksum(model)
    say(f"rank {rank}/{world_size}: loss {loss.item():.6f} last averaged at step {averaged} checksum now {now}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=4, help="steps of global gradient all-reduce first")
    parser.add_argument("--period", type=int, default=4, help="steps between model averagings after the warm-up")
    args = parser.parse_args()
    launch(train, args.world_size, args.steps, args.warmup, args.period)


if __name__ == "__main__":
    main()
