"""The tiny regression model, data and hyperparameters the framework integration tests share (no framework imports,
so a test can compute its reference without paying for importing Lightning or Accelerate)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.data import DistributedSampler, TensorDataset

SAMPLES = 24  # 2 ranks x batches of 4 x 3 steps per epoch
BATCH_SIZE = 4
LR = 0.02
WEIGHT_DECAY = 0.1
STEP_SIZE = 4  # StepLR, stepped after every optimizer step
GAMMA = 0.5
EPOCHS = 3  # 9 optimizer steps in all
WARMUP_STEPS = 2  # post-local SGD: gradients all-reduced for 2 steps, then local steps,
PERIOD = 4  # and the parameters averaged after steps 3 and 7 (so ranks differ after 6 steps and at the end)


def make_model(seed: int = 0) -> nn.Module:
    """The same small MLP in every process (seeded)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(123)
    inputs = torch.randn(SAMPLES, 8, generator=generator)
    return TensorDataset(inputs, torch.tanh(inputs[:, :4] * 2) + 0.1 * torch.randn(SAMPLES, 4, generator=generator))


def loss_fn(output: Tensor, target: Tensor) -> Tensor:
    return nn.functional.mse_loss(output, target)


def rank_batches(world_size: int, epochs: int) -> list[list[tuple[Tensor, Tensor]]]:
    """Per optimizer step, each rank's batch of ``BATCH_SIZE`` as Lightning's loaders give it: a shuffling
    ``DistributedSampler`` (seed 0) in each rank, told the epoch before each epoch."""
    data = dataset()
    samplers = [DistributedSampler(data, world_size, rank, shuffle=True, seed=0) for rank in range(world_size)]
    steps = []
    for epoch in range(epochs):
        per_rank = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            per_rank.append(list(sampler))
        for start in range(0, len(per_rank[0]), BATCH_SIZE):
            steps.append([data[indices[start : start + BATCH_SIZE]] for indices in per_rank])
    return steps


def parameters(model: nn.Module) -> list[Tensor]:
    """Detached copies of the parameters, to save or compare."""
    return [p.detach().clone() for p in model.parameters()]
