"""The demo's command line: options, their checks, and one-line errors (before any rank is spawned)."""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from distoptim.demo.config import PRESETS
from distoptim.demo.launch import port_is_free
from distoptim.demo.source import TextSourceError, check_text_source, default_text_source, min_text_bytes

__all__ = ["PROG", "DemoOptions", "OneLineParser", "build_parser", "checkpoint_step", "parse_options"]

PROG = "python -m distoptim demo"


@dataclass(frozen=True)
class DemoOptions:
    world_size: int
    steps: int
    size: str
    batch: int
    lr: float
    text: str
    text_bytes: int
    port: int | None
    seed: int
    debug: bool
    checkpoint: str | None = None
    checkpoint_every: int = 0
    resume: str | None = None
    state_format: str = "fp32"


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (exit status 2), without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog=PROG,
        description=(
            "Train a small transformer language model on N local ranks (processes on this machine, gloo over "
            "127.0.0.1, CPU) with DistributedDataParallel + distoptim.ZeroRedundancyOptimizer(AdamW): DDP averages "
            "the gradients, each rank keeps and updates only its shard of AdamW's state, then the updated "
            "parameters are broadcast. The text is read byte by byte (by default the Python standard library's "
            "own source files). Rank 0 shows a progress bar; the run ends with a table of loss, optimizer-state "
            "bytes per rank against unsharded AdamW, and step time. The defaults take about a minute on 2 cores."
        ),
    )
    parser.add_argument("--world-size", "-n", type=int, default=2, help="number of ranks to spawn (default: 2)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default: 300)")
    parser.add_argument(
        "--size",
        choices=list(PRESETS),
        default="small",
        help="model size: tiny, small (default, ~0.9M), medium (~4.9M)",
    )
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank per step (default: 16)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of AdamW (default: 3e-3)")
    parser.add_argument(
        "--text",
        type=Path,
        default=None,
        help="a text file, or a directory whose *.py files are read (default: the standard library's directory)",
    )
    parser.add_argument(
        "--port", type=int, default=None, help="TCP port on 127.0.0.1 for rendezvous (default: a free one)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for the initial model and the batches (default: 0)")
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="save model, optimizer (sharded), LR schedule and step into DIR/step-N at the end (and see below)",
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=0, help="also save every this many steps (default: 0, at the end only)"
    )
    parser.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="continue from a DIR/step-N that --checkpoint wrote, up to --steps in all",
    )
    parser.add_argument(
        "--state-format",
        choices=("fp32", "bf16", "int8"),
        default="fp32",
        help="ZeroRedundancyOptimizer's state_format: AdamW's moments in fp32 (default), bf16 or int8",
    )
    parser.add_argument("--debug", action="store_true", help="show the ranks' tracebacks and logs on failure")
    return parser


def checkpoint_step(path: Path) -> int:
    """The step a ``--checkpoint`` checkpoint was written after, read in this process (no ranks needed)."""
    state = {"step": 0}
    with warnings.catch_warnings():  # DCP warns that it loads without a process group: that is the intent here
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return state["step"]


def parse_options(argv: Sequence[str] | None = None) -> DemoOptions:
    """Parse and check ``argv``; a bad option exits with a one-line error (status 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, least in (("world_size", 1), ("steps", 1), ("batch", 1), ("checkpoint_every", 0)):
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} must be at least {least}, got {getattr(args, name)}")
    if not args.lr > 0:
        parser.error(f"--lr must be positive, got {args.lr}")
    if args.port is not None:
        if not 1 <= args.port <= 65535:
            parser.error(f"--port must be in 1..65535, got {args.port}")
        if not port_is_free(args.port):
            parser.error(f"--port {args.port}: 127.0.0.1:{args.port} is already in use; pick another or omit --port")
    if args.resume is not None:
        if not (args.resume / ".metadata").is_file():
            parser.error(f"--resume {args.resume}: no checkpoint there (write one with --checkpoint)")
        try:
            saved = checkpoint_step(args.resume)
        except (Exception, CheckpointException) as error:  # another DCP checkpoint; DCP's message is many lines
            parser.error(
                f"--resume {args.resume}: not a checkpoint of this demo ({type(error).__name__} reading its step)"
            )
        if saved >= args.steps:
            parser.error(
                f"--resume {args.resume}: that checkpoint is already at step {saved} and --steps is {args.steps}, "
                f"so nothing is left to train; pass --steps greater than {saved}"
            )
    text = args.text if args.text is not None else default_text_source()
    try:
        text_bytes = check_text_source(text, min_text_bytes(PRESETS[args.size].context))
    except TextSourceError as error:
        parser.error(f"--text: {error}")
    return DemoOptions(
        world_size=args.world_size,
        steps=args.steps,
        size=args.size,
        batch=args.batch,
        lr=args.lr,
        text=str(text),
        text_bytes=text_bytes,
        port=args.port,
        seed=args.seed,
        debug=args.debug,
        checkpoint=None if args.checkpoint is None else str(args.checkpoint),
        checkpoint_every=args.checkpoint_every,
        resume=None if args.resume is None else str(args.resume),
        state_format=args.state_format,
    )
