"""Run a test body on N real ranks: one process each, a gloo group over 127.0.0.1, a timeout.

``run_on_ranks(body, world_size, *args)`` calls ``body(rank, world_size, *args)`` in every rank and returns the
ranks' return values; arguments and results travel by value, through ``torch.save``. The first rank to raise fails
the test with its full traceback; a rank that hangs past ``timeout`` fails the test with every hung rank's stack,
and all ranks are killed, so nothing outlives the test.

Ranks are forked from a forkserver that imported torch once, so a spawned test costs a fork and a group set-up
rather than a fresh interpreter importing torch (see the closing note of the foundation issue for figures).
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from distoptim.demo.launch import free_port, loopback_rank_environment

__all__ = ["RankFailure", "cuda_world_size", "free_port", "run_on_ranks", "started_ranks"]

DEFAULT_TIMEOUT = 60.0

_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "torch.nn", "torch.optim", "torch._dynamo"])


class RankFailure(AssertionError):
    """A rank raised, died or hung; the message carries its traceback or stack."""


def cuda_world_size() -> int:
    """How many CUDA devices NCCL variants of the tests can use (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _pack(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _unpack(payload: bytes) -> Any:
    return torch.load(io.BytesIO(payload), weights_only=False)


def _rank_main(
    body: Callable[..., Any],
    rank: int,
    world_size: int,
    workdir: str,
    port: int,
    backend: str | None,
    timeout: float,
    conn: Connection,
    packed_args: bytes,
) -> None:
    stack_file = open(os.path.join(workdir, f"stack-{rank}.txt"), "w")  # noqa: SIM115 (lives with the process)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    faulthandler.enable(file=stack_file, all_threads=True)  # a crash (SIGSEGV, SIGABRT) leaves its stacks there too
    os.environ.update(loopback_rank_environment(rank, world_size, port))
    torch.set_num_threads(1)
    try:
        if backend is not None:
            if backend == "nccl":
                torch.cuda.set_device(rank)
            dist.init_process_group(
                backend,
                init_method=f"file://{os.path.join(workdir, 'store')}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout),
            )
        result = body(rank, world_size, *_unpack(packed_args))
        conn.send(("ok", _pack(result)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        if backend is not None and dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


def run_on_ranks(
    body: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT,
    backend: str | None = "gloo",
) -> list[Any]:
    """Run ``body(rank, world_size, *args)`` on ``world_size`` ranks and return their results by rank.

    ``body`` must be a module-level function (it is pickled by name). With ``backend=None`` no default process
    group is formed (RPC tests form their own); ``MASTER_ADDR``/``MASTER_PORT`` are set either way.
    """
    packed_args = _pack(args)  # by value: pickling tensors for a child would share their memory between ranks
    workdir = tempfile.mkdtemp(prefix="distoptim-ranks-")
    port = free_port()
    try:
        arguments = lambda rank, end: (body, rank, world_size, workdir, port, backend, timeout, end, packed_args)
        with started_ranks(_rank_main, world_size, arguments, "rank") as (procs, conns):
            return _collect(procs, conns, workdir, timeout)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def started_ranks(
    target: Callable[..., Any], world_size: int, arguments: Callable[[int, Connection], tuple[Any, ...]], name: str
) -> Iterator[tuple[list[Any], dict[Connection, int]]]:
    """Start ``target(*arguments(rank, pipe_end))`` for every rank from the shared fork server, each with a pipe back
    (the parent's ends map to their ranks); on leaving, kill whatever still runs, join every rank, close the pipes."""
    procs: list[Any] = []
    conns: dict[Connection, int] = {}
    try:
        for rank in range(world_size):
            parent_end, child_end = _CTX.Pipe(duplex=False)
            proc = _CTX.Process(target=target, args=arguments(rank, child_end), name=f"{name}{rank}", daemon=True)
            proc.start()
            child_end.close()
            procs.append(proc)
            conns[parent_end] = rank
        yield procs, conns
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=10)
        for conn in conns:
            conn.close()


def _collect(procs: list[Any], conns: dict[Connection, int], workdir: str, timeout: float) -> list[Any]:
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    pending = dict(conns)
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RankFailure(_hang_report(procs, sorted(pending.values()), workdir, timeout))
        for conn in wait(list(pending), timeout=remaining):
            rank = pending.pop(conn)  # type: ignore[call-overload]
            try:
                status, payload = conn.recv()
            except EOFError:
                procs[rank].join(timeout=5)
                with open(os.path.join(workdir, f"stack-{rank}.txt")) as handle:
                    stack = handle.read().strip()
                raise RankFailure(
                    f"rank {rank} exited (code {procs[rank].exitcode}) without reporting a result"
                    + (f"; its stacks when it crashed:\n{stack}" if stack else "")
                ) from None
            if status == "error":
                raise RankFailure(f"rank {rank} of {len(procs)} failed:\n{payload}")
            results[rank] = _unpack(payload)
    return [results[rank] for rank in range(len(procs))]


def _hang_report(procs: list[Any], hung: list[int], workdir: str, timeout: float) -> str:
    for rank in hung:
        if procs[rank].is_alive():
            os.kill(procs[rank].pid, signal.SIGUSR1)
    time.sleep(0.5)
    stacks = []
    for rank in hung:
        path = os.path.join(workdir, f"stack-{rank}.txt")
        with open(path) as handle:
            stacks.append(f"--- rank {rank} ---\n{handle.read().strip() or '(no stack captured)'}")
    return f"ranks {hung} did not finish within {timeout:g} s (hung?); their stacks:\n" + "\n".join(stacks)
