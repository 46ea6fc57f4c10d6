"""Muon + AdamW, sharded, against the peers: DDP + plain torch.optim.Muon/AdamW, DeepSpeed ZeRO-1/2 with its Muon,
FSDP2 + the muon-fsdp2 package, distoptim ZeRO-1 under DDP and ShardedDataParallel (``muon_variants.py``).

Same loop as bench_zero.py (``bench_worker.bench_rank``: fresh gloo ranks, one thread each, the slowest rank's
time per iteration, medians), on GPT-shaped models (21M: width 512, vocab 8192, 4 layers; 110M: 12 layers, width
768, vocab 16384), with each rank's Newton-Schulz calls recorded. Prints, per model and world size N, each
variant's whole iteration and optimizer step (with the sync) against DDP + plain measured in the same run, the NS
work per rank (FLOPs of the orthogonalizations it really ran), per-rank peak memory and optimizer-state bytes, and
then whether distoptim meets issue 31's targets:

- step <= 1.3 x (DDP + plain's step / N);
- whole iteration below every peer's (DDP + plain, DeepSpeed, FSDP2);
- per-rank optimizer state <= 1.05 x (DDP + plain's state / N).

    python benchmarks/bench_muon.py --models 21m 110m --world-sizes 2 4 --json bench-muon.json

(3 warm-up + 5 timed iterations on 21m, 1 + 2 on 110m: its DDP + plain step orthogonalizes 1.5 TFLOP per rank,
half a minute on one CPU core.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from bench_worker import RunSpec
from bench_zero import PRESETS, _cpus, _summarize, preload_benchmarks
from muon_variants import MuonRankResult, muon_rank, ns_flops, split
from zero_variants import MUON, VARIANTS

from distoptim.demo.config import GPTConfig, config_for_params
from distoptim.demo.launch import PRELOAD, RankFailure, run_ranks
from distoptim.demo.model import GPT
from distoptim.demo.options import OneLineParser

PROG = "bench_muon.py"
MB = 1e6
BASELINE = "ddp-muon"
OURS = ("distoptim-zero1-muon", "sdp-muon")
MODELS = ("21m", "110m", "tiny")  # tiny: 0.1M parameters, to check the machinery
STEP_TARGET, STATE_TARGET = 1.3, 1.05


def model_config(name: str, seq: int) -> GPTConfig:
    if name == "110m":
        return GPTConfig(context=seq, **PRESETS["gpt-110m"])
    if name == "tiny":
        return GPTConfig(vocab=256, context=seq, layers=2, width=64, heads=4)
    return config_for_params(20.0, width=512, vocab=8192, context=seq, heads=8)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=["21m", "110m"], help="default: 21m 110m")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], help="default: 2 4")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank per step (default: 1)")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence (default: 32)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations first (default: 3)")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations (default: 5)")
    parser.add_argument("--warmup-110m", type=int, default=1, help="--warmup for the 110m model (default: 1)")
    parser.add_argument("--iters-110m", type=int, default=2, help="--iters for the 110m model (default: 2)")
    parser.add_argument(
        "--variants", nargs="+", choices=list(MUON), default=list(MUON), metavar="NAME", help="default: all"
    )
    parser.add_argument(
        "--compile", action="store_true", help="leave torch.compile on (DeepSpeed's and muon-fsdp2's NS; slow start)"
    )
    parser.add_argument("--json", type=Path, default=Path("bench-muon.json"), help="default: bench-muon.json")
    parser.add_argument("--debug", action="store_true", help="show the ranks' output and tracebacks")
    return parser


def _matrix_shapes(config: GPTConfig) -> set[tuple[int, ...]]:
    with torch.device("meta"):
        matrices, _ = split(GPT(config))
    return {tuple(p.shape) for p in matrices}


def _ns_per_rank(ranks: list[MuonRankResult], shapes: set[tuple[int, ...]], steps: int) -> list[dict[str, float]]:
    """Per rank and step: orthogonalizations of this model's matrices (the tiny warm-up model's left out), FLOPs."""
    out = []
    for rank in ranks:
        mine = [s for s in rank.ns_shapes if s in shapes]
        out.append({"calls": len(mine) / steps, "flops": sum(ns_flops(s) for s in mine) / steps})
    return out


def summarize(
    name: str, world_size: int, model: str, runs: list[MuonRankResult], config: GPTConfig, steps: int
) -> dict[str, Any]:
    """bench_zero.py's summary of one variant's run, plus the Newton-Schulz work and state bytes of each rank."""
    summary = _summarize(name, world_size, [[r.result for r in runs]])
    ns = _ns_per_rank(runs, _matrix_shapes(config), steps)
    flops = [r["flops"] for r in ns]
    return summary | {
        "model": model,
        "ns_calls_by_rank": [r["calls"] for r in ns],
        "ns_flops_by_rank": flops,
        "ns_flops_max": max(flops),
        "ns_flops_total": sum(flops),
        "ns_balance": max(flops) / statistics.mean(flops) if any(flops) else None,
        "state_bytes_by_rank": [r.result.state_bytes for r in runs],
        "peak_growth_bytes_by_rank": [r.result.peak_growth_bytes for r in runs],
    }


HEADER = (
    f"{'model':<5} {'N':>2} {'variant':<21} {'iter ms':>8} {'/ddp':>5} {'step ms':>8} {'/(ddp/N)':>8} "
    f"{'NS GF max':>9} {'NS GF sum':>9} {'NS calls':>12} {'peak MB':>8} {'state MB':>8} {'/(tot/N)':>8}"
)


def with_ratios(summaries: list[dict[str, Any]]) -> None:
    """Add, against DDP + plain of the same model and N: iteration ratio, step over (plain step / N), state over
    (plain state / N)."""
    for s in summaries:
        key = (BASELINE, s["model"], s["world_size"])
        base = next((b for b in summaries if (b["variant"], b["model"], b["world_size"]) == key), None)
        n = s["world_size"]
        s["iteration_over_ddp"] = s["median_iteration_ms"] / base["median_iteration_ms"] if base else None
        s["step_over_ideal"] = s["median_step_ms"] / (base["median_step_ms"] / n) if base else None
        s["state_over_ideal"] = s["state_bytes_max"] / (base["state_bytes_max"] / n) if base else None


def _cell(value: float | None, width: int, digits: int = 2) -> str:
    return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"


def _row(s: dict[str, Any]) -> str:
    calls = "/".join(f"{c:g}" for c in s["ns_calls_by_rank"])
    return (
        f"{s['model']:<5} {s['world_size']:>2} {s['variant']:<21} {s['median_iteration_ms']:>8.1f} "
        f"{_cell(s['iteration_over_ddp'], 5)} {s['median_step_ms']:>8.1f} {_cell(s['step_over_ideal'], 8)} "
        f"{s['ns_flops_max'] / 1e9:>9.2f} {s['ns_flops_total'] / 1e9:>9.2f} {calls:>12} "
        f"{s['peak_growth_bytes_max'] / MB:>8.0f} {s['state_bytes_max'] / MB:>8.1f} {_cell(s['state_over_ideal'], 8)}"
    )


def targets(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 31's three targets for each distoptim variant, per model and N."""
    rows = []
    for s in (s for s in summaries if s["variant"] in OURS):
        peers = [
            p
            for p in summaries
            if (p["model"], p["world_size"]) == (s["model"], s["world_size"]) and p["variant"] not in OURS
        ]
        fastest_peer = min(peers, key=lambda p: p["median_iteration_ms"]) if peers else None
        rows.append(
            {
                "model": s["model"],
                "world_size": s["world_size"],
                "variant": s["variant"],
                "step_over_ideal": s["step_over_ideal"],
                "step_met": s["step_over_ideal"] is not None and s["step_over_ideal"] <= STEP_TARGET,
                "fastest_peer": fastest_peer["variant"] if fastest_peer else None,
                "iteration_over_fastest_peer": (
                    s["median_iteration_ms"] / fastest_peer["median_iteration_ms"] if fastest_peer else None
                ),
                "iteration_met": all(s["median_iteration_ms"] < p["median_iteration_ms"] for p in peers),
                "state_over_ideal": s["state_over_ideal"],
                "state_met": s["state_over_ideal"] is not None and s["state_over_ideal"] <= STATE_TARGET,
            }
        )
    return rows


def _print_targets(rows: list[dict[str, Any]]) -> None:
    print(
        f"\ntargets: step <= {STEP_TARGET} x (plain step / N); whole iteration below every peer's; "
        f"state <= {STATE_TARGET} x (total / N)"
    )
    for r in rows:

        def mark(met: bool) -> str:
            return "met" if met else "MISSED"

        print(
            f"  {r['model']:<4} N={r['world_size']} {r['variant']:<21} step {_cell(r['step_over_ideal'], 5)} "
            f"{mark(r['step_met']):<6}  iteration / fastest peer ({r['fastest_peer']}) "
            f"{_cell(r['iteration_over_fastest_peer'], 5)} {mark(r['iteration_met']):<6}  "
            f"state {_cell(r['state_over_ideal'], 5)} {mark(r['state_met'])}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    from report import _cpu_model, _git_commit  # what the report's captions say of the machine and the code

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    if min(args.iters, args.iters_110m) < 1 or min(args.warmup, args.warmup_110m) < 0 or min(args.world_sizes) < 1:
        parser.error("--iters must be at least 1, --warmup at least 0, every world size at least 1")
    skipped = {name: reason for name in args.variants if (reason := VARIANTS[name].missing()) is not None}
    for name, reason in skipped.items():
        print(f"  {name}: skipped ({reason})", file=sys.stderr, flush=True)
    variants = [name for name in args.variants if name not in skipped]
    cores = f"ranks oversubscribe the cores at N > {_cpus()}" if max(args.world_sizes) > _cpus() else "a core per rank"
    print(
        f"Muon (lr 0.02) on the blocks' 2-D weights + AdamW on the rest; models {' '.join(args.models)}; batch "
        f"{args.batch}x{args.seq} tokens per rank; {args.warmup} warm-up + {args.iters} timed iterations (110m: "
        f"{args.warmup_110m} + {args.iters_110m}); gloo, "
        f"127.0.0.1, 1 thread per rank ({torch.__version__}, {platform.machine()}, {_cpus()} CPUs: "
        f"{cores})",
        flush=True,
    )
    preload_benchmarks()
    summaries: list[dict[str, Any]] = []
    started = time.perf_counter()
    for model in args.models:
        config = model_config(model, args.seq)
        warmup, iters = (args.warmup_110m, args.iters_110m) if model == "110m" else (args.warmup, args.iters)
        print(f"  {model}: {config.num_params / 1e6:.1f}M parameters", file=sys.stderr, flush=True)
        for world_size in args.world_sizes:
            for name in variants:
                print(f"  {model} N={world_size} {name} ...", file=sys.stderr, flush=True)
                spec = RunSpec(name, config, args.batch, args.seq, warmup, iters, 0)
                begin = time.perf_counter()
                try:
                    ranks = run_ranks(
                        muon_rank,
                        world_size,
                        (spec, args.compile),
                        quiet=not args.debug,
                        timeout_s=900,
                        preload=(*PRELOAD, "bench_worker", "muon_variants"),
                    )
                except RankFailure as failure:
                    if args.debug and failure.details:
                        print(failure.details.rstrip(), file=sys.stderr)
                    print(f"{PROG}: {name} at N={world_size} failed: rank {failure.rank}: {failure.summary}")
                    skipped[f"{name}@{model}/N={world_size}"] = f"failed: {failure.summary}"
                    continue
                print(f"    {time.perf_counter() - begin:.1f} s", file=sys.stderr, flush=True)
                summary = summarize(name, world_size, model, ranks, config, warmup + iters + 1)
                summaries.append(summary | {"warmup": warmup, "iters": iters})
    with_ratios(summaries)
    print()
    print(HEADER)
    for s in summaries:
        print(_row(s))
    rows = targets(summaries)
    _print_targets(rows)
    payload = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "command": shlex.join(["python", "benchmarks/bench_muon.py", *argv]),
        "load_average": [load, os.getloadavg()[0]],  # at the start and at the end
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu_model": _cpu_model(),
        "git": _git_commit(),
        "seconds": time.perf_counter() - started,
        "torch": torch.__version__,
        "cpus": _cpus(),
        "results": summaries,
        "targets": rows,
        "skipped": skipped,
    }
    args.json.write_text(json.dumps(payload, indent=1))
    print(f"\nwrote {args.json} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
