"""Soak: a long run of the demo's model with DDP + ZeroRedundancyOptimizer in each mode, watching for leaks and drift.

For each variant (``zero_variants.VARIANTS``: DDP + AdamW as the baseline, then distoptim's ZeRO-1 with and without
bucket views, the even partition, the overlap hooks, ZeRO-2, master weights), ``--world-size`` fresh ranks train
``distoptim.demo``'s GPT (``--size``) for ``--steps`` steps on random tokens, consolidating the optimizer state every
``--consolidate-every`` steps (so the checkpoint path soaks too). Each rank records, after the first ``--window``
steps (warm-up), half-way and at the end: its resident set (VmRSS), its open file descriptors (/proc/self/fd), its
threads (/proc/self/task) and the objects the garbage collector tracks; and the median step time of every window of
``--window`` steps (the table shows the first, the last, and the range over all windows). Each sample is also taken
after ``malloc_trim(0)`` ("trimmed"), without the freed memory glibc keeps for reuse. A leak grows RSS in both halves
alike, trimmed too; a healthy run settles, and keeps descriptors and threads constant.

    .venv/bin/python benchmarks/soak.py                      # 2000 steps per variant, 2 ranks
    .venv/bin/python benchmarks/soak.py --steps 500 --variants distoptim-zero zero2-even-interleaved
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from zero_variants import VARIANTS

from distoptim.demo.config import PRESETS
from distoptim.demo.launch import PRELOAD, RankContext, RankFailure, run_ranks
from distoptim.demo.model import GPT
from distoptim.demo.options import OneLineParser

DEFAULT_VARIANTS = [name for name, variant in VARIANTS.items() if variant.impl != "torch" and variant.family == "ddp"]


@dataclass(frozen=True)
class SoakSpec:
    variant: str
    size: str
    steps: int
    window: int
    batch: int
    consolidate_every: int


@dataclass
class Sample:
    """One rank's process figures at one moment."""

    rss_bytes: int
    trimmed_rss_bytes: int  # after malloc_trim(0): without the freed memory glibc keeps for reuse
    fds: int
    threads: int
    gc_objects: int


@dataclass
class RankSoak:
    rank: int
    warm: Sample | None = None
    mid: Sample | None = None
    end: Sample | None = None
    step_s: list[float] = field(default_factory=list)
    consolidations: int = 0


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return 1024 * next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def _sample() -> Sample:
    gc.collect()
    rss = _rss_bytes()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return Sample(
        rss_bytes=rss,
        trimmed_rss_bytes=_rss_bytes(),
        fds=len(os.listdir("/proc/self/fd")),
        threads=len(os.listdir("/proc/self/task")),
        gc_objects=len(gc.get_objects()),
    )


def soak_rank(ctx: RankContext, spec: SoakSpec) -> RankSoak:
    """Train ``spec.steps`` steps of ``spec.variant``; sample the process after the warm-up window and at the end."""
    variant, config = VARIANTS[spec.variant], PRESETS[spec.size]
    torch.manual_seed(0)
    model = GPT(config).to(variant.dtype)
    variant.prepare()
    harness = variant.setup(model, {"lr": 1e-4})
    ddp, optimizer = harness.model, harness.optimizer
    generator = torch.Generator().manual_seed(ctx.rank)
    result = RankSoak(rank=ctx.rank)
    for step in range(spec.steps):
        tokens = torch.randint(0, config.vocab, (spec.batch, config.context + 1), generator=generator)
        begin = time.perf_counter()
        harness.zero_grad()
        harness.backward(ddp(tokens[:, :-1], tokens[:, 1:]))
        if not variant.steps_in_backward:
            harness.step()
        result.step_s.append(time.perf_counter() - begin)
        # consolidate before the warm sample too, so that rank 0's kept copy is in every sample
        due = spec.consolidate_every and ((step + 1) % spec.consolidate_every == 0 or step + 1 == spec.window)
        if due and hasattr(optimizer, "consolidate_state_dict"):
            optimizer.consolidate_state_dict(to=0)
            if ctx.rank == 0:
                optimizer.state_dict()
            result.consolidations += 1
        if step + 1 in (spec.window, spec.steps // 2):
            setattr(result, "warm" if step + 1 == spec.window else "mid", _sample())
    result.end = _sample()
    return result


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="soak.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="steps per variant (default 2000)")
    parser.add_argument("--window", type=int, default=200, help="warm-up and timing window, steps (default 200)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--size", choices=sorted(PRESETS), default="small", help="the demo's model size")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step (context-long)")
    parser.add_argument("--consolidate-every", type=int, default=500, help="0: never (default 500)")
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=DEFAULT_VARIANTS)
    parser.add_argument("--json", help="write every figure to this file")
    return parser


HEADER = (
    f"{'variant':<29} {'rank':>4} {'RSS warm MB':>11} {'RSS end MB':>10} {'RSS +% (1st half, 2nd)':>23} "
    f"{'trimmed +%':>10} {'fds':>7} {'threads':>7} {'gc objects':>13} {'first ms':>8} {'last ms':>8} "
    f"{'last/first':>10} {'windows ms':>11}"
)


def window_medians_ms(step_s: list[float], window: int) -> list[float]:
    """The median step time of each full window of ``window`` steps, in ms."""
    return [statistics.median(step_s[at : at + window]) * 1e3 for at in range(0, len(step_s) - window + 1, window)]


def _row(name: str, rank: RankSoak, window: int) -> str:
    assert rank.warm is not None and rank.mid is not None and rank.end is not None
    warm, mid, end = rank.warm, rank.mid, rank.end
    medians = window_medians_ms(rank.step_s, window)
    first, last = medians[0], medians[-1]
    growth = 100 * (end.rss_bytes / warm.rss_bytes - 1)
    first_half, second_half = 100 * (mid.rss_bytes / warm.rss_bytes - 1), 100 * (end.rss_bytes / mid.rss_bytes - 1)
    halves = f"{growth:+.2f} ({first_half:+.2f}, {second_half:+.2f})"
    trimmed = 100 * (end.trimmed_rss_bytes / warm.trimmed_rss_bytes - 1)
    spread = f"{min(medians):.0f}-{max(medians):.0f}"
    return (
        f"{name:<29} {rank.rank:>4} {warm.rss_bytes / 1e6:>11.1f} {end.rss_bytes / 1e6:>10.1f} {halves:>23} "
        f"{trimmed:>+10.2f} {f'{warm.fds}->{end.fds}':>7} {f'{warm.threads}->{end.threads}':>7} "
        f"{f'{warm.gc_objects}->{end.gc_objects}':>13} {first:>8.1f} {last:>8.1f} {last / first:>10.2f} {spread:>11}"
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.steps < 4 * args.window:
        print(f"soak.py: error: --steps must be at least 4 x --window ({args.window})", file=sys.stderr)
        return 2
    config = PRESETS[args.size]
    print(
        f"{args.steps} steps per variant, {args.world_size} ranks, GPT {args.size} ({config.num_params / 1e6:.2f}M "
        f"parameters), batch {args.batch} x {config.context} tokens, consolidation every {args.consolidate_every}; "
        f"samples after step {args.window}, {args.steps // 2} and {args.steps}; step times: median of the first and "
        f"last {args.window}",
        flush=True,
    )
    print(HEADER, flush=True)
    results: dict[str, Any] = {"args": vars(args), "variants": {}}
    for name in args.variants:
        spec = SoakSpec(name, args.size, args.steps, args.window, args.batch, args.consolidate_every)
        begin = time.monotonic()
        try:
            ranks: list[RankSoak] = run_ranks(
                soak_rank, args.world_size, (spec,), timeout_s=3600, preload=(*PRELOAD, "zero_variants")
            )
        except RankFailure as failure:
            print(f"{name:<29} failed: {failure}\n{failure.details}", flush=True)
            results["variants"][name] = {"error": str(failure)}
            continue
        for rank in ranks:
            print(_row(name, rank, args.window), flush=True)
        results["variants"][name] = {
            "wall_s": time.monotonic() - begin,
            "ranks": [asdict(r) for r in ranks],
            "window_medians_ms": [window_medians_ms(r.step_s, args.window) for r in ranks],
        }
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
