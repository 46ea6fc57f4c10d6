"""``ShardedDataParallel(static_graph=True)`` where the program changes what it trains or clears between a predicted
backward and its step: a re-placement (a layer frozen) and a clear to zeros keep the step's check of the prediction.
Each program that trains is compared with DDP + torch's AdamW."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from tests._dist import run_on_ranks
from tests.sharded_data_parallel.test_failures import KW, Chain, _compare, _sdp, _x

BROKEN = r"static_graph=True\): parameters \[8, 9\]"  # the branch: used by the first backward, by no rank since


def _between(how: str, net: Chain, optimizer: torch.optim.Optimizer) -> None:
    """What the program does between the third backward and its step."""
    if how == "freeze_other":
        net.layers[0].requires_grad_(False)
    elif how == "freeze_unused":
        net.branch.requires_grad_(False)
    elif how == "zeros":
        optimizer.zero_grad(set_to_none=False)


def _predicted_body(rank: int, world_size: int, how: str, broken: bool) -> None:
    """Three steps as DDP + AdamW; at the third (``broken``: the branch unused by every rank, a broken promise) the
    program freezes a layer before the backward or between it and the step, or clears to zeros between them."""
    model, reference = Chain(), Chain()
    zero, sdp = _sdp(model, static_graph=True)
    ddp = DDP(reference, find_unused_parameters=True)
    plain = torch.optim.AdamW(reference.parameters(), **KW)
    for step in range(4):
        for optimizer, wrapper, net in ((zero, sdp, model), (plain, ddp, reference)):
            optimizer.zero_grad()
            if step == 2 and how == "freeze_before":
                net.layers[0].requires_grad_(False)
            wrapper(_x(rank, step), use_branch=not (broken and step == 2)).square().mean().backward()
            if step == 2:
                _between(how, net, optimizer)
            if broken and step == 2 and optimizer is zero:
                with pytest.raises(ValueError, match=BROKEN):  # on every rank (each rank's body checks it)
                    zero.step()
                return
            optimizer.step()
        _compare(model, reference, f"{how}, step {step}")


@pytest.mark.parametrize(
    ("how", "broken"),
    [
        ("freeze_other", False),  # the frozen layer is stepped with its gradient, as torch's AdamW steps it
        ("freeze_before", False),  # frozen before the backward: not stepped (no gradient), as under DDP
        ("freeze_other", True),  # the re-placement kept the check: the branch is not stepped on zeros
        ("freeze_unused", True),
        ("zeros", False),  # every parameter stepped on zeros, as torch's AdamW steps zeroed gradients
        ("zeros", True),  # the clear kept the check: the branch (no gradient under DDP) not stepped on zeros
    ],
)
def test_static_graph_checks_a_predicted_backward_across_a_replacement_or_a_clear(how: str, broken: bool) -> None:
    run_on_ranks(_predicted_body, 2, how, broken, timeout=60)
