"""DistributedOptimizer over RPC: a trainer steps parameters that live on other workers, with the gradients that
distributed autograd recorded.

Worker ``trainer`` (rank 0) drives training; workers ``ps1``..``psN`` each own one stage of the model (created
there with ``rpc.remote``), and the trainer owns the output head. The forward runs stage by stage over RPC;
``dist_autograd.backward`` sends the gradients back along the same path, and ``DistributedOptimizer.step`` asks
every owner to step its own parameters with this context's gradients (nothing is left in ``.grad``).

Run (3 local processes on 127.0.0.1, CPU):

    python examples/distributed_optimizer_rpc.py --world-size 3 --steps 20
"""

from __future__ import annotations

import argparse
import warnings

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from _local import checksum, launch, say
from torch import nn

from distoptim import DistributedOptimizer


def make_stage(index: int) -> nn.Module:
    torch.manual_seed(index)  # a reference model can be built alike in one process
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh())


def make_head() -> nn.Module:
    torch.manual_seed(100)
    return nn.Linear(8, 1)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(step))
    return x, x[:, :1].sin() + x[:, 1:2].cos()


def _forward(stage: rpc.RRef[nn.Module], x: torch.Tensor) -> torch.Tensor:
    return stage.local_value()(x)  # runs on the stage's owner


def _param_rrefs(stage: rpc.RRef[nn.Module]) -> list[rpc.RRef[torch.Tensor]]:
    return [rpc.RRef(param) for param in stage.local_value().parameters()]


def _copy(stage: rpc.RRef[nn.Module]) -> nn.Module:
    return stage.local_value()  # pickled back to the caller


def train(rank: int, world_size: int, device: torch.device, steps: int) -> None:
    name = "trainer" if rank == 0 else f"ps{rank}"
    warnings.filterwarnings("ignore", message="You are using a Backend")  # torch's RPC start-up, about itself
    rpc.init_rpc(name, rank=rank, world_size=world_size)  # MASTER_ADDR/MASTER_PORT: 127.0.0.1 and a free port
    if rank == 0:  # the other workers only serve RPCs until shutdown
        stages = [rpc.remote(f"ps{i}", make_stage, args=(i,)) for i in range(1, world_size)]
        head = make_head()
        params = [rref for stage in stages for rref in rpc.rpc_sync(stage.owner(), _param_rrefs, (stage,))]
        params += [rpc.RRef(param) for param in head.parameters()]  # the trainer's own parameters too
        optimizer = DistributedOptimizer(torch.optim.Adam, params, lr=0.01)
        for step in range(steps):
            x, y = batch(step)
            with dist_autograd.context() as context_id:
                for stage in stages:
                    x = rpc.rpc_sync(stage.owner(), _forward, (stage, x))
                loss = nn.functional.mse_loss(head(x), y)
                dist_autograd.backward(context_id, [loss])  # gradients recorded per context, on their owners
                optimizer.step(context_id)  # every owner steps its parameters, concurrently
            if step % 10 == 0 or step == steps - 1:
                say(f"step {step}: loss {loss.item():.4f}")
        model = nn.Sequential(*(rpc.rpc_sync(stage.owner(), _copy, (stage,)) for stage in stages), head)
        say(f"trainer of {world_size} workers: loss {loss.item():.6f} checksum {checksum(model)}")
    rpc.shutdown()  # waits for every worker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=3, help="the trainer and world-size - 1 stage owners")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    launch(train, args.world_size, args.steps, group=False, cuda=False)


if __name__ == "__main__":
    main()
