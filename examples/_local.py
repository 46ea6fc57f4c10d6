"""Shared by the examples: run a function on N local ranks, one process each, in a process group on 127.0.0.1.

NCCL with one GPU per rank when there are enough GPUs, gloo on the CPU otherwise. Copy it along with an example, or
replace it by your launcher (``torchrun`` sets the same environment variables; see zero_torchrun.py).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch._dynamo  # DDP's constructor imports it (~1 s): once here, before the ranks are forked, not in each
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def use_cuda(world_size: int) -> bool:
    """Whether every rank can have a GPU of its own (NCCL); ``torch.cuda.device_count`` does not initialise CUDA."""
    return torch.cuda.device_count() >= world_size


def launch(fn: Callable[..., Any], world_size: int, *args: Any, group: bool = True, cuda: bool | None = None) -> None:
    """Call ``fn(rank, world_size, device, *args)`` on ``world_size`` new processes, each in the default group.

    ``fn`` must be a module-level function. With ``group=False`` no process group is formed (RPC forms its own from
    the same ``MASTER_ADDR``/``MASTER_PORT``). ``cuda``: one GPU per rank and NCCL (default: when there are enough
    GPUs). Processes are forked on the CPU (cheap: torch is imported once) and spawned when they use CUDA (a CUDA
    runtime does not survive a fork). A failing rank raises here.
    """
    cuda = use_cuda(world_size) if cuda is None else cuda
    port = str(free_port())
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, GLOO_SOCKET_IFNAME="lo", TP_SOCKET_IFNAME="lo")
    mp.start_processes(
        _rank_main,
        args=(fn, world_size, cuda, group, args),
        nprocs=world_size,
        start_method="spawn" if cuda else "fork",
    )


def _rank_main(
    rank: int, fn: Callable[..., Any], world_size: int, cuda: bool, group: bool, args: tuple[Any, ...]
) -> None:
    size = str(world_size)
    os.environ.update(RANK=str(rank), WORLD_SIZE=size, LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=size)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # the ranks share the CPU cores
    if group:
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        fn(rank, world_size, device, *args)
    finally:
        if group:
            dist.destroy_process_group()


def say(line: str) -> None:
    """Print ``line`` with one write: ``print`` writes the text and its newline separately when output is unbuffered
    (``python -u``, ``PYTHONUNBUFFERED``), and the ranks, sharing one terminal, would split each other's lines."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def checksum(module: torch.nn.Module) -> str:
    """A position-weighted sum of all parameters, printed by each rank: equal on ranks holding equal parameters."""
    flat = torch.cat([p.detach().reshape(-1).double().cpu() for p in module.parameters()])
    return f"{float((flat * torch.linspace(1.0, 2.0, len(flat), dtype=torch.float64)).sum()):.12e}"
