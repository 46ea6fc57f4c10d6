"""One rank of the demo: DDP averages the gradients, ZeroRedundancyOptimizer(AdamW) steps this rank's shard."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR

from distoptim import ZeroRedundancyOptimizer, checkpoint
from distoptim.demo.config import PRESETS
from distoptim.demo.data import load_text, sample, split_text
from distoptim.demo.launch import RankContext
from distoptim.demo.model import GPT
from distoptim.demo.options import DemoOptions
from distoptim.demo.progress import ProgressBar
from distoptim.demo.report import RankReport

__all__ = ["optimizer_state_bytes", "train_rank"]

HELD_OUT_BATCHES = 4


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state`` (for AdamW: exp_avg, exp_avg_sq and step of each parameter)."""
    return sum(
        value.numel() * value.element_size()
        for entry in optimizer.state.values()
        for value in entry.values()
        if isinstance(value, Tensor)
    )


def _checksum(params: list[Tensor]) -> float:
    """A position-weighted sum of all parameters: equal on two ranks only if their parameters are (bitwise, here)."""
    flat = torch.cat([param.detach().reshape(-1) for param in params]).double()
    return float((flat * torch.linspace(1.0, 2.0, len(flat), dtype=torch.float64)).sum())


def train_rank(ctx: RankContext, options: DemoOptions) -> RankReport:
    """Train for ``options.steps`` steps on this rank's own batches; report losses, times and state bytes."""
    config = PRESETS[options.size]
    torch.manual_seed(options.seed)  # the same initial model everywhere (DDP would broadcast rank 0's anyway)
    model = GPT(config)
    ddp = DistributedDataParallel(model)
    optimizer = ZeroRedundancyOptimizer(
        ddp.parameters(),
        torch.optim.AdamW,
        lr=options.lr,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        state_format=options.state_format,
    )
    warmup = max(1, options.steps // 10)
    scheduler = LambdaLR(  # linear warm-up, cosine decay to a tenth; the scheduler edits ZeRO's global groups
        optimizer,
        lambda step: (
            min(1.0, (step + 1) / warmup) * (0.55 + 0.45 * math.cos(math.pi * min(1.0, step / max(1, options.steps))))
        ),
    )
    first_step = 1 if options.resume is None else _resume(options.resume, model, optimizer, scheduler) + 1
    train_text, held_out_text = split_text(load_text(Path(options.text)))
    batches = torch.Generator()
    bar = ProgressBar(ctx.console, options.steps) if ctx.rank == 0 else None
    losses: list[float] = []
    times: list[float] = []
    smoothed = math.nan
    dist.barrier()
    started = time.perf_counter()
    for step in range(first_step, options.steps + 1):
        batches.manual_seed(options.seed * 7919 + ctx.rank + 1_000_003 * step)  # every rank and step its own batch
        tokens, targets = sample(train_text, options.batch, config.context, batches)
        begin = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = ddp(tokens, targets)
        loss.backward()
        optimizer.step()
        scheduler.step()
        times.append(time.perf_counter() - begin)
        if options.checkpoint is not None and _checkpoint_due(step, options):
            path = Path(options.checkpoint) / f"step-{step}"
            checkpoint.save(_training_state(model, optimizer, scheduler, step), path)
        losses.append(loss.item())
        mean_loss = _mean_over_ranks(losses[-1])  # the summary's definition too: its "first step" is this at step 1
        smoothed = mean_loss if math.isnan(smoothed) else 0.9 * smoothed + 0.1 * mean_loss
        if bar is not None:
            bar.update(step, loss=f"{smoothed:.3f}", time=f"{1000 * times[-1]:.0f} ms/step")
    train_s = time.perf_counter() - started
    if bar is not None:
        bar.close()
    return RankReport(
        rank=ctx.rank,
        losses=losses,
        step_times=times,
        train_s=train_s,
        held_out_loss=_held_out_loss(model, held_out_text, options, ctx.rank),
        state_bytes=optimizer_state_bytes(optimizer.local_optimizer),
        owned_numel=optimizer.plan.loads()[ctx.rank],
        num_params=sum(param.numel() for param in model.parameters()),
        num_tensors=len(list(model.parameters())),
        checksum=_checksum(list(model.parameters())),
    )


def _checkpoint_due(step: int, options: DemoOptions) -> bool:
    every = options.checkpoint_every
    return step == options.steps or (every > 0 and step % every == 0)


def _training_state(model: GPT, optimizer: ZeroRedundancyOptimizer, scheduler: LambdaLR, step: int) -> dict[str, Any]:
    """What a resumed run needs: each rank saves its own shard of the optimizer (batches follow from the step)."""
    return {
        "model": model.state_dict(),
        "optim": optimizer.sharded_state_dict(),
        "scheduler": scheduler.state_dict(),
        "step": step,
    }


def _resume(path: str, model: GPT, optimizer: ZeroRedundancyOptimizer, scheduler: LambdaLR) -> int:
    """Load a checkpoint written by ``--checkpoint`` (at any world size); return the step it was written after."""
    state = _training_state(model, optimizer, scheduler, 0)
    checkpoint.load(state, path)
    model.load_state_dict(state["model"])
    optimizer.load_sharded_state_dict(state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    step: int = state["step"]
    return step


def _mean_over_ranks(value: float) -> float:
    total = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


@torch.no_grad()
def _held_out_loss(model: GPT, text: Tensor, options: DemoOptions, rank: int) -> float:
    model.eval()
    windows = torch.Generator().manual_seed(options.seed + 104729 * (rank + 1))
    losses = [
        float(model(*sample(text, options.batch, model.config.context, windows))) for _ in range(HELD_OUT_BATCHES)
    ]
    model.train()
    return sum(losses) / len(losses)
