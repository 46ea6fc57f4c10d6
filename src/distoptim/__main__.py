"""``python -m distoptim {demo,bench,checkpoint,plan} [options]``: the demo training run, the ZeRO benchmark, a
checkpoint conversion, or the memory planner."""

from __future__ import annotations

import importlib
import runpy
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["main"]

USAGE = """usage: python -m distoptim {demo,bench,checkpoint,plan} [options]

  demo   train a small transformer LM on N local ranks with DDP + ZeroRedundancyOptimizer(AdamW)
  bench  compare DDP + AdamW, torch's ZeroRedundancyOptimizer and distoptim's (runs benchmarks/bench_zero.py;
         needs a source checkout)
  checkpoint  convert a sharded (torch.distributed.checkpoint) optimizer checkpoint to or from torch.optim's format
  plan   bytes per rank (parameters, gradients, optimizer state, master weights) and bytes sent per step for DDP,
         ZeRO-1, ZeRO-2, ShardedDataParallel and FSDP2, and which fit in --gpu-memory

'python -m distoptim demo --help' (bench, plan likewise) explains the options."""

SUBCOMMANDS = {"demo": "distoptim.demo", "checkpoint": "distoptim.checkpoint.convert", "plan": "distoptim.plan.cli"}
BENCH_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_zero.py"


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a subcommand; return the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    command, rest = (args[0], args[1:]) if args else ("", [])
    if command in SUBCOMMANDS:  # imported on use: each pulls in more of the library
        run: Callable[[list[str]], int] = importlib.import_module(SUBCOMMANDS[command]).main
        return run(rest)
    if command == "bench":
        return _bench(rest)
    if command in ("-h", "--help"):
        print(USAGE)
        return 0
    problem = f"unknown command {command!r}" if command else "a command is required"
    print(
        f"python -m distoptim: error: {problem} (choose demo, bench, checkpoint or plan; see --help)", file=sys.stderr
    )
    return 2


def _bench(argv: list[str]) -> int:
    if not BENCH_SCRIPT.is_file():
        print(
            f"python -m distoptim bench: error: {BENCH_SCRIPT} not found; the benchmark lives in a source checkout",
            file=sys.stderr,
        )
        return 2
    sys.argv = [str(BENCH_SCRIPT), *argv]
    sys.path.insert(0, str(BENCH_SCRIPT.parent))
    try:
        runpy.run_path(str(BENCH_SCRIPT), run_name="__main__")
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
