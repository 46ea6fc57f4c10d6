"""A rank that stays alive but stops taking part (it sleeps before a collective): with the process group's
``timeout`` set, every other rank raises gloo's "Timed out waiting ...ms" within that timeout plus a margin.

With torch's default timeout (30 minutes for gloo) the others wait that long; docs/guides/errors.md.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ZeroRedundancyOptimizer
from tests.faults._launcher import run_with_faults, stall
from tests.faults.test_peer_death import ITERATIONS, KILL_AT, PEER_GONE, VICTIM, WORLD_SIZE, _model, _report

GROUP_TIMEOUT_S = 5.0
TIMEOUT_CLOSED_PAIR = "Application timeout caused pair closure"  # gloo's words when a peer's timeout closed the pair
MARGIN_S = 10.0  # a busy 2-core machine; the point is "seconds, not 30 minutes"


def _stall_body(rank: int, world_size: int) -> None:
    ddp = DDP(_model(), bucket_cap_mb=0.001)
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, lr=1e-2)
    for iteration in range(ITERATIONS):
        if rank == VICTIM and iteration == KILL_AT:
            stall()  # before the backward's all-reduce: the others wait for it there
        zero.zero_grad()
        inputs = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * iteration + rank))
        ddp(inputs).square().mean().backward()
        zero.step()


def test_survivors_raise_within_the_group_timeout_when_a_rank_stalls() -> None:
    outcomes = run_with_faults(_stall_body, WORLD_SIZE, timeout=GROUP_TIMEOUT_S + 30, group_timeout=GROUP_TIMEOUT_S)
    report, timed_out = _report(outcomes), f"Timed out waiting {GROUP_TIMEOUT_S * 1000:.0f}ms"
    for outcome in outcomes:
        if outcome.rank == VICTIM:  # still asleep when the others had gone; the launcher killed it afterwards
            assert outcome.status == "hung" and "stall" in outcome.details, report
            with pytest.raises(ProcessLookupError):
                os.kill(outcome.pid, 0)
            continue
        assert outcome.status == "raised" and outcome.exited, report
        assert outcome.after_fault_s is not None and outcome.after_fault_s < GROUP_TIMEOUT_S + MARGIN_S, report
        # both wait for the sleeper; one may see the other leave (or gloo close their pair on the other's timeout) a
        # moment before its own timeout fires
        gone = re.search(PEER_GONE, outcome.message) or TIMEOUT_CLOSED_PAIR in outcome.message
        assert timed_out in outcome.message or gone, report
    assert any(timed_out in outcome.message for outcome in outcomes), report
