"""``python -m distoptim demo``: check the options, spawn the ranks, print the closing table or a one-line error."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from distoptim.demo.config import PRESETS
from distoptim.demo.launch import RankFailure, run_ranks
from distoptim.demo.options import PROG, DemoOptions, parse_options
from distoptim.demo.report import format_bytes, format_table
from distoptim.demo.train import train_rank

__all__ = ["main"]


def main(argv: Sequence[str] | None = None, *, rank_fn: Callable[..., Any] | None = None) -> int:
    """Run the demo; return the exit status (0, 1 if a rank failed, 2 for bad options, 130 if interrupted).

    ``rank_fn`` replaces the training function (a module-level function taking ``(RankContext, DemoOptions)``);
    tests use it to make a rank fail.
    """
    options = parse_options(argv)  # exits with a one-line error on a bad option, before any rank is spawned
    print(_banner(options), flush=True)
    started = time.perf_counter()
    try:
        reports = run_ranks(
            rank_fn or train_rank, options.world_size, (options,), port=options.port, quiet=not options.debug
        )
    except RankFailure as failure:
        if options.debug and failure.details:
            print(failure.details.rstrip(), file=sys.stderr)
        hint = "" if options.debug else " (rerun with --debug for the traceback)"
        print(f"{PROG}: error: rank {failure.rank} failed: {failure.summary}{hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130
    print()
    print(format_table(reports))
    print(f"\ndone in {time.perf_counter() - started:.1f} s (including start-up of {options.world_size} rank(s))")
    return 0


def _banner(options: DemoOptions) -> str:
    config = PRESETS[options.size]
    return (
        f"distoptim demo: {options.world_size} rank(s) on this machine (gloo, 127.0.0.1, CPU), "
        f"DDP + ZeroRedundancyOptimizer(AdamW)\n"
        f"model: {options.size} transformer LM, {config.num_params / 1e6:.2f}M parameters "
        f"({config.layers} layer(s), width {config.width}, context {config.context}); "
        f"{options.steps} steps of {options.batch} sequences per rank\n"
        f"text: {format_bytes(options.text_bytes)} from {options.text}"
    )
