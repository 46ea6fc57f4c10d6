"""One rank of one benchmark run: build the model and the variant, time the iterations, count bytes and memory."""

from __future__ import annotations

import ctypes
import resource
import statistics
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from comm_bytes import CommCounter, all_reduce_bytes
from harness import Harness, Variant
from memory_census import census, peak_growth, reset_peak, rss_bytes, tensors_alive
from torch import Tensor
from zero_variants import VARIANTS

from distoptim.demo.config import GPTConfig
from distoptim.demo.launch import RankContext
from distoptim.demo.model import GPT

__all__ = ["PHASES", "RankResult", "RunSpec", "bench_rank"]

PHASES = ("forward", "backward", "step")  # where the census iteration counts the live tensors
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


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
    pin_malloc: bool = False  # fix glibc's mmap threshold (memory-only runs): peaks then follow live tensors


@dataclass
class RankResult:
    rank: int
    forward_s: list[float] = field(default_factory=list)  # per timed iteration: zero_grad + forward
    backward_s: list[float] = field(default_factory=list)  # per timed iteration: backward incl. the reduction
    step_s: list[float] = field(default_factory=list)  # per timed iteration: optimizer.step() incl. param sync
    compute_backward_s: float | None = None  # median backward without gradient reduction (DDP-wrapped only)
    comm_bytes_per_step: float | None = 0.0  # None: the variant's collectives are not all counted
    comm_calls_per_step: float = 0.0
    comm_by_function: dict[str, float] = field(default_factory=dict)
    state_bytes: int = 0
    num_params: int = 0
    num_tensors: int = 0
    start_rss_bytes: int = 0
    peak_rss_bytes: int = 0
    model_rss_bytes: int = 0  # resident after the model is built, before the variant (the growth's base)
    peak_growth_bytes: int = 0  # peak resident set during the variant's construction and iterations, over the base
    live_bytes: dict[str, int] = field(default_factory=dict)  # census at the fullest phase of the last iteration
    live_phase: str = ""
    live_by_phase: dict[str, int] = field(default_factory=dict)  # census total after each phase


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _take_census(harness: Harness, before: list[weakref.ref[Tensor]]) -> dict[str, int]:
    return census(harness.tensors(), harness.cpp_buffers(), before)


def _warm_up(variant: Variant) -> None:
    """One iteration of the variant on a tiny model first, so that what it imports and initialises on first use
    (deepspeed.initialize alone imports some 600 modules) is not counted as its memory."""
    variant.prepare()
    tiny = GPT(GPTConfig(vocab=64, context=8, layers=1, width=16, heads=2)).to(variant.dtype)
    harness = variant.setup(tiny, {"lr": 1e-4})
    tokens = torch.zeros(1, 9, dtype=torch.long)
    harness.zero_grad()
    harness.backward(harness.forward(tokens[:, :-1], tokens[:, 1:]))
    if not variant.steps_in_backward:
        harness.step()


def bench_rank(ctx: RankContext, spec: RunSpec) -> RankResult:
    result = RankResult(rank=ctx.rank, start_rss_bytes=_peak_rss_bytes())
    variant = VARIANTS[spec.variant]
    if spec.pin_malloc:  # every allocation over 128 KiB its own mapping, returned on free: RSS follows live memory
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 128 << 10)
    _warm_up(variant)
    torch.manual_seed(0)
    model = GPT(spec.config).to(variant.dtype)
    result.num_params = sum(p.numel() for p in model.parameters())
    result.num_tensors = len(list(model.parameters()))
    generator = torch.Generator().manual_seed(ctx.rank)
    tokens = torch.randint(0, spec.config.vocab, (spec.batch, spec.seq + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    dist.barrier()
    before = tensors_alive()  # the model's parameters, the batch, what the warm-up left
    result.model_rss_bytes = reset_peak()
    harness = variant.setup(model, {"lr": spec.lr})
    counter = CommCounter()
    censuses: dict[str, dict[str, int]] = {}
    last = spec.warmup + spec.iters  # one more, untimed iteration: the census after each phase
    for iteration in range(last + 1):
        timed = spec.warmup <= iteration < last
        begin = time.perf_counter()
        harness.zero_grad()
        loss = harness.forward(inputs, targets)
        forward_s = time.perf_counter() - begin
        if iteration == last:
            censuses["forward"] = _take_census(harness, before)
        dist.barrier()  # backward and step start together: their time is the slowest rank's
        with counter.counting(active=timed):
            begin = time.perf_counter()
            harness.backward(loss)
            middle = time.perf_counter()
            if iteration == last:
                censuses["backward"] = _take_census(harness, before)
                middle = time.perf_counter()
            if not variant.steps_in_backward:
                harness.step()
            end = time.perf_counter()
        if iteration == last:
            censuses["step"] = _take_census(harness, before)
        if timed:
            result.forward_s.append(forward_s)
            result.backward_s.append(middle - begin)
            result.step_s.append(end - middle)
    result.peak_growth_bytes = peak_growth(result.model_rss_bytes)
    result.live_by_phase = {phase: sum(counts.values()) for phase, counts in censuses.items()}
    result.live_phase = max(PHASES, key=lambda phase: result.live_by_phase[phase])
    result.live_bytes = censuses[result.live_phase]
    if harness.no_sync is not None and spec.compute_iters:
        compute = []
        for _ in range(spec.compute_iters):
            harness.model.zero_grad()  # not the optimizer's: an overlap-mode optimizer expects a step between
            with harness.no_sync():
                loss = harness.forward(inputs, targets)
                begin = time.perf_counter()
                harness.backward(loss)
                compute.append(time.perf_counter() - begin)
        result.compute_backward_s = statistics.median(compute)
    _count_bytes(result, counter, variant, spec, ctx.world_size)
    result.state_bytes = censuses["step"]["state"]  # by storage: a DTensor's local shard, not its global size
    result.peak_rss_bytes = max(_peak_rss_bytes(), rss_bytes())
    return result


def _count_bytes(result: RankResult, counter: CommCounter, variant: Variant, spec: RunSpec, world_size: int) -> None:
    if not variant.counts_bytes or not spec.iters:
        result.comm_bytes_per_step = None
        return
    grad_bytes = result.num_params * torch.empty((), dtype=variant.dtype).element_size()
    ddp_bytes = all_reduce_bytes(grad_bytes, world_size) if variant.ddp_cpp_allreduce and world_size > 1 else 0
    result.comm_bytes_per_step = counter.bytes / spec.iters + ddp_bytes
    result.comm_calls_per_step = counter.calls / spec.iters  # Python-level calls only (not DDP's reducer)
    result.comm_by_function = {name: calls / spec.iters for name, calls in counter.by_function.items()}
