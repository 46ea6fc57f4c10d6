"""The deprecated ``reduce_to_owners_hook``: it warns once per process, naming the migration, and trains bitwise as
DDP + the plain optimizer: ``.grad`` is DDP's average on every rank, so accumulating across backwards without
``zero_grad`` and ``torch.nn.utils.clip_grad_norm_`` on the model's ``.grad`` are right (the retired hook left only
the owned ranges averaged: the first was refused, the second silently wrong). The hook averages over the optimizer's
ranks, so DDP and ZeRO over the same subgroup of the world train as DDP + the plain optimizer on that subgroup."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ZeroRedundancyOptimizer
from distoptim.hooks import reduce_to_owners_hook
from tests._dist import run_on_ranks
from tests.zero.test_zero2 import _batch, _groups, _Net

KWARGS = {"lr": 0.01, "weight_decay": 0.1}


def _equal(model: nn.Module, reference: nn.Module, what: str, grads: bool) -> None:
    for index, (param, want) in enumerate(zip(model.parameters(), reference.parameters())):
        got, expected = (param.grad, want.grad) if grads else (param, want)
        assert got is not None and expected is not None, f"{what} {index}: no gradient"
        assert torch.equal(got, expected), f"{what} {index}: {(got - expected).abs().max().item()} apart"


def _backward(ddp: DDP, reference_ddp: DDP, x: torch.Tensor, what: str) -> None:
    ddp(x).square().mean().backward()
    reference_ddp(x).square().mean().backward()
    _equal(ddp.module, reference_ddp.module, f"{what}: .grad", grads=True)  # DDP's average, every element


def _train(rank: int, partition: str, bucket_view: bool, group: dist.ProcessGroup | None = None) -> None:
    model, reference = _Net(), _Net()
    ddp, reference_ddp = (DDP(net, bucket_cap_mb=0.002, process_group=group) for net in (model, reference))
    zero = ZeroRedundancyOptimizer(
        _groups(model),
        torch.optim.AdamW,
        process_group=group,
        partition=partition,
        parameters_as_bucket_view=bucket_view,
        **KWARGS,
    )
    ddp.register_comm_hook(zero, reduce_to_owners_hook)
    plain = torch.optim.AdamW(_groups(reference), **KWARGS)
    for iteration in range(4):
        what = f"{partition} bucket_view={bucket_view} iteration {iteration}"
        zero.zero_grad()
        plain.zero_grad()
        _backward(ddp, reference_ddp, _batch(rank, iteration), what)
        if iteration == 1:  # two micro-batches accumulated in .grad, no zero_grad between them
            _backward(ddp, reference_ddp, _batch(rank, 10 + iteration), f"{what}, accumulated")
        if iteration == 2:  # torch's own clip reads the whole .grad
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
            assert torch.equal(norm, expected), f"{what}: torch's norm {norm} != {expected}"
        if iteration == 3:  # ZeRO's clip: norms summed shard by shard, in another order
            norm = zero.clip_grad_norm_(0.05)
            expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
            torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0, msg=what)
        zero.step()
        plain.step()
        if iteration < 3:
            _equal(model, reference, f"{what}: parameter", grads=False)
    for param, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param, want, rtol=1e-6, atol=1e-7)


def _body(rank: int, world_size: int) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for partition, bucket_view in (("greedy", False), ("even", True)):
            _train(rank, partition, bucket_view)
    return [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


def test_the_deprecated_hook_warns_once_and_trains_bitwise_as_ddp() -> None:
    for messages in run_on_ranks(_body, 2, timeout=180):
        assert len(messages) == 1, messages  # once per process, though every bucket of every backward calls it
        assert "use distoptim.ShardedDataParallel(model, zero) instead of DDP + reduce_to_owners_hook" in messages[0]
        assert "this hook now all-reduces, as DDP's default" in messages[0]


def _subgroup_body(rank: int, world_size: int) -> None:
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group, as new_group needs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        _train(rank, "even", True, halves[rank // 2])


def test_ddp_and_zero_over_the_same_subgroup_train_as_ddp_on_it() -> None:
    """A comm hook picks its own group (torch's allreduce_hook takes it as its state): this one averages over the
    optimizer's ranks, which here are DDP's, a 2-rank subgroup of a 4-rank world (refused before: a false refusal)."""
    run_on_ranks(_subgroup_body, 4, timeout=180)
