"""Small DDP training runs that the fault tests checkpoint, kill and resume: one builder for every mode.

A mode is a ZeRO configuration (partition, bucket view, gradient reduction, stepping, master weights) and a
checkpoint path (sharded: ``torch.distributed.checkpoint`` directly, or ``distoptim.checkpoint``'s crash-safe
save and load; consolidated onto rank 0 and written with ``atomic_save``), or post-local SGD (each rank's own state,
written per rank). Inputs depend only on (rank, step),
so a run resumed from a checkpoint sees the same data as one that never stopped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import PostLocalSGDOptimizer, ZeroRedundancyOptimizer
from distoptim import checkpoint as distoptim_checkpoint
from distoptim.averagers import PeriodicModelAverager
from distoptim.hooks import PostLocalSGDState, post_localSGD_hook
from tests.zero._hooks import register

__all__ = ["MODES", "Mode", "Run", "atomic_save", "build", "load", "parameters", "save", "train"]

WARMUP = 4  # post-local SGD: global gradient averaging for 4 iterations, then the model every PERIOD steps
PERIOD = 3


@dataclass(frozen=True)
class Mode:
    partition: str = "greedy"
    bucket_view: bool = False
    reduction: str = "all_reduce"  # or "to_owners" (reduce_to_owners_hook)
    stepping: str = "explicit"  # or "hook" / "interleaved" (overlap_with_ddp)
    master: bool = False  # a bf16 model with fp32 master weights
    checkpoint: str = "dcp"  # "distoptim" (distoptim.checkpoint) or "consolidated"; post-local SGD: a file per rank
    post_local_sgd: bool = False


MODES = {
    "greedy": Mode(),
    "even": Mode(partition="even", checkpoint="distoptim"),
    "bucket_view": Mode(bucket_view=True),
    "overlap": Mode(stepping="hook"),
    "overlap_interleaved_to_owners": Mode(
        partition="even", bucket_view=True, reduction="to_owners", stepping="interleaved"
    ),
    "grad_sharding": Mode(partition="even", reduction="to_owners"),
    "master": Mode(partition="even", master=True),
    "consolidated": Mode(bucket_view=True, checkpoint="consolidated"),
    "master_consolidated": Mode(partition="even", master=True, reduction="to_owners", checkpoint="consolidated"),
    "post_local_sgd": Mode(post_local_sgd=True),
}


@dataclass
class Run:
    mode: Mode
    ddp: DDP
    optimizer: Any  # ZeroRedundancyOptimizer or PostLocalSGDOptimizer
    hook_state: PostLocalSGDState | None = None

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.mode.master else torch.float32


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(16, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)]
    return nn.Sequential(*layers).to(dtype)


def build(mode: Mode) -> Run:
    """A fresh model (the same on every rank), its DDP wrapper and the mode's optimizer (collective)."""
    dtype = torch.bfloat16 if mode.master else torch.float32
    ddp = DDP(_model(dtype), bucket_cap_mb=0.002)  # a few buckets
    params = list(ddp.parameters())
    if mode.post_local_sgd:
        hook_state = PostLocalSGDState(None, None, start_localSGD_iter=WARMUP, post_local_gradient_allreduce=False)
        ddp.register_comm_hook(hook_state, post_localSGD_hook)
        local = torch.optim.SGD(params, lr=0.05, momentum=0.9)
        return Run(mode, ddp, PostLocalSGDOptimizer(local, PeriodicModelAverager(PERIOD, WARMUP)), hook_state)
    zero = ZeroRedundancyOptimizer(
        [{"params": params[:3], "lr": 0.02}, {"params": params[3:]}],
        torch.optim.AdamW,
        parameters_as_bucket_view=mode.bucket_view,
        overlap_with_ddp=mode.stepping != "explicit",
        partition=mode.partition,
        master_dtype=torch.float32 if mode.master else None,
        lr=0.01,
        weight_decay=0.1,
    )
    register(ddp, zero, mode.reduction, mode.stepping)
    return Run(mode, ddp, zero)


def train(run: Run, rank: int, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(1000 * step + rank)
        inputs = torch.randn(8, 16, generator=generator).to(run.dtype)
        run.optimizer.zero_grad()
        run.ddp(inputs).float().square().mean().backward()
        run.optimizer.step()  # in overlap mode a confirmation of the hook's step


def parameters(run: Run) -> list[torch.Tensor]:
    return [param.detach().clone() for param in run.ddp.module.parameters()]


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save`` that leaves ``path`` either as it was or complete: write a temporary sibling, flush it to
    disk, then rename it over ``path`` (``os.replace`` is atomic on POSIX), and flush the directory entry."""
    temporary = f"{path}.tmp"
    with open(temporary, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def save(run: Run, path: str) -> None:
    """Checkpoint model and optimizer at ``path`` as the mode says (collective; returns when it is written)."""
    rank, model = dist.get_rank(), run.ddp.module
    if run.mode.post_local_sgd:  # ranks hold different models and momenta between averagings: each saves its own
        assert run.hook_state is not None
        state = {"model": model.state_dict(), "optim": run.optimizer.state_dict(), "hook": run.hook_state.state_dict()}
        os.makedirs(path, exist_ok=True)
        atomic_save(state, os.path.join(path, f"rank{rank}.pt"))
    elif run.mode.checkpoint == "consolidated":
        run.optimizer.consolidate_state_dict(to=0)
        if rank == 0:
            atomic_save({"model": model.state_dict(), "optim": run.optimizer.state_dict()}, path)
    elif run.mode.checkpoint == "distoptim":
        distoptim_checkpoint.save({"model": model.state_dict(), "optim": run.optimizer.sharded_state_dict()}, path)
    else:
        dcp.save({"model": model.state_dict(), "optim": run.optimizer.sharded_state_dict()}, checkpoint_id=path)
    dist.barrier()  # nobody goes on (or exits) before the checkpoint is complete


def load(run: Run, path: str, optimizer: bool = True) -> None:
    """Resume ``run`` from ``path``; ``optimizer=False`` loads the model only (a control that must not match)."""
    model = run.ddp.module
    if run.mode.post_local_sgd:
        assert run.hook_state is not None
        state = torch.load(os.path.join(path, f"rank{dist.get_rank()}.pt"), weights_only=True)
        run.hook_state.load_state_dict(state["hook"])
    elif run.mode.checkpoint == "consolidated":
        state = torch.load(path, weights_only=True)
    else:
        state = {"model": model.state_dict()}
        if optimizer:
            state["optim"] = run.optimizer.sharded_state_dict()
        if run.mode.checkpoint == "distoptim":
            distoptim_checkpoint.load(state, path)
        else:
            dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        if optimizer:
            run.optimizer.load_sharded_state_dict(state["optim"])
        return
    model.load_state_dict(state["model"])
    if optimizer:
        run.optimizer.load_state_dict(state["optim"])
