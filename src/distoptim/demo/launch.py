"""Run a function on N local ranks (a process each, a gloo group over 127.0.0.1) and collect their results.

A failing rank does not dump its traceback on the terminal: the first failure comes back as a ``RankFailure``
carrying a one-line summary (for the user) and the traceback (for ``--debug``); the other ranks are then stopped.
With ``quiet=True`` the ranks' own stderr (library warnings, gloo's logs about peers going away) goes to a log
file; the function still reaches the real terminal through ``RankContext.console``.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TextIO

import torch
import torch.distributed as dist

__all__ = ["RankContext", "RankFailure", "free_port", "loopback_rank_environment", "port_is_free", "run_ranks"]

_POLL_S = 0.2
# what every rank imports anyway (DDP's constructor imports torch._dynamo, seconds on a busy machine)
PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "distoptim")
_REPORT_WAIT_S = 1.0
_GRACE_S = 5.0


@dataclass
class RankContext:
    """What a rank function gets besides its own arguments."""

    rank: int
    world_size: int
    console: TextIO  # the terminal's stderr, even when the rank's own stderr goes to a log


class RankFailure(Exception):
    """A rank raised or died. ``summary`` is one line; ``details`` the rank's traceback (may be empty)."""

    def __init__(self, rank: int, summary: str, details: str = "") -> None:
        super().__init__(f"rank {rank} failed: {summary}")
        self.rank = rank
        self.summary = summary
        self.details = details


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def loopback_rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The launcher variables for one rank of a local group, with gloo and TensorPipe pinned to the loopback."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "GLOO_SOCKET_IFNAME": "lo",
        "TP_SOCKET_IFNAME": "lo",
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
    }


def port_is_free(port: int) -> bool:
    """Whether a listening socket could bind ``127.0.0.1:port`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    message = text[0] if text else ""
    if len(message) > 300:
        message = message[:297] + "..."
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    results: Any,
    log_dir: str | None,
    timeout_s: float,
) -> None:
    console: TextIO = sys.stderr
    if log_dir is not None:  # keep the terminal for the function, send everything else written to fd 2 to a log
        console = os.fdopen(os.dup(2), "w", buffering=1)
        log = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 2)
        os.close(log)
    os.environ.update(loopback_rank_environment(rank, world_size, port))
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        outcome: tuple[Any, ...] = ("ok", fn(RankContext(rank, world_size, console), *args))
    except BaseException as error:  # reported before the group goes away, so the root cause is timed first
        outcome = ("error", time.time(), _one_line(error), traceback.format_exc())
    results.put((rank, *outcome))
    console.flush()
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # the parent already has this rank's outcome
        pass


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    port: int | None = None,
    quiet: bool = True,
    timeout_s: float = 120.0,
    preload: Sequence[str] = PRELOAD,
) -> list[Any]:
    """Call ``fn(RankContext, *args)`` on ``world_size`` new ranks; return the results in rank order.

    ``fn`` must be importable by name (a module-level function) and its results picklable. The ranks form the
    default process group (gloo, ``tcp://127.0.0.1:port``; a free port if ``port`` is None) before ``fn`` runs,
    with ``timeout_s`` for collectives, and destroy it after. Raises ``RankFailure`` for the first rank to fail.

    Ranks are forked from a fork server that imported ``preload`` once (the first call's list holds for the
    process), so N ranks cost one import of torch, not N concurrent ones; a fresh process per rank all the same.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    port = free_port() if port is None else port
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(preload))
    results = context.Queue()
    log_dir = tempfile.mkdtemp(prefix="distoptim-ranks-") if quiet else None
    procs = [
        context.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, tuple(args), results, log_dir, timeout_s),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    finished = False
    try:
        for proc in procs:
            proc.start()
        collected = _collect(procs, results)
        finished = True
        return collected
    finally:
        _stop(procs, grace_s=_GRACE_S if finished else 0.0)
        results.close()
        if log_dir is not None:
            shutil.rmtree(log_dir, ignore_errors=True)


def _collect(procs: list[Any], results: Any) -> list[Any]:
    done: dict[int, Any] = {}
    errors: dict[int, tuple[float, str, str]] = {}  # rank -> (when, summary, traceback)
    deadline = math.inf  # after the first failure: a short wait for the other ranks' reports
    while len(done) + len(errors) < len(procs) and time.monotonic() < deadline:
        try:
            rank, status, *payload = results.get(timeout=_POLL_S)
        except queue.Empty:
            for rank, proc in enumerate(procs):
                if rank not in done and rank not in errors and proc.exitcode is not None:
                    # died without a report: the likely cause of whatever the others then reported
                    errors[rank] = (-math.inf, f"process exited with {_exit_reason(proc.exitcode)}", "")
                    deadline = min(deadline, time.monotonic() + _REPORT_WAIT_S)
            continue
        if status == "ok":
            done[rank] = payload[0]
        else:
            errors[rank] = (payload[0], payload[1], payload[2])
            deadline = min(deadline, time.monotonic() + _REPORT_WAIT_S)
    if errors:  # the earliest failure caused the others (peers going away, timeouts)
        rank, (_, summary, details) = min(errors.items(), key=lambda item: (item[1][0], item[0]))
        raise RankFailure(rank, summary, details)
    return [done[rank] for rank in range(len(procs))]


def _exit_reason(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"code {exitcode} without a result"


def _stop(procs: list[Any], grace_s: float) -> None:
    """Let ranks that are finishing exit within ``grace_s``; terminate, then kill, whatever still runs."""
    started = [proc for proc in procs if proc.pid is not None]
    for proc in started:
        proc.join(timeout=grace_s)
    for proc in started:
        if proc.is_alive():
            proc.terminate()
    for proc in started:
        proc.join(timeout=_GRACE_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
