"""A launcher for fault tests: N gloo ranks on 127.0.0.1 where a rank may die or stall on purpose.

``tests._dist.run_on_ranks`` fails the test at the first dead rank; here a dead rank is the experiment, so
``run_with_faults`` waits for every rank and reports each one as an ``Outcome``: ``died`` (killed, with its exit
code), ``raised`` (exception type, message, seconds from the kill to the raise), ``returned`` (its value) or
``hung`` (still running at the end, with its stack). Every rank is killed at the end, and the outcome says whether
it had exited by itself first, so a test can assert that nothing is left behind.

A rank dies with ``die()``: it records the time (``CLOCK_MONOTONIC``, one clock for every process on the machine)
then sends itself SIGKILL, so no Python clean-up runs, as when the OOM killer or a node failure takes a process.
A rank stalls with ``stall()``: it records the time and sleeps for good, alive but no longer taking part; the
launcher stops waiting once every other rank has exited.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import os
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from distoptim.demo.launch import free_port, loopback_rank_environment
from tests._dist import started_ranks  # and the fork server's preload: the fault ranks share its fork server

__all__ = ["Outcome", "die", "run_with_faults", "stall"]

_DIR_VARIABLE = "DISTOPTIM_FAULT_DIR"
_POLL_S = 0.2


@dataclass
class Outcome:
    """What happened to one rank."""

    rank: int
    status: str  # "died", "raised", "returned" or "hung"
    exitcode: int | None = None  # None while it was still running when the launcher gave up on it
    error: str = ""  # the exception's type name, for "raised"
    message: str = ""
    details: str = ""  # traceback ("raised") or stacks ("hung")
    after_fault_s: float | None = None  # seconds from the first kill or stall to this rank's raise
    value: Any = None  # what the body returned, for "returned"
    exited: bool = False  # the process had ended by itself (not killed by the launcher)
    pid: int = 0

    def __str__(self) -> str:
        when = "" if self.after_fault_s is None else f" {self.after_fault_s:.2f} s after the fault"
        text = f"rank {self.rank}: {self.status} (exit code {self.exitcode}){when}"
        if self.status == "raised":
            text += f": {self.error}: {self.message.splitlines()[0] if self.message else ''}"
        return text


def die() -> None:
    """Record the time and SIGKILL this rank (inside a ``run_with_faults`` body)."""
    _record_fault("killed")
    os.kill(os.getpid(), signal.SIGKILL)


def stall() -> None:
    """Record the time and sleep for good: this rank stays alive but takes part in nothing any more."""
    _record_fault("stalled")
    while True:
        time.sleep(3600)


def _record_fault(kind: str) -> None:
    path = os.path.join(os.environ[_DIR_VARIABLE], f"{kind}-{dist.get_rank()}")
    with open(path + ".tmp", "w") as handle:
        handle.write(repr(time.monotonic()))
    os.replace(path + ".tmp", path)  # complete when it appears


def _pack(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _rank_main(
    body: Callable[..., Any],
    rank: int,
    world_size: int,
    workdir: str,
    port: int,
    group_timeout: float | None,
    conn: Connection,
    args: tuple[Any, ...],
) -> None:
    stack_file = open(os.path.join(workdir, f"stack-{rank}.txt"), "w")  # noqa: SIM115 (lives with the process)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.update(loopback_rank_environment(rank, world_size, port))
    os.environ[_DIR_VARIABLE] = workdir
    torch.set_num_threads(1)
    report: tuple[Any, ...]
    try:
        kwargs = {} if group_timeout is None else {"timeout": timedelta(seconds=group_timeout)}
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(workdir, 'store')}", rank=rank, world_size=world_size, **kwargs
        )
        report = ("returned", _pack(body(rank, world_size, *args)))
    except BaseException as error:
        report = ("raised", time.monotonic(), type(error).__name__, str(error), traceback.format_exc())
    conn.send(report)
    conn.close()
    if dist.is_initialized():  # what a careful program does on its way out; it must not hang after a failure
        dist.destroy_process_group()


def run_with_faults(
    body: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 30.0,
    group_timeout: float | None = 10.0,
) -> list[Outcome]:
    """Run ``body(rank, world_size, *args)`` on ``world_size`` ranks and report every rank's outcome.

    ``body`` must be a module-level function. ``group_timeout`` is the process group's ``timeout`` in seconds (None:
    torch's default). The launcher waits until every rank has exited or stalled (``stall()``), at most ``timeout``
    seconds; a rank still running then (a stalled one included) is reported as hung, with its stack.
    """
    workdir = tempfile.mkdtemp(prefix="distoptim-faults-")
    port = free_port()
    reports: dict[int, tuple[Any, ...]] = {}
    try:
        arguments = lambda rank, end: (body, rank, world_size, workdir, port, group_timeout, end, args)
        with started_ranks(_rank_main, world_size, arguments, "fault-rank") as (procs, conns):
            _wait_for_ranks(procs, conns, reports, workdir, time.monotonic() + timeout)
            return _outcomes(procs, reports, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_for_ranks(
    procs: list[Any], conns: dict[Connection, int], reports: dict[int, tuple[Any, ...]], workdir: str, deadline: float
) -> None:
    """Collect reports until every rank has exited or stalled on purpose, or the deadline passes."""
    pending = dict(conns)
    running = {proc.sentinel: rank for rank, proc in enumerate(procs)}
    while time.monotonic() < deadline:
        stalled = _fault_times(workdir, "stalled")
        if all(rank in stalled for rank in running.values()):
            return
        for ready in wait([*pending, *running], timeout=min(_POLL_S, max(0.0, deadline - time.monotonic()))):
            if ready in pending:
                rank = pending.pop(ready)  # type: ignore[call-overload]
                with contextlib.suppress(EOFError):  # EOF: it died before reporting
                    reports[rank] = ready.recv()  # type: ignore[union-attr]
            else:
                running.pop(ready)  # type: ignore[call-overload]


def _fault_times(workdir: str, kind: str) -> dict[int, float]:
    """When each rank that recorded a fault of ``kind`` ("killed", "stalled") did so."""
    times = {}
    for name in os.listdir(workdir):
        if name.startswith(f"{kind}-") and not name.endswith(".tmp"):
            with open(os.path.join(workdir, name)) as handle:
                times[int(name.rsplit("-", 1)[1])] = float(handle.read())
    return times


def _outcomes(procs: list[Any], reports: dict[int, tuple[Any, ...]], workdir: str) -> list[Outcome]:
    faults = [*_fault_times(workdir, "killed").values(), *_fault_times(workdir, "stalled").values()]
    first_fault = min(faults) if faults else None
    hung = [rank for rank, proc in enumerate(procs) if rank not in reports and proc.is_alive()]
    stacks = _stacks(procs, hung, workdir)
    outcomes = []
    for rank, proc in enumerate(procs):
        outcome = Outcome(rank, "hung", exitcode=proc.exitcode, exited=not proc.is_alive(), pid=proc.pid)
        report = reports.get(rank)
        if report is not None and report[0] == "returned":
            outcome.status, outcome.value = "returned", torch.load(io.BytesIO(report[1]), weights_only=False)
        elif report is not None:
            raised_at, outcome.error, outcome.message, outcome.details = report[1:]
            outcome.status = "raised"
            outcome.after_fault_s = None if first_fault is None else raised_at - first_fault
        elif not proc.is_alive():
            outcome.status = "died"
        else:
            outcome.details = stacks[rank]
        outcomes.append(outcome)
    return outcomes


def _stacks(procs: list[Any], ranks: list[int], workdir: str) -> dict[int, str]:
    for rank in ranks:
        os.kill(procs[rank].pid, signal.SIGUSR1)
    if ranks:
        time.sleep(0.5)
    stacks = {}
    for rank in ranks:
        with open(os.path.join(workdir, f"stack-{rank}.txt")) as handle:
            stacks[rank] = handle.read().strip() or "(no stack captured)"
    return stacks
