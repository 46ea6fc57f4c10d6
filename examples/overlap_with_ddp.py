"""The ZeRO step inside DDP's backward: ``overlap_with_ddp=True`` and a DDP communication hook that steps.

``hook_with_zero_step`` steps every owned parameter once DDP has reduced the last bucket; the interleaved variant
steps (and starts syncing) each bucket's owned parameters while the next bucket is still being reduced. Either way
``backward()`` leaves the model updated, and ``zero.step()`` afterwards only confirms that the hook stepped. By
default the hooks keep torch's warm-up (the first two backwards, three with ``static_graph``, take no step); this
example passes ``step_from_first_backward=True`` to update from the very first backward. It works on gloo too.

Run (2 local processes on 127.0.0.1; gloo on CPU, NCCL when there is a GPU per rank):

    python examples/overlap_with_ddp.py --world-size 2 --steps 20 --hook interleaved
"""

from __future__ import annotations

import argparse

import torch
from _local import checksum, launch, say
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ZeroRedundancyOptimizer
from distoptim.hooks import allreduce_hook, hook_with_zero_step, hook_with_zero_step_interleaved

HOOKS = {"step": hook_with_zero_step, "interleaved": hook_with_zero_step_interleaved}


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial model on every rank
    hidden = [module for _ in range(3) for module in (nn.Linear(64, 64), nn.ReLU())]
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), *hidden, nn.Linear(64, 4))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch at ``step`` (each rank its own data)."""
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1000 * step + rank))
    return x, x[:, :4].cos()


def train(rank: int, world_size: int, device: torch.device, steps: int, hook: str) -> None:
    model = make_model().to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=0.02)  # ~4 buckets
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, overlap_with_ddp=True, lr=1e-3)
    # The inner hook reduces each bucket (here DDP's all-reduce); the wrapper steps ZeRO on what it reduced and
    # syncs the updated parameters.
    ddp.register_comm_hook(None, HOOKS[hook](allreduce_hook, ddp, zero, step_from_first_backward=True))

    for step in range(steps):
        x, y = (t.to(device) for t in batch(rank, step))
        zero.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()  # reduces the gradients, steps the optimizer and syncs the parameters
        zero.step()  # optional: checks that the hook stepped (it raises if no hook did)
        if rank == 0 and (step % 10 == 0 or step == steps - 1):
            say(f"step {step}: loss {loss.item():.4f} (rank 0's batch)")
    say(f"rank {rank}/{world_size}: hook {hook} loss {loss.item():.6f} checksum {checksum(model)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hook", choices=sorted(HOOKS), default="interleaved")
    args = parser.parse_args()
    launch(train, args.world_size, args.steps, args.hook)


if __name__ == "__main__":
    main()
