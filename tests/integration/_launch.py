"""Run a script as N ranks the way torchrun does: one interpreter per rank, started together, with the launcher's
environment variables on 127.0.0.1; a failing or hung rank fails the test with its output, and every rank is killed.

Each rank runs in a session of its own, so killing it also kills whatever it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

from distoptim.demo.launch import free_port, loopback_rank_environment

ROOT = Path(__file__).resolve().parents[2]
_LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_PORT")


def _tail(log: IO[str], chars: int = 6000) -> str:
    log.seek(0)
    return log.read()[-chars:]


def run_module_on_ranks(module: str, args: list[str], world_size: int, timeout: float) -> None:
    """``python -m module *args`` from the repository root in ``world_size`` ranks; returns when all exit with 0."""
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[IO[str]] = []
    try:
        for rank in range(world_size):
            env = {key: value for key, value in os.environ.items() if key not in _LAUNCHER_VARIABLES}
            env.update(loopback_rank_environment(rank, world_size, port), NODE_RANK="0")
            logs.append(tempfile.TemporaryFile("w+"))  # noqa: SIM115 (closed below)
            command = [sys.executable, "-m", module, *args]
            procs.append(
                subprocess.Popen(
                    command, cwd=ROOT, env=env, stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True
                )
            )
        deadline = time.monotonic() + timeout
        while True:
            codes = [proc.poll() for proc in procs]
            failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                raise AssertionError(
                    f"rank {failed[0]} of {module} exited with {codes[failed[0]]}:\n{_tail(logs[failed[0]])}"
                )
            if all(code == 0 for code in codes):
                return
            if time.monotonic() > deadline:
                hung = [rank for rank, code in enumerate(codes) if code is None]
                outputs = "\n".join(f"--- rank {rank} ---\n{_tail(logs[rank], 3000)}" for rank in hung)
                raise AssertionError(
                    f"ranks {hung} of {module} did not finish within {timeout:g} s (hung?):\n{outputs}"
                )
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for log in logs:
            log.close()
