"""What a program keeps of ``.grad`` across a clear and a later backward under ShardedDataParallel: refused on every
rank where torch's step would use it, as DDP + plain AdamW where it only zeroes an old copy. A store that put a
parameter's old marker back into ``.grad`` (tried in c7d3dc8) fails these (review r-19b: 0.154 and 0.039 off)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._dist import run_on_ranks
from tests.sharded_data_parallel.test_intake import PARTITIONS, _compare, _pair, _x


def _outcome(action: Any) -> str:
    try:
        action()
    except RuntimeError as error:
        return str(error)
    return "ran"


def _kept_body(rank: int, world_size: int, partition: str) -> dict[str, str]:
    """Markers kept (a reference, a detached copy) across zero_grad() and the next backward, then put back: torch's
    step would use the kept gradient, which the store no longer holds, so it refuses."""
    outcomes = {}
    for how in ["reference", "detached copy", "converted copy"]:
        model, zero, sdp, *_ = _pair(partition)
        sdp(_x(rank, 0)).square().mean().backward()
        grads = [p.grad for p in model.parameters()]
        kept = grads if how == "reference" else [g.detach() if how == "detached copy" else g.to("cpu") for g in grads]
        del grads
        zero.zero_grad()
        sdp(_x(rank, 1)).square().mean().backward()
        for param, grad in zip(model.parameters(), kept):
            param.grad = grad
        outcomes[how] = _outcome(zero.step)
    return outcomes


@pytest.mark.parametrize("partition", PARTITIONS)
def test_a_marker_kept_across_a_backward_and_put_back_is_refused_on_every_rank(partition: str) -> None:
    for outcomes in run_on_ranks(_kept_body, 2, partition, timeout=90):
        for how, outcome in outcomes.items():
            assert "not the one this store put there last" in outcome, f"{how}: {outcome}"


def _old_copy_zeroed_body(rank: int, world_size: int, partition: str) -> None:
    """A detached copy of an old ``.grad`` zeroed after the next backward: torch's zeroes an old tensor, not the new
    gradient (a put-back marker sharing the copy's version counter would read as zeroed: 0.039 off)."""
    model, zero, sdp, reference, ddp, plain = _pair(partition)
    for optimizer, wrapped, module in ((zero, sdp, model), (plain, ddp, reference)):
        kept: list[torch.Tensor] = []
        for step in range(3):
            optimizer.zero_grad()
            wrapped(_x(rank, step)).square().mean().backward()
            for old in kept if step == 2 else []:  # the copies kept at step 1, zeroed after step 2's backward
                old.zero_()
            kept = [p.grad.detach() for p in module.parameters()]
            optimizer.step()
    sdp.sync_finished()
    _compare(model, reference, "an old .grad's detached copy zeroed")


@pytest.mark.parametrize("partition", PARTITIONS)
def test_an_old_grads_detached_copy_zeroed_leaves_the_new_gradient(partition: str) -> None:
    run_on_ranks(_old_copy_zeroed_body, 2, partition, timeout=90)
