"""One rank of one benchmark run: build the model and the variant's optimizer, time the steps, count the bytes."""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from comm_bytes import CommCounter, all_reduce_bytes
from torch.nn.parallel import DistributedDataParallel
from zero_variants import VARIANTS

from distoptim.demo.config import GPTConfig
from distoptim.demo.launch import RankContext
from distoptim.demo.model import GPT
from distoptim.demo.train import optimizer_state_bytes

__all__ = ["RankResult", "RunSpec", "bench_rank"]


@dataclass(frozen=True)
class RunSpec:
    variant: str
    config: GPTConfig
    batch: int
    seq: int
    warmup: int
    iters: int
    compute_iters: int  # extra backward passes under no_sync(): the backward's compute alone, for reference
    lr: float = 1e-4


@dataclass
class RankResult:
    rank: int
    backward_s: list[float] = field(default_factory=list)  # per timed iteration: backward incl. DDP's reduction
    step_s: list[float] = field(default_factory=list)  # per timed iteration: optimizer.step() incl. param sync
    compute_backward_s: float = 0.0  # median backward without gradient reduction
    comm_bytes_per_step: float = 0.0
    comm_calls_per_step: float = 0.0
    comm_by_function: dict[str, float] = field(default_factory=dict)
    state_bytes: int = 0
    num_params: int = 0
    num_tensors: int = 0
    start_rss_bytes: int = 0
    peak_rss_bytes: int = 0


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def bench_rank(ctx: RankContext, spec: RunSpec) -> RankResult:
    result = RankResult(rank=ctx.rank, start_rss_bytes=_peak_rss_bytes())
    variant = VARIANTS[spec.variant]
    torch.manual_seed(0)
    model = GPT(spec.config).to(variant.dtype)
    ddp = DistributedDataParallel(model)
    params = list(model.parameters())
    optimizer = variant.build(ddp, params, {"lr": spec.lr})
    generator = torch.Generator().manual_seed(ctx.rank)
    tokens = torch.randint(0, spec.config.vocab, (spec.batch, spec.seq + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    counter = CommCounter()
    for iteration in range(spec.warmup + spec.iters):
        timed = iteration >= spec.warmup
        optimizer.zero_grad()
        loss = ddp(inputs, targets)
        dist.barrier()  # start the timed part together: the slowest rank's time is the step's time
        with counter.counting(active=timed):
            begin = time.perf_counter()
            loss.backward()
            middle = time.perf_counter()
            if not variant.steps_in_backward:
                optimizer.step()
            end = time.perf_counter()
        if timed:
            result.backward_s.append(middle - begin)
            result.step_s.append(end - middle)
    compute = []
    for _ in range(spec.compute_iters):
        model.zero_grad()  # not the optimizer's: an overlap-mode optimizer expects a step between its zero_grads
        with ddp.no_sync():
            loss = ddp(inputs, targets)
            begin = time.perf_counter()
            loss.backward()
            compute.append(time.perf_counter() - begin)
    result.compute_backward_s = statistics.median(compute) if compute else 0.0
    grad_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    ddp_bytes = all_reduce_bytes(grad_bytes, ctx.world_size) if variant.ddp_cpp_allreduce and ctx.world_size > 1 else 0
    result.comm_bytes_per_step = counter.bytes / spec.iters + ddp_bytes
    result.comm_calls_per_step = counter.calls / spec.iters  # Python-level calls only (not DDP's reducer)
    result.comm_by_function = {name: calls / spec.iters for name, calls in counter.by_function.items()}
    result.state_bytes = optimizer_state_bytes(variant.local(optimizer))
    result.num_params = sum(p.numel() for p in params)
    result.num_tensors = len(params)
    result.peak_rss_bytes = _peak_rss_bytes()
    return result
