"""ZeRO benchmark: DDP + AdamW, torch's ZeroRedundancyOptimizer and distoptim's, side by side, on N local ranks.

Every variant (``zero_variants.VARIANTS``) runs in freshly spawned ranks (gloo over 127.0.0.1, one thread each)
on the same GPT-shaped parameter set and the same fixed batch. Per timed iteration: forward (not timed), barrier,
then ``loss.backward()`` (DDP all-reduces the gradients during it) and ``optimizer.step()`` (for ZeRO: the local
AdamW step on this rank's shard, then the parameter sync). The reported time is the median over iterations of the
slowest rank's time. See benchmarks/README.md for the columns and the byte-counting convention.

    python benchmarks/bench_zero.py --world-sizes 2 4 --params-millions 20 --iters 10 --json bench-results.json
    python benchmarks/bench_zero.py --with-peers ...          # + FSDP2, DeepSpeed, distoptim's ShardedDataParallel
    python benchmarks/bench_zero.py --preset gpt-110m --world-sizes 4 --memory-only --with-peers

Every variant also reports its whole iteration (zero_grad + forward + backward + step) and its per-rank memory:
the peak resident growth from just before the variant is built, and the live tensor bytes (parameters, gradients,
optimizer state, master copies, buffers) at the fullest point of an extra, untimed iteration (memory_census.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from bench_worker import RankResult, RunSpec, bench_rank
from zero_variants import CORE, PEERS, VARIANTS

from distoptim.demo.config import GPTConfig, config_for_params
from distoptim.demo.launch import PRELOAD, RankFailure, run_ranks
from distoptim.demo.options import OneLineParser

PROG = "bench_zero.py"
MB = 1e6
# --preset: named model shapes (``gpt-110m``: a GPT-2-small-sized model for the per-rank memory target)
PRESETS = {"gpt-110m": {"vocab": 16384, "layers": 12, "width": 768, "heads": 12}}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], help="default: 2 4")
    parser.add_argument("--params-millions", type=float, default=20.0, help="model size target (default: 20)")
    parser.add_argument("--width", type=int, default=512, help="model width (default: 512)")
    parser.add_argument("--layers", type=int, default=None, help="layers (default: as --params-millions implies)")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary (default: 8192)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank per step (default: 1)")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence (default: 32)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations first (default: 3)")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations (default: 10)")
    parser.add_argument("--compute-iters", type=int, default=3, help="no_sync backward passes (default: 3)")
    parser.add_argument(
        "--rounds", type=int, default=1, help="run the variant list this many times, alternating order (default: 1)"
    )
    parser.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), default=None, metavar="NAME", help="default: the DDP ones"
    )
    parser.add_argument(
        "--with-peers", action="store_true", help="add FSDP2, DeepSpeed and distoptim's ShardedDataParallel"
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None, help="a named model shape (gpt-110m)")
    parser.add_argument(
        "--memory-only",
        action="store_true",
        help="for memory: 1 iteration (+ the census one), no compute pass, glibc's mmap threshold pinned",
    )
    parser.add_argument("--json", type=Path, default=Path("bench-results.json"), help="default: bench-results.json")
    parser.add_argument("--debug", action="store_true", help="show the ranks' output and tracebacks")
    return parser


def _config(args: argparse.Namespace) -> GPTConfig:
    context = max(args.seq, 1)
    if args.preset is not None:
        return GPTConfig(context=context, **PRESETS[args.preset])
    if args.layers is not None:
        return GPTConfig(vocab=args.vocab, context=context, layers=args.layers, width=args.width, heads=8)
    return config_for_params(args.params_millions, width=args.width, vocab=args.vocab, context=context, heads=8)


def preload_benchmarks() -> None:
    """Let the ranks' fork server import the benchmark modules once (``preload``), not every rank again.

    The fork server starts as a fresh interpreter with this environment; on Python 3.11 it ignores this
    process's ``sys.path``, so without the directory on ``PYTHONPATH`` the preload of ``bench_worker`` fails
    silently and each rank imports it, torch.distributed.optim included (about 0.6 s of CPU per rank).
    """
    here = str(Path(__file__).resolve().parent)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if here not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([here, *filter(None, paths)])


def _run(spec: RunSpec, world_size: int, debug: bool) -> list[RankResult]:
    preload_benchmarks()
    results: list[RankResult] = run_ranks(
        bench_rank, world_size, (spec,), quiet=not debug, timeout_s=600, preload=(*PRELOAD, "bench_worker")
    )
    return results


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else float("nan")


def _summarize(name: str, world_size: int, runs: list[list[RankResult]]) -> dict[str, Any]:
    """Per-iteration slowest rank, medians over all iterations of all rounds; memory of the largest rank."""
    variant = VARIANTS[name]

    def slowest(*parts: str) -> list[float]:
        return [
            max(sum(phases) for phases in iteration)
            for ranks in runs
            for iteration in zip(*(zip(*(getattr(r, part) for part in parts)) for r in ranks))
        ]

    total, iteration = slowest("backward_s", "step_s"), slowest("forward_s", "backward_s", "step_s")
    ranks = runs[-1]
    first = ranks[0]
    unsharded = 2 * 4 * first.num_params + 4 * first.num_tensors  # fp32 exp_avg + exp_avg_sq, a step scalar each
    compute = [r.compute_backward_s for rs in runs for r in rs if r.compute_backward_s is not None]
    fullest = max((r for rs in runs for r in rs), key=lambda r: sum(r.live_bytes.values()))
    counted = [r.comm_bytes_per_step for r in ranks if r.comm_bytes_per_step is not None]
    return {
        "variant": name,
        "impl": variant.impl,
        "setting": variant.setting,
        "family": variant.family,
        "world_size": world_size,
        "median_total_ms": _median_ms(total),
        "median_iteration_ms": _median_ms(iteration),
        "median_forward_ms": _median_ms(slowest("forward_s")),
        "median_backward_ms": _median_ms(slowest("backward_s")),
        "median_step_ms": _median_ms(slowest("step_s")),
        "compute_backward_ms": statistics.median(compute) * 1e3 if compute else None,
        "comm_bytes_per_rank_per_step": statistics.mean(counted) if len(counted) == len(ranks) else None,
        "comm_calls_per_step": max(r.comm_calls_per_step for r in ranks),
        "comm_calls_by_function": first.comm_by_function,
        "state_bytes_max": max(r.state_bytes for r in ranks),
        "state_bytes_min": min(r.state_bytes for r in ranks),
        "state_bytes_ideal": unsharded / world_size,
        "state_bytes_unsharded": unsharded,
        "peak_rss_bytes_max": max(r.peak_rss_bytes for rs in runs for r in rs),
        "start_rss_bytes_max": max(r.start_rss_bytes for rs in runs for r in rs),
        "model_rss_bytes_max": max(r.model_rss_bytes for rs in runs for r in rs),
        "peak_growth_bytes_max": max(r.peak_growth_bytes for rs in runs for r in rs),
        "peak_growth_bytes_by_rank": [r.peak_growth_bytes for r in ranks],
        "live_bytes": fullest.live_bytes,  # the rank and round with the most live bytes, by category
        "live_phase": fullest.live_phase,
        "live_by_phase": fullest.live_by_phase,
        "num_params": first.num_params,
        "total_ms_per_iteration": [t * 1e3 for t in total],
        "iteration_ms_per_iteration": [t * 1e3 for t in iteration],
    }


HEADER = (
    f"{'N':>2} {'variant':<29} {'iter ms':>8} {'total ms':>8} {'net ms':>7} {'bwd ms':>7} {'step ms':>7} "
    f"{'comm MB':>8} {'calls':>6} {'state MB':>8} {'ideal MB':>8} {'peak MB':>8} {'live MB':>8}"
)


def _mb_or_dash(value: float | None, width: int) -> str:
    return f"{value / MB:>{width}.1f}" if value is not None else f"{'-':>{width}}"


def _row(s: dict[str, Any]) -> str:
    compute = s["compute_backward_ms"]
    net = f"{s['median_total_ms'] - compute:>7.1f}" if compute is not None else f"{'-':>7}"
    return (
        f"{s['world_size']:>2} {s['variant']:<29} {s['median_iteration_ms']:>8.1f} {s['median_total_ms']:>8.1f} "
        f"{net} {s['median_backward_ms']:>7.1f} {s['median_step_ms']:>7.1f} "
        f"{_mb_or_dash(s['comm_bytes_per_rank_per_step'], 8)} {s['comm_calls_per_step']:>6.0f} "
        f"{s['state_bytes_max'] / MB:>8.1f} {s['state_bytes_ideal'] / MB:>8.1f} "
        f"{s['peak_growth_bytes_max'] / MB:>8.0f} {sum(s['live_bytes'].values()) / MB:>8.0f}"
    )


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return None if ours is None or not theirs else ours / theirs


def compare(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """distoptim against torch for each (world size, setting) both ran: time and bytes ratios."""
    pairs = []
    for ours in (s for s in summaries if s["impl"] == "distoptim"):
        for theirs in summaries:
            if theirs["impl"] == "torch" and (theirs["world_size"], theirs["setting"]) == (
                ours["world_size"],
                ours["setting"],
            ):
                pairs.append(
                    {
                        "world_size": ours["world_size"],
                        "setting": ours["setting"],
                        "time_ratio": ours["median_total_ms"] / theirs["median_total_ms"],
                        "step_time_ratio": ours["median_step_ms"] / theirs["median_step_ms"],
                        "bytes_ratio": _ratio(
                            ours["comm_bytes_per_rank_per_step"], theirs["comm_bytes_per_rank_per_step"]
                        ),
                    }
                )
    return pairs


def best(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per world size: the fastest distoptim configuration against torch's fastest and against DDP + AdamW."""
    rows = []
    for world_size in sorted({s["world_size"] for s in summaries}):
        here = [s for s in summaries if s["world_size"] == world_size]
        ours = [s for s in here if s["family"] != "peer" and s["impl"] not in ("torch", "baseline")]
        theirs = [s for s in here if s["impl"] == "torch"]
        ddp = [s for s in here if s["impl"] == "baseline"]
        if not ours:
            continue
        fastest = min(ours, key=lambda s: s["median_total_ms"])
        row = {"world_size": world_size, "ours": fastest["variant"], "ours_ms": fastest["median_total_ms"]}
        row["state_over_ideal"] = {s["variant"]: s["state_bytes_max"] / s["state_bytes_ideal"] for s in here}
        row["bytes_over_ddp"] = {
            s["variant"]: _ratio(s["comm_bytes_per_rank_per_step"], ddp[0]["comm_bytes_per_rank_per_step"])
            for s in here
            if ddp and s["comm_bytes_per_rank_per_step"] is not None
        }
        if theirs:
            torch_best = min(theirs, key=lambda s: s["median_total_ms"])
            row |= {
                "torch": torch_best["variant"],
                "time_over_torch": fastest["median_total_ms"] / torch_best["median_total_ms"],
            }
        if ddp:
            row["time_over_ddp"] = fastest["median_total_ms"] / ddp[0]["median_total_ms"]
        rows.append(row)
    return rows


REFERENCE = "torch-zero-bucket"  # what the whole-iteration time and the per-rank memory are divided by


def against_reference(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per variant and world size: whole iteration, peak resident growth and live bytes over ``REFERENCE``'s."""
    rows = []
    for s in summaries:
        ref = next((r for r in summaries if r["variant"] == REFERENCE and r["world_size"] == s["world_size"]), None)
        live = sum(s["live_bytes"].values())
        rows.append(
            {
                "variant": s["variant"],
                "world_size": s["world_size"],
                "iteration_ms": s["median_iteration_ms"],
                "peak_growth_bytes": s["peak_growth_bytes_max"],
                "live_bytes": live,
                "iteration_ratio": _ratio(s["median_iteration_ms"], ref["median_iteration_ms"]) if ref else None,
                "peak_growth_ratio": _ratio(s["peak_growth_bytes_max"], ref["peak_growth_bytes_max"]) if ref else None,
                "live_ratio": _ratio(live, sum(ref["live_bytes"].values())) if ref else None,
            }
        )
    return rows


def _print_against_reference(summaries: list[dict[str, Any]]) -> None:
    rows = against_reference(summaries)
    if all(row["iteration_ratio"] is None for row in rows):
        return
    print(f"\nover {REFERENCE} (same N):          whole iteration   peak RSS growth   live tensor bytes")
    for row in rows:
        cells = [row["iteration_ratio"], row["peak_growth_ratio"], row["live_ratio"]]
        print(
            f"  N={row['world_size']} {row['variant']:<29}"
            + "".join(f"{value:>16.2f}" if value is not None else f"{'-':>16}" for value in cells)
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("iters", "warmup", "batch", "seq", "rounds", "width", "vocab"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            parser.error(f"--{name} is too small: {getattr(args, name)}")
    if any(n < 1 for n in args.world_sizes):
        parser.error(f"--world-sizes must all be at least 1, got {args.world_sizes}")
    if args.params_millions <= 0:
        parser.error("--params-millions must be positive")
    try:
        config = _config(args)
    except ValueError as error:
        parser.error(str(error))
    if args.memory_only:  # one step allocates the state, the census iteration then runs in the steady state
        args.warmup, args.iters, args.compute_iters = 0, 1, 0
    if args.variants is None:
        args.variants = list(CORE) + (list(PEERS) if args.with_peers else [])
    skipped = {name: reason for name in args.variants if (reason := VARIANTS[name].missing()) is not None}
    for name, reason in skipped.items():
        print(f"  {name}: skipped ({reason})", file=sys.stderr, flush=True)
    args.variants = [name for name in args.variants if name not in skipped]
    print(
        f"GPT-shaped parameter set: {config.num_params / 1e6:.1f}M fp32 parameters ({config.layers} layers, width "
        f"{config.width}, vocab {config.vocab}); batch {args.batch}x{args.seq} tokens per rank; "
        f"{args.warmup} warm-up + {args.iters} timed iterations; gloo, 127.0.0.1, 1 thread per rank "
        f"({torch.__version__}, {platform.machine()}, {_cpus()} CPUs)",
        flush=True,
    )
    summaries = []
    started = time.perf_counter()
    for world_size in args.world_sizes:
        runs: dict[str, list[list[RankResult]]] = {name: [] for name in args.variants}
        for round_ in range(args.rounds):
            order = args.variants if round_ % 2 == 0 else list(reversed(args.variants))
            for name in order:
                print(f"  N={world_size} {name} (round {round_ + 1}/{args.rounds}) ...", file=sys.stderr, flush=True)
                spec = RunSpec(
                    name, config, args.batch, args.seq, args.warmup, args.iters, args.compute_iters,
                    pin_malloc=args.memory_only,
                )  # fmt: skip
                try:
                    begin = time.perf_counter()
                    runs[name].append(_run(spec, world_size, args.debug))
                    print(f"    {time.perf_counter() - begin:.1f} s", file=sys.stderr, flush=True)
                except RankFailure as failure:
                    if args.debug and failure.details:
                        print(failure.details.rstrip(), file=sys.stderr)
                    print(
                        f"{PROG}: error: {name} at N={world_size}: rank {failure.rank}: {failure.summary}",
                        file=sys.stderr,
                    )
                    return 1
        summaries += [_summarize(name, world_size, runs[name]) for name in args.variants]
    print()
    print(HEADER)
    for world_size in args.world_sizes:
        for summary in (s for s in summaries if s["world_size"] == world_size):
            print(_row(summary))
    pairs = compare(summaries)
    if pairs:
        print("\ndistoptim / torch (same setting):  total time    step+sync time    bytes")
        for pair in pairs:
            print(
                f"  N={pair['world_size']} {pair['setting']:<20} {pair['time_ratio']:>10.3f} "
                f"{pair['step_time_ratio']:>14.3f} {pair['bytes_ratio']:>12.3f}"
            )
    _print_against_reference(summaries)
    fastest = best(summaries)
    for row in fastest:
        print(
            f"\nN={row['world_size']}: fastest distoptim: {row['ours']} ({row['ours_ms']:.1f} ms)"
            + (f", / torch's fastest ({row['torch']}): {row['time_over_torch']:.3f}" if "torch" in row else "")
            + (f", / DDP + AdamW: {row['time_over_ddp']:.3f}" if "time_over_ddp" in row else "")
        )
        print("  largest state shard / ideal: " + ", ".join(f"{k} {v:.2f}" for k, v in row["state_over_ideal"].items()))
        if row["bytes_over_ddp"]:
            print(
                "  bytes / DDP's all-reduce:    " + ", ".join(f"{k} {v:.2f}" for k, v in row["bytes_over_ddp"].items())
            )
    payload = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "config": asdict(config),
    }
    payload |= {
        "torch": torch.__version__,
        "cpus": _cpus(),
        "results": summaries,
        "comparisons": pairs,
        "best": fastest,
        "skipped": skipped,
        "reference": REFERENCE,
    }
    args.json.write_text(json.dumps(payload, indent=1))
    print(f"\nwrote {args.json} ({time.perf_counter() - started:.0f} s)")
    return 0


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


if __name__ == "__main__":
    sys.exit(main())
