"""Shared by the tests that run the example scripts: run a script as a process group with a timeout, read the
lines its ranks print, import an example's model and data for a single-process reference."""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import re
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from distoptim.checkpoint.convert import dcp_to_torch_optim

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
RANK_LINE = re.compile(r"^rank (\d+)/(\d+)\b.*$", re.MULTILINE)
Batch = tuple[torch.Tensor, torch.Tensor]


def example_module(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` (its ``make_model``, ``batch``...) without running its ``main``."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


def environment(**extra: str) -> dict[str, str]:
    """The examples' environment: loopback sockets, one thread per process (2 cores shared by every rank), and
    unbuffered output, as under torchrun: the examples must write each line whole (other ranks' lines interleave)."""
    return {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "TP_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", **extra}  # fmt: skip


def kill_group(proc: subprocess.Popen[str]) -> None:
    """Kill ``proc`` and everything in its process group (ranks forked by it), if any is still there."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def run_example(script: str, *args: str, timeout: float = 90.0) -> str:
    """Run ``python examples/<script> args`` in a session of its own; return its output (stdout and stderr).

    A non-zero exit fails with the output; past ``timeout`` the whole process group is killed and the test fails.
    """
    command = [sys.executable, str(EXAMPLES / script), *args]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment(),
        start_new_session=True, cwd=ROOT,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        output, _ = proc.communicate()
        raise AssertionError(f"{script} did not finish within {timeout:g} s (hung?); its output:\n{output}") from None
    finally:
        kill_group(proc)  # ranks left behind by a failing parent
    assert proc.returncode == 0, f"{' '.join(command[1:])} exited with {proc.returncode}:\n{output}"
    return output


def rank_lines(output: str, world_size: int) -> dict[int, str]:
    """The ``rank R/W ...`` line of every rank, by rank; fails unless each of the ``world_size`` ranks printed one."""
    lines = {int(m.group(1)): m.group(0) for m in RANK_LINE.finditer(output) if int(m.group(2)) == world_size}
    assert sorted(lines) == list(range(world_size)), f"expected one line from each of {world_size} ranks:\n{output}"
    return lines


def field(line: str, name: str) -> str:
    """The word after ``name`` in ``line`` (``loss 0.5 checksum 1.2e+00`` -> ``field(line, "checksum")``)."""
    match = re.search(rf"\b{name} (\S+)", line)
    assert match, f"no {name!r} in {line!r}"
    return match.group(1)


def train_on_mean_gradient(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Callable[[int], Sequence[Batch]],
    steps: Iterable[int],
    clip: float | None = None,
) -> float:
    """The single-process reference of data parallelism: at each step, the mean of the MSE losses of the ranks'
    batches (so the mean of their gradients), optionally clipped by torch, then a plain optimizer step. Returns the
    last step's gradient norm when clipping (``clip=math.inf`` measures it without clipping), else nan."""
    norm = math.nan
    for step in steps:
        optimizer.zero_grad()
        per_rank = batches(step)
        loss = sum(nn.functional.mse_loss(model(x), y) for x, y in per_rank) / len(per_rank)
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        if clip is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        optimizer.step()
    return norm


def assert_checksum(printed: float, model: nn.Module, what: str, rel: float = 1e-5) -> None:
    """``printed`` (a rank's checksum) equals the checksum of ``model`` (the reference), to float rounding."""
    expected = float(example_module("_local").checksum(model))
    assert math.isclose(printed, expected, rel_tol=rel), f"{what}: ranks' checksum {printed!r}, reference {expected!r}"


def common_checksum(lines: dict[int, str]) -> float:
    """The ranks' common checksum; fails unless they all printed the same one, and a finite loss."""
    values = {field(line, "checksum") for line in lines.values()}
    assert len(values) == 1, f"ranks disagree on their parameters: {lines}"
    assert all(math.isfinite(float(field(line, "loss"))) for line in lines.values()), lines
    return float(values.pop())


def check_zero_torchrun(output: str, checkpoint: Path, world_size: int, steps: int) -> None:
    """examples/zero_torchrun.py on ``world_size`` ranks: every rank's parameters and the sharded checkpoint it
    wrote (model and AdamW state) equal DDP's training done in one process by torch's AdamW."""
    example = example_module("zero_torchrun")
    model = example.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)  # the example's settings
    batches = lambda step: [example.batch(rank, step) for rank in range(world_size)]
    train_on_mean_gradient(model, optimizer, batches, range(steps))
    assert_checksum(common_checksum(rank_lines(output, world_size)), model, "zero_torchrun")

    files = sorted(path.name for path in checkpoint.iterdir())
    assert files == [".checksums", ".metadata", *(f"__{rank}_0.distcp" for rank in range(world_size))], files
    saved = {"model": example.make_model().state_dict()}
    with warnings.catch_warnings():  # "torch.distributed is disabled ...: loading in a single process", as meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(saved, checkpoint_id=checkpoint, no_dist=True)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(saved["model"][name], value, msg=lambda m, n=name: f"checkpoint, {n}: {m}")
    optim = dcp_to_torch_optim(checkpoint)
    reference = optimizer.state_dict()
    assert len(optim["state"]) == len(reference["state"]) == len(list(model.parameters()))
    for index, state in reference["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(optim["state"][index][key], value, msg=lambda m, k=key: f"optim {k}: {m}")
    assert optim["param_groups"][0]["lr"] == reference["param_groups"][0]["lr"]
