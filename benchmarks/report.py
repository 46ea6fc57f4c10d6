"""The benchmark report: DDP + AdamW, torch's ZeroRedundancyOptimizer (both bucket-view settings), every distoptim
mode and the peers (FSDP2, DeepSpeed ZeRO-1/2, distoptim's ShardedDataParallel), measured on this machine in one
run, written as Markdown + PNG plots (matplotlib: ``pip install -e .[bench]``; DeepSpeed: ``.[peers]``).

    .venv/bin/python benchmarks/report.py --out docs/report                    # full report
    .venv/bin/python benchmarks/report.py --out docs/report --world-sizes 2 4 8
    .venv/bin/python benchmarks/report.py --quick --out /tmp/report            # tiny model, 2 ranks, a minute

Each part comes from the script that measures it: step time, whole iteration, optimizer-state shards and bytes per
variant from bench_zero.py (every variant of zero_variants.py, fresh ranks each); per-rank memory of every sharded
data-parallel configuration from bench_zero.py --memory-only (glibc's mmap threshold pinned, so that resident memory
follows live tensors), on the same model and on a 110M-parameter GPT at 4 ranks; per-rank memory of parameters,
gradients, optimizer state and master weights from memory_master.py; the partition balance for GPT-2 124M shapes
from partition_balance.py (arithmetic); Muon + AdamW against the peers from bench_muon.py (``--skip-muon`` leaves
it out, ``--muon-json`` takes an earlier run's JSON). Everything lands in OUT: report.json (all figures, bench_zero's
JSON inside), seven PNGs and REPORT.md; ``--from-json OUT/report.json`` redraws them without measuring again.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(HERE) not in sys.path:  # the benchmark scripts import each other by module name
    sys.path.insert(0, str(HERE))

QUICK = ["--layers", "1", "--width", "64", "--vocab", "512", "--seq", "16", "--warmup", "1", "--iters", "2"]
QUICK += ["--compute-iters", "1"]
# The sharded data-parallel configurations whose whole iteration and per-rank memory the peers section compares
# (torch-zero-bucket is the reference); --quick runs one of each peer family.
MEMORY_VARIANTS = [
    "ddp-adamw", "torch-zero-bucket", "distoptim-zero-bucket", "distoptim-even-bucket", "zero2-even-bucket",
    "sdp", "sdp-overlap", "fsdp2-zero2", "fsdp2-zero3", "deepspeed-zero1", "deepspeed-zero2",
]  # fmt: skip
QUICK_PEERS = ["sdp", "fsdp2-zero2", "deepspeed-zero2"]
LARGE_PRESET, LARGE_WORLD_SIZE = "gpt-110m", 4  # the per-rank memory target: >= 100M fp32 parameters, 4 ranks
# Muon + AdamW against the peers (bench_muon.py): both models at every N; --quick: a tiny model, no peers
MUON = ["--models", "21m", "110m"]  # bench_muon.py's iterations: 3 + 5 on 21m, 1 + 2 on 110m
MUON_QUICK = ["--models", "tiny", "--warmup", "0", "--iters", "1", "--variants", "ddp-muon", "distoptim-zero1-muon"]
MUON_QUICK += ["sdp-muon"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="report.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "report", help="default: docs/report")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], help="default: 2 4 (8 if you add it)")
    parser.add_argument("--params-millions", type=float, default=20.0, help="model size target (default: 20)")
    for name in ("layers", "width", "vocab", "seq", "batch"):
        parser.add_argument(f"--{name}", type=int, default=None, help=f"passed to bench_zero.py (default: its {name})")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations per variant (default: 3)")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per variant (default: 10)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the variant list, alternating (default: 1)")
    parser.add_argument(
        "--quick", action="store_true", help="a tiny model at world size 2, 2 timed iterations: checks the machinery"
    )
    parser.add_argument(
        "--skip-large", action="store_true", help=f"skip the memory pass on {LARGE_PRESET} at N={LARGE_WORLD_SIZE}"
    )
    parser.add_argument("--skip-muon", action="store_true", help="skip the Muon + AdamW section (bench_muon.py)")
    parser.add_argument(
        "--muon-json", type=Path, default=None, help="take the Muon section from this bench_muon.py JSON, not a run"
    )
    parser.add_argument("--from-json", type=Path, default=None, help="redraw from a report.json; measure nothing")
    parser.add_argument("--debug", action="store_true", help="show the ranks' output and tracebacks")
    return parser


def command_line(argv: Sequence[str]) -> str:
    """The command as typed from the repository root, for the report's captions."""
    script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else HERE / "report.py"
    try:
        shown = str(script.relative_to(ROOT))
    except ValueError:
        shown = str(script)
    return shlex.join(["python", shown, *argv])


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True)
    except OSError:
        return "unknown"
    return head.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "") or "unknown"


def machine_info(command: str) -> dict[str, Any]:
    """What every figure states: the machine, the versions, the backend, the date and the command."""
    import torch

    import distoptim

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {
        "cpus": cpus,
        "cpu_model": _cpu_model(),
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "torch": str(torch.__version__),
        "distoptim": distoptim.__version__,
        "git": _git_commit(),
        "python": platform.python_version(),
        "backend": "gloo over 127.0.0.1, one thread per rank (CPU)",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
    }


def _bench_argv(args: argparse.Namespace, json_path: Path) -> list[str]:
    argv = ["--world-sizes", *map(str, args.world_sizes), "--rounds", str(args.rounds), "--json", str(json_path)]
    argv += ["--debug"] if args.debug else []
    if args.quick:
        import zero_variants

        return [*argv, *QUICK, "--variants", *zero_variants.CORE, *QUICK_PEERS]
    argv += ["--params-millions", str(args.params_millions), "--warmup", str(args.warmup), "--iters", str(args.iters)]
    for name in ("layers", "width", "vocab", "seq", "batch"):
        argv += [f"--{name}", str(getattr(args, name))] if getattr(args, name) is not None else []
    return [*argv, "--with-peers"]


def _bench(argv: list[str], json_path: Path) -> dict[str, Any]:
    """Run bench_zero.py with ``argv`` (which names ``json_path``) and return its JSON."""
    import bench_zero

    status = bench_zero.main(argv)
    if status != 0:
        raise SystemExit(f"report.py: bench_zero.py failed (exit {status}); rerun with --debug")
    data: dict[str, Any] = json.loads(json_path.read_text())
    json_path.unlink()  # its content goes into report.json
    return data


def _memory_argv(bench_argv: list[str], args: argparse.Namespace) -> list[str]:
    """The timing run's command as a memory-only run of the peers section's configurations."""
    shown = [name for name in MEMORY_VARIANTS if not args.quick or name == "torch-zero-bucket" or name in QUICK_PEERS]
    cut = bench_argv.index("--variants") if "--variants" in bench_argv else len(bench_argv)
    kept = [a for a in bench_argv[:cut] if a != "--with-peers"]
    return [*kept, "--rounds", "1", "--memory-only", "--variants", *shown]


def measure(args: argparse.Namespace, machine: dict[str, Any]) -> dict[str, Any]:
    """Run bench_zero.py (timing, then memory-only passes), memory_master.py and partition_balance.py; return every
    figure as plain data."""
    import memory_master
    import partition_balance

    from distoptim.demo.config import GPTConfig

    args.out.mkdir(parents=True, exist_ok=True)
    bench_json = args.out / "bench_zero.json"
    started = time.perf_counter()
    print(f"== step time, whole iteration, state shards and bytes: bench_zero.py at N = {args.world_sizes}", flush=True)
    bench_argv = _bench_argv(args, bench_json)
    bench = _bench(bench_argv, bench_json)
    print(f"== per-rank memory of the sharded configurations, same model ({_since(started)})", flush=True)
    peers_memory = {"same_model": _bench(_memory_argv(bench_argv, args), bench_json), "large": None}
    if not (args.quick or args.skip_large):
        print(f"== per-rank memory, {LARGE_PRESET} at N = {LARGE_WORLD_SIZE} ({_since(started)})", flush=True)
        large = ["--preset", LARGE_PRESET, "--world-sizes", str(LARGE_WORLD_SIZE), "--json", str(bench_json)]
        shown = [name for name in MEMORY_VARIANTS if name != "ddp-adamw"]  # unsharded: 20 bytes per parameter
        argv = [*large, "--memory-only", "--variants", *shown, *(["--debug"] if args.debug else [])]
        peers_memory["large"] = _bench(argv, bench_json)
    shape = GPTConfig(**bench["config"])
    print(f"== per-rank memory: memory_master.py at N = {args.world_sizes} ({_since(started)})", flush=True)
    memory: dict[str, dict[str, dict[str, float]]] = {}
    for world_size in args.world_sizes:
        memory[str(world_size)] = {
            config: memory_master.measure(world_size, config, shape) for config in memory_master.CONFIGS
        }
    print(f"== partition balance, GPT-2 124M shapes, arithmetic ({_since(started)})", flush=True)
    numels = partition_balance.gpt2_124m_numels()
    muon = None if args.skip_muon else _muon(args, started)
    return {
        "machine": machine,
        "quick": args.quick,
        "world_sizes": args.world_sizes,
        "bench": bench,
        "peers_memory": peers_memory,
        "memory": memory,
        "memory_configs": memory_master.CONFIGS,
        "balance": {
            "world_sizes": list(partition_balance.WORLD_SIZES),
            "num_params": sum(numels),
            "num_tensors": len(numels),
            "ratios": partition_balance.balance(numels),
        },
        "muon": muon,
        "seconds": time.perf_counter() - started,
    }


def _muon(args: argparse.Namespace, started: float) -> dict[str, Any]:
    """bench_muon.py's JSON: from ``--muon-json``, or measured now (Muon + AdamW against the peers)."""
    if args.muon_json is not None:
        loaded: dict[str, Any] = json.loads(args.muon_json.read_text())
        return loaded
    import bench_muon

    path = args.out / "bench_muon.json"
    argv = [*(MUON_QUICK if args.quick else MUON), "--world-sizes", *map(str, args.world_sizes), "--json", str(path)]
    print(f"== Muon + AdamW against the peers: bench_muon.py {' '.join(argv)} ({_since(started)})", flush=True)
    if bench_muon.main([*argv, *(["--debug"] if args.debug else [])]) != 0:
        raise SystemExit("report.py: bench_muon.py failed; rerun with --debug")
    data: dict[str, Any] = json.loads(path.read_text())
    path.unlink()  # its content goes into report.json
    return data


def _since(started: float) -> str:
    return f"{time.perf_counter() - started:.0f} s so far"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.world_sizes, args.rounds = [2], 1
    if any(n < 2 for n in args.world_sizes):
        parser.error(f"--world-sizes must all be at least 2, got {args.world_sizes}")
    try:
        import report_markdown
        import report_plots
    except ImportError as error:
        parser.error(f"{error.name} is not installed; the report needs matplotlib: pip install -e '.[bench]'")
    if args.from_json is not None:
        data = json.loads(args.from_json.read_text())
        if args.muon_json is not None:  # an earlier report with the Muon section from its own run
            data["muon"] = json.loads(args.muon_json.read_text())
    else:
        data = measure(args, machine_info(command_line(argv)))
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.json").write_text(json.dumps(data, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    written = report_plots.render_all(data, args.out)
    written.append(report_markdown.write(data, args.out))
    print("wrote " + ", ".join(str(path) for path in written), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
