"""A program's own gradient hooks that change ``.grad`` in the middle of a backward, and a backward that raised in one
and is retried on its retained graph: ShardedDataParallel trains as DDP + AdamW (or, where DDP's reducer cannot go
on after a raise, as AdamW on gradients averaged by hand). Both were silently off before (review r-19c: 0.179 and
0.028)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer
from tests._dist import run_on_ranks
from tests.sharded_data_parallel.test_intake import KW, PARTITIONS, Chain, _compare, _x

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


def _build(partition: str, how: str, where: str) -> tuple[Any, ...]:
    """The pair, with the hook on the first layer's weight registered before wrapping (``before wrap``: it runs
    before the store's own hook) or by the caller after."""
    models = [Chain(), Chain()]
    handles = []
    for model in models if where == "before wrap" else ():
        weight = model.layers[0].weight
        handles.append(weight.register_hook(lambda grad, weight=weight: _changed(weight, how)))
    zero = ZeroRedundancyOptimizer(models[0].parameters(), torch.optim.AdamW, partition=partition, **KW)
    sdp = ShardedDataParallel(models[0], zero, bucket_cap_mb=0.0001)
    ddp = DDP(models[1], find_unused_parameters=True)
    return models[0], zero, sdp, models[1], ddp, torch.optim.AdamW(models[1].parameters(), **KW), handles


def _hook(net: nn.Module, how: str, where: str, x: torch.Tensor) -> Any:
    """``own``: the first layer's weight's hook; ``other``: the third layer's (reached first) changes the first's;
    ``unreached``: it changes the side layer's, which the backward does not reach (the backward's end settles it);
    ``nested``: the second layer's output's hook reads a gradient with ``torch.autograd.grad`` (the first weight's
    hooks run, its accumulator does not), then changes nothing."""
    weight = net.layers[0].weight
    if where == "own":
        return weight.register_hook(lambda grad: _changed(weight, how))
    if where == "other":
        return net.layers[2].weight.register_hook(lambda grad: _changed(weight, how))
    if where == "unreached":  # the side layer, which this backward does not reach
        return net.layers[2].weight.register_hook(lambda grad: _changed(net.side.weight, how))
    aux = net.layers[0](x).square().sum()
    read = lambda grad: torch.autograd.grad(aux, [weight])[0].norm() * 0 + grad
    return net.layers[1].register_forward_hook(lambda module, inputs, out: (out.register_hook(read), None)[1])


def _hook_body(rank: int, world_size: int, partition: str, where: str) -> None:
    """A second backward accumulating onto the first, with a hook that changes the first layer's weight's ``.grad``
    before autograd accumulates there; each way in turn, on a fresh pair."""
    for how in CHANGES if where != "nested" else ["same"]:
        model, zero, sdp, reference, ddp, plain, _ = _build(partition, how, where)
        for step in range(2):
            for wrapper, optimizer, net in ((sdp, zero, model), (ddp, plain, reference)):
                optimizer.zero_grad()
                wrapper(_x(rank, step)).square().mean().backward()
                handle = _hook(net, how, where, _x(rank, step + 30)) if where != "before wrap" else None
                out = wrapper(_x(rank, step + 10), use_side=where != "unreached")
                if where == "nested" and handle is not None:
                    handle.remove()
                out.square().mean().backward()
                if handle is not None:
                    handle.remove()
                optimizer.step()
            sdp.sync_finished()
            _compare(model, reference, f"{partition}, a hook ({where}): {how}, step {step}")


@pytest.mark.parametrize("where", ["own", "other", "unreached", "before wrap", "nested"])
@pytest.mark.parametrize("partition", PARTITIONS)
def test_a_hook_changing_grad_during_an_accumulating_backward_trains_as_ddp(partition: str, where: str) -> None:
    run_on_ranks(_hook_body, 2, partition, where, timeout=120)


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
