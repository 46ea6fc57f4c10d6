"""A program's own gradient hooks that change ``.grad`` in the middle of a backward, and a backward that raised in one
and is retried on its retained graph: ShardedDataParallel trains as DDP + AdamW (or, where DDP's reducer cannot go
on after a raise, as AdamW on gradients averaged by hand). Both were silently off before (review r-19c: 0.179 and
0.028)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer
from tests._dist import run_on_ranks
from tests.sharded_data_parallel.test_intake import KW, PARTITIONS, Chain, _compare, _pair, _x

CHANGES = ["zero in place", "set to None", "set to a tensor", "detached", "same"]


def _changed(param: torch.Tensor, how: str) -> None:
    """What a hook of the program's does to ``param.grad`` (which holds the earlier backward's gradient)."""
    if param.grad is None:
        return
    if how == "zero in place":
        param.grad.zero_()
    elif how == "set to None":
        param.grad = None
    elif how == "set to a tensor":
        param.grad = torch.full_like(param, 0.5)
    elif how == "detached":
        param.grad = param.grad.detach()
    else:
        param.grad = param.grad


def _hook_body(rank: int, world_size: int, partition: str) -> None:
    """A second backward accumulating onto the first, with a hook on the first layer's weight that changes its
    ``.grad`` before autograd accumulates there; each way in turn, on a fresh pair."""
    for how in CHANGES:
        model, zero, sdp, reference, ddp, plain = _pair(partition)
        for step in range(2):
            for wrapper, optimizer, net in ((sdp, zero, model), (ddp, plain, reference)):
                optimizer.zero_grad()
                wrapper(_x(rank, step)).square().mean().backward()
                weight = net.layers[0].weight
                handle = weight.register_hook(lambda grad, weight=weight, how=how: _changed(weight, how))
                wrapper(_x(rank, step + 10)).square().mean().backward()
                handle.remove()
                optimizer.step()
            sdp.sync_finished()
            _compare(model, reference, f"{partition}, a hook: {how}, step {step}")


@pytest.mark.parametrize("partition", PARTITIONS)
def test_a_hook_changing_grad_during_an_accumulating_backward_trains_as_ddp(partition: str) -> None:
    run_on_ranks(_hook_body, 2, partition, timeout=90)


class _Fails(Exception):
    pass


def _fail(grad: torch.Tensor) -> None:
    raise _Fails("a hook of the program's fails")


def _retry_body(rank: int, world_size: int, clear: str) -> None:
    """At the second step: a backward, then one on the retained graph that raises at its first gradient (nothing
    accumulated), caught; ``.grad`` cleared by the module (or not), and the backward retried on the same graph."""
    model, reference = Chain(), Chain()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **KW)
    sdp = ShardedDataParallel(model, zero, bucket_cap_mb=0.0001)
    plain = torch.optim.AdamW(reference.parameters(), **KW)
    for step in range(3):
        for wrapper, optimizer, net in ((sdp, zero, model), (reference, plain, reference)):
            optimizer.zero_grad()
            loss = wrapper(_x(rank, step)).square().mean()
            loss.backward(retain_graph=True)
            if step == 1:
                handle = net.side.bias.register_hook(_fail)
                with contextlib.suppress(_Fails):
                    loss.backward(retain_graph=True)
                handle.remove()
                if clear == "module, in place":
                    net.zero_grad(set_to_none=False)
                elif clear == "one layer, to None":
                    net.side.zero_grad()
                loss.backward()
            if net is reference:  # DDP's reducer cannot go on after a raised backward: averaged by hand
                for param in reference.parameters():
                    if param.grad is not None:
                        dist.all_reduce(param.grad)
                        param.grad /= world_size
            optimizer.step()
        sdp.sync_finished()
        _compare(model, reference, f"{clear}, step {step}")


@pytest.mark.parametrize("clear", ["module, in place", "one layer, to None", "none"])
def test_a_backward_retried_after_a_raise_on_its_retained_graph_trains_as_torch(clear: str) -> None:
    run_on_ranks(_retry_body, 2, clear, timeout=60)
