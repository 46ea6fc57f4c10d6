"""A rank SIGKILLed in the backward (DDP's, or ``ShardedDataParallel``'s point-to-point reduction), in
``zero.step()``, in the parameter sync or in ``consolidate_state_dict``: every survivor raises within seconds, with
an error saying a peer is gone, and no process is left behind.

The process group's timeout is a minute, longer than the test waits: survivors must notice the death from the
broken connections (gloo: "Connection reset by peer" / "Connection closed by peer [127.0.0.1]:port"), not time out.
"""

from __future__ import annotations

import re
import signal
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer
from distoptim.checkpoint import consolidated as checkpoint
from tests.faults._launcher import Outcome, die, run_with_faults

WORLD_SIZE = 3  # two survivors
VICTIM = 1
KILL_AT = 2  # the iteration in which the victim dies
ITERATIONS = 4
GROUP_TIMEOUT_S = 60.0
RAISE_WITHIN_S = 30.0
PEER_GONE = r"Connection (reset|closed) by peer"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _arm(where: str, model: nn.Module, zero: ZeroRedundancyOptimizer, now: dict[str, int]) -> None:
    """Make this rank die at ``where`` in iteration ``KILL_AT``, through public hook points or a patched collective."""

    def die_in_iteration(*_: Any) -> None:
        if now["iteration"] == KILL_AT:
            die()

    if where in ("backward", "sharded"):  # the middle layer's gradients: the last layer's bucket is launched already
        model[2].register_full_backward_hook(die_in_iteration)
    elif where == "step":  # the local optimizer's step, inside zero.step(), before the sync
        zero.local_optimizer.register_step_pre_hook(die_in_iteration)
    elif where in ("sync", "consolidate"):  # at this rank's first message of the sync / after 3 of its shard
        name, after = ("isend", 0) if where == "sync" else ("send", 3)  # (a rank its sync has reached goes on)
        real, calls = getattr(dist, name), [0]

        def dying(*args: Any, **kwargs: Any) -> Any:
            if now["iteration"] == KILL_AT:
                calls[0] += 1
                if calls[0] > after:
                    die()
            return real(*args, **kwargs)

        mock.patch.object(dist, name, dying).start()
    else:
        raise ValueError(where)


def _kill_body(rank: int, world_size: int, where: str) -> None:
    model = _model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, partition="even", lr=1e-2)
    wrapped: nn.Module
    if where == "sharded":
        wrapped = ShardedDataParallel(model, zero, bucket_cap_mb=0.001)  # a few buckets
    else:
        wrapped = DDP(model, bucket_cap_mb=0.001)
    now = {"iteration": -1}
    if rank == VICTIM:
        _arm(where, model, zero, now)
    checkpoint.STAGING_BYTES = 256  # several messages per shard
    for iteration in range(ITERATIONS):
        now["iteration"] = iteration
        zero.zero_grad()
        inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * iteration + rank))
        wrapped(inputs).square().mean().backward()
        zero.step()
        if where == "consolidate" and iteration == KILL_AT:
            zero.consolidate_state_dict(to=0)


def _report(outcomes: list[Outcome]) -> str:
    return "\n".join(f"{outcome}\n{outcome.details}" for outcome in outcomes)


def assert_survivors_raised(outcomes: list[Outcome], victim: int, pattern: str, within_s: float) -> None:
    """The victim was SIGKILLed; every other rank raised an error matching ``pattern`` within ``within_s`` of the
    kill; every process has exited by itself."""
    report = _report(outcomes)
    for outcome in outcomes:
        assert outcome.exited, f"rank {outcome.rank} is still running\n{report}"
        if outcome.rank == victim:
            assert outcome.status == "died" and outcome.exitcode == -signal.SIGKILL, report
            continue
        assert outcome.status == "raised", report
        assert outcome.after_fault_s is not None and outcome.after_fault_s < within_s, report
        assert re.search(pattern, outcome.message), report


# where the survivors are when the victim dies: what their traceback must show
SURVIVORS_IN = {
    "backward": "in backward\n",  # DDP's all-reduce of the victim's buckets
    "sharded": "distoptim/sharded_data_parallel/gradients.py",  # sending to the victim, or waiting for what it sends
    "step": "in agreed_step\n",  # waiting for the victim's word that its local step succeeded, before the sync
    "sync": "in sync_parameters\n",
    "consolidate": "in consolidate_state_dict\n",  # rank 0 receiving the shards; rank 2 sending its own
}


@pytest.mark.parametrize("where", list(SURVIVORS_IN))
def test_survivors_raise_when_a_rank_is_killed(where: str) -> None:
    outcomes = run_with_faults(_kill_body, WORLD_SIZE, where, timeout=45, group_timeout=GROUP_TIMEOUT_S)
    assert_survivors_raised(outcomes, VICTIM, PEER_GONE, RAISE_WITHIN_S)
    for outcome in outcomes:
        if outcome.rank != VICTIM:
            assert SURVIVORS_IN[where] in outcome.details, _report(outcomes)
