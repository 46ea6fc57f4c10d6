"""Per-step Python overhead: ZeroRedundancyOptimizer over many small parameters against plain ``torch.optim``.

Over many small parameters a step is mostly Python and per-tensor dispatch, which a GPU cannot hide. Two parts::

    .venv/bin/python benchmarks/step_overhead.py --world-sizes 1 2

**step()**: each rank holds the same ``--params`` small parameters (default 2,000: alternately 32 and 16 x 16
elements) with fixed gradients, a ``ZeroRedundancyOptimizer`` over them, and a plain ``torch.optim`` optimizer (the
same class and settings, ``foreach`` left at its default) over a copy of all of them: the baseline is one process
stepping everything, whatever N is. Each iteration times ``zero.step()`` then ``plain.step()`` (after a barrier); an
iteration's time is the slowest rank's. Printed per mode (sync strategy x partition x optimizer): the medians, their
ratio, and ``zero.step()`` split into its local part, the agreement (``agreement.run_step_agreed``'s all-reduce) and
the parameter sync. At the end both copies of the parameters must agree (checked).

**overlap**: a DDP model holding the same parameters (a residual chain of small linear layers), trained with
``overlap_with_ddp=True`` and ``hook_with_zero_step`` / ``hook_with_zero_step_interleaved``, at a few and at many
DDP buckets (``--buckets``; the count printed is what DDP made), beside DDP + the plain optimizer: the median
iteration (forward, backward with the step inside, slowest rank). All of them are built at once and iterated in
turn, so that they share the machine's load. The overlap stepper's per-backward work should grow
with the parameters, not with buckets x parameters, so its times should barely move with the bucket count.

``--profile`` prints cProfile's top functions of rank 0's ``zero.step()`` per mode, ``--json PATH`` writes every
figure. One thread per rank, gloo over 127.0.0.1 (``distoptim.demo.launch.run_ranks``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distoptim.demo.launch import RankContext, run_ranks

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "SGD": (torch.optim.SGD, {"lr": 0.01}),
    "AdamW": (torch.optim.AdamW, {"lr": 1e-3}),
}
MODES = [
    (sync, partition, optimizer)
    for sync in ("staged", "bucket-view")
    for partition in ("greedy", "even")
    for optimizer in OPTIMIZERS
]


def _shapes(count: int) -> list[tuple[int, ...]]:
    return [(32,) if i % 2 == 0 else (16, 16) for i in range(count)]


def _slowest(*seconds: float) -> list[float]:
    """Each figure's maximum over the ranks, in ms."""
    values = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [value * 1e3 for value in values.tolist()]


def _timed_agreement() -> tuple[dict[str, float], Callable[[], None]]:
    """Wrap ``agreement.run_step_agreed`` to time the local part (the action) and the whole; undo with the callable."""
    from distoptim.comm import agreement

    original = agreement.run_step_agreed
    seen = {"action": 0.0, "agreed": 0.0}

    def timed(action: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        def timed_action() -> Any:
            begin = time.perf_counter()
            try:
                return action()
            finally:
                seen["action"] = time.perf_counter() - begin

        begin = time.perf_counter()
        result = original(timed_action, *args, **kwargs)
        seen["agreed"] = time.perf_counter() - begin
        return result

    agreement.run_step_agreed = timed  # type: ignore[assignment]

    def undo() -> None:
        agreement.run_step_agreed = original

    return seen, undo


def _step_rank(ctx: RankContext, count: int, steps: int, warmup: int, profile: bool) -> dict[str, Any]:
    from distoptim import ZeroRedundancyOptimizer

    results: dict[str, Any] = {}
    seen, undo = _timed_agreement()
    for sync, partition, name in MODES:
        optimizer_class, options = OPTIMIZERS[name]
        generator = torch.Generator().manual_seed(0)
        params = [nn.Parameter(torch.randn(shape, generator=generator)) for shape in _shapes(count)]
        copies = [nn.Parameter(param.detach().clone()) for param in params]
        for param, copy in zip(params, copies):
            param.grad = torch.randn(param.shape, generator=generator)
            copy.grad = param.grad.clone()
        zero = ZeroRedundancyOptimizer(
            params, optimizer_class, parameters_as_bucket_view=sync == "bucket-view", partition=partition, **options
        )
        plain = optimizer_class(copies, **options)
        figures: list[list[float]] = []
        for step in range(warmup + steps):
            dist.barrier()
            begin = time.perf_counter()
            zero.step()
            zero_s = time.perf_counter() - begin
            begin = time.perf_counter()
            plain.step()
            plain_s = time.perf_counter() - begin
            local_s, agreed_s = seen["action"], seen["agreed"]
            slowest = _slowest(zero_s, plain_s, local_s, agreed_s - local_s, zero_s - agreed_s)
            if step >= warmup:
                figures.append(slowest)
        for param, copy in zip(params, copies):
            torch.testing.assert_close(param.detach(), copy.detach(), rtol=1e-6, atol=1e-7)
        medians = [statistics.median(column) for column in zip(*figures)]
        key = f"{sync} {partition} {name}"
        results[key] = dict(zip(("zero", "plain", "local", "agreement", "sync"), medians))
        # Each step's zero and plain times are neighbours in time: their ratio cancels the machine's drifting load.
        results[key]["ratio"] = statistics.median(zero / plain for zero, plain, *_ in figures)
        results[key]["ratio_without_agreement"] = statistics.median(
            (zero - agreement) / plain for zero, plain, _, agreement, _ in figures
        )
        if profile and ctx.rank == 0:
            results[key]["profile"] = _profile(zero.step, steps)
        elif profile:
            for _ in range(steps):
                zero.step()
    undo()
    return results


def _profile(step: Callable[[], Any], steps: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
    return text.getvalue()


class _Chain(nn.Module):
    """``count`` small parameters as a residual chain of 16 x 16 linear layers (weight, bias)."""

    def __init__(self, count: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weights = nn.ParameterList(
            nn.Parameter(torch.randn(16, 16, generator=generator) * 0.1) for _ in range(count // 2)
        )
        self.biases = nn.ParameterList(nn.Parameter(torch.zeros(16)) for _ in range(count // 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for weight, bias in zip(self.weights, self.biases):
            x = x + torch.tanh(x @ weight + bias)
        return x


OVERLAP_VARIANTS = ("ddp + plain SGD", "hook_with_zero_step", "hook_with_zero_step_interleaved")


def _overlap_rank(ctx: RankContext, count: int, steps: int, warmup: int, buckets: list[int]) -> dict[str, Any]:
    """Every (bucket count, variant) built at once and iterated in turn, so all see the same machine load."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from distoptim import ZeroRedundancyOptimizer
    from distoptim.hooks import allreduce_hook, hook_with_zero_step, hook_with_zero_step_interleaved

    total_mb = sum(p.numel() * p.element_size() for p in _Chain(count).parameters()) / 2**20
    batch = torch.randn(8, 16, generator=torch.Generator().manual_seed(ctx.rank))
    runs: list[tuple[str, Any, Any]] = []
    for wanted in buckets:
        for variant in OVERLAP_VARIANTS:
            model = _Chain(count)
            ddp = DDP(model, bucket_cap_mb=total_mb / wanted * 1.001)
            if variant == OVERLAP_VARIANTS[0]:
                optimizer: Any = torch.optim.SGD(model.parameters(), lr=0.01)
            else:
                optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.01)
                wrapper = hook_with_zero_step if variant == OVERLAP_VARIANTS[1] else hook_with_zero_step_interleaved
                ddp.register_comm_hook(None, wrapper(allreduce_hook, ddp, optimizer, step_from_first_backward=True))
            runs.append((f"{wanted} {variant}", ddp, optimizer))
    times: dict[str, list[float]] = {key: [] for key, _, _ in runs}
    for step in range(warmup + steps):
        for key, ddp, optimizer in runs:
            optimizer.zero_grad()
            dist.barrier()
            begin = time.perf_counter()
            ddp(batch).square().mean().backward()  # the overlap hooks step inside
            if isinstance(optimizer, torch.optim.SGD):
                optimizer.step()
            (slowest,) = _slowest(time.perf_counter() - begin)
            if step >= warmup:
                times[key].append(slowest)
    results: dict[str, Any] = {}
    for key, ddp, _ in runs:
        made = len(ddp._get_ddp_logging_data().get("rebuilt_bucket_sizes", "").split(", "))
        baseline = times[f"{key.split(' ', 1)[0]} {OVERLAP_VARIANTS[0]}"]  # the same bucket count, same iterations
        ratio = statistics.median(mine / theirs for mine, theirs in zip(times[key], baseline))
        results[key] = {"buckets": made, "ms": statistics.median(times[key]), "ratio_to_ddp": ratio}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--params", type=int, default=2000, help="number of small parameters")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per mode")
    parser.add_argument("--overlap-steps", type=int, default=15, help="timed iterations per overlap variant")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--buckets", type=int, nargs="+", default=[2, 20, 80], help="DDP bucket counts to aim at")
    parser.add_argument("--skip-step", action="store_true", help="only the overlap part")
    parser.add_argument("--skip-overlap", action="store_true", help="only the step() part")
    parser.add_argument("--profile", action="store_true", help="cProfile of rank 0's zero.step() per mode")
    parser.add_argument("--json", default=None, help="write every figure here")
    args = parser.parse_args()
    report: dict[str, Any] = {"args": vars(args), "step": {}, "overlap": {}}
    for world_size in args.world_sizes:
        if not args.skip_step:
            step_args = (args.params, args.steps, args.warmup, args.profile)
            figures = run_ranks(_step_rank, world_size, step_args, timeout_s=1200)[0]
            report["step"][world_size] = figures
            print(f"\nN={world_size}: step() over {args.params} parameters, median ms (slowest rank)")
            print(
                f"{'mode':<26} {'zero':>7} {'plain':>7} {'ratio':>6} {'w/o agr':>7} | {'local':>7} {'agree':>7} "
                f"{'sync':>7}"
            )
            for mode, row in figures.items():
                print(
                    f"{mode:<26} {row['zero']:7.2f} {row['plain']:7.2f} {row['ratio']:6.2f} "
                    f"{row['ratio_without_agreement']:7.2f} | {row['local']:7.2f} {row['agreement']:7.2f} "
                    f"{row['sync']:7.2f}"
                )
                if "profile" in row:
                    print(row["profile"])
        if not args.skip_overlap:
            overlap_args = (args.params, args.overlap_steps, args.warmup, args.buckets)
            figures = run_ranks(_overlap_rank, world_size, overlap_args, timeout_s=1200)[0]
            report["overlap"][world_size] = figures
            print(f"\nN={world_size}: DDP iteration over {args.params} parameters, median ms (slowest rank)")
            for key, row in figures.items():
                variant = key.split(" ", 1)[1]
                print(f"  {variant:<34} {row['buckets']:4d} buckets {row['ms']:8.2f}  x{row['ratio_to_ddp']:.2f}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)


if __name__ == "__main__":
    main()
