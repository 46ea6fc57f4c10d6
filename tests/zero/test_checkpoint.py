"""Consolidation, the torch.optim state-dict format, loading at other world sizes, and torch's own ZeRO."""

from __future__ import annotations

import copy
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

from distoptim import ZeroRedundancyOptimizer
from tests._dist import cuda_world_size, run_on_ranks
from tests._reference import assert_same_tensors, averaged_gradients, flatten, make_params

KWARGS = {"lr": 0.01, "weight_decay": 0.01, "amsgrad": True}


def _groups(params: list[list[torch.Tensor]]) -> list[dict[str, Any]]:
    return [{"params": params[0]}, {"params": params[1], "lr": 0.005}]


def _train(optimizers: list[torch.optim.Optimizer], params: list[list[torch.Tensor]], rank: int, steps: range) -> None:
    """Step every optimizer (each over its own copy in ``params``) on the same averaged gradients."""
    for step in steps:
        grads = averaged_gradients(params[0], rank, step)
        for optimizer, copy_ in zip(optimizers, params):
            for param, grad in zip(copy_, grads):
                param.grad = None if grad is None else grad.clone()
            optimizer.step()


def _assert_same_state_dict(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual["param_groups"] == expected["param_groups"]
    assert sorted(actual["state"]) == sorted(expected["state"])
    for index, entry in expected["state"].items():
        assert sorted(actual["state"][index]) == sorted(entry), index
        assert_same_tensors([actual["state"][index][k] for k in entry], list(entry.values()), f"state[{index}]")


def _save_body(rank: int, world_size: int, to: int) -> dict[str, Any] | None:
    ours, plain = make_params(), make_params()
    zero = ZeroRedundancyOptimizer(_groups(ours), torch.optim.Adam, **KWARGS)
    reference = torch.optim.Adam(_groups(plain), **KWARGS)
    _train([zero, reference], [flatten(ours), flatten(plain)], rank, range(3))

    with pytest.raises(RuntimeError, match=rf"consolidate_state_dict\(to={rank}\)"):
        zero.state_dict()
    with mock.patch.object(dist, "recv", wraps=dist.recv) as recv:
        zero.consolidate_state_dict(to=to)
    # Only the target receives tensors: one flat tensor per state dtype (fp32, bf16) from each other rank.
    if rank != to:
        assert recv.call_count == 0, recv.call_count
    else:
        assert 0 < recv.call_count <= 2 * (world_size - 1), recv.call_count
    result = None
    if rank != to:
        with pytest.raises(RuntimeError, match="holds no consolidated optimizer state"):
            zero.state_dict()
    else:
        saved = zero.state_dict()
        _assert_same_state_dict(saved, reference.state_dict())
        # The consolidated dict is the plain torch.optim format: it loads into a plain optimizer.
        loaded = torch.optim.Adam(_groups(make_params()), **KWARGS)
        loaded.load_state_dict(copy.deepcopy(saved))
        _assert_same_state_dict(loaded.state_dict(), reference.state_dict())
        result = {"saved": saved, "params": [p.detach().clone() for p in flatten(plain)]}
    # A step invalidates the consolidated state, which would otherwise be stale.
    _train([zero], [flatten(ours)], rank, range(3, 4))
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        zero.state_dict()
    return result


def _load_body(rank: int, world_size: int, checkpoint: dict[str, Any]) -> None:
    saved, values = checkpoint["saved"], checkpoint["params"]
    pristine = copy.deepcopy(saved)
    ours, plain = make_params(), make_params()
    for param, other, value in zip(flatten(ours), flatten(plain), values):
        param.data.copy_(value)
        other.data.copy_(value)
    zero = ZeroRedundancyOptimizer(_groups(ours), torch.optim.Adam, parameters_as_bucket_view=True, **KWARGS)
    zero.load_state_dict(saved)
    assert zero.state is zero.local_optimizer.state
    reference = torch.optim.Adam(_groups(plain), **KWARGS)
    reference.load_state_dict(copy.deepcopy(saved))
    _train([zero, reference], [flatten(ours), flatten(plain)], rank, range(3, 6))
    assert_same_tensors(flatten(ours), flatten(plain), f"resumed at world size {world_size}")
    _assert_same_state_dict(saved, pristine)  # loading kept its own copies: the caller's dict is untouched
    owned = {id(p) for g in zero.local_optimizer.param_groups for p in g["params"]}
    assert {id(p) for p in zero.local_optimizer.state} <= owned  # each rank keeps only its shard


@pytest.mark.parametrize(("save_world", "load_world"), [(3, 2), (2, 4)])
def test_save_consolidated_and_resume_at_another_world_size(save_world: int, load_world: int) -> None:
    results = run_on_ranks(_save_body, save_world, save_world - 1)
    checkpoint = results[save_world - 1]
    assert all(result is None for result in results[:-1])
    run_on_ranks(_load_body, load_world, checkpoint)


def _torch_zero_body(rank: int, world_size: int) -> None:
    ours, theirs = make_params(), make_params()
    zero = ZeroRedundancyOptimizer(_groups(ours), torch.optim.AdamW, **KWARGS)
    torch_zero = TorchZero(_groups(theirs)[0]["params"], torch.optim.AdamW, **KWARGS)
    torch_zero.add_param_group(_groups(theirs)[1])
    _train([zero, torch_zero], [flatten(ours), flatten(theirs)], rank, range(3))
    assert_same_tensors(flatten(ours), flatten(theirs), "ours vs torch's ZeroRedundancyOptimizer")

    zero.consolidate_state_dict(to=0)
    torch_zero.consolidate_state_dict(to=0)
    dicts = [zero.state_dict(), torch_zero.state_dict()] if rank == 0 else [None, None]
    dist.broadcast_object_list(dicts, src=0)
    ours_saved, theirs_saved = dicts
    _assert_same_state_dict(ours_saved, theirs_saved)
    # Cross-load both ways and keep training: still in lockstep.
    zero.load_state_dict(theirs_saved)
    torch_zero.load_state_dict(ours_saved)
    _train([zero, torch_zero], [flatten(ours), flatten(theirs)], rank, range(3, 6))
    assert_same_tensors(flatten(ours), flatten(theirs), "after cross-loading")


def test_parity_and_cross_loading_with_torch_zero() -> None:
    run_on_ranks(_torch_zero_body, 2)


def _device_placement_body(rank: int, world_size: int) -> None:
    """A capturable optimizer keeps ``step`` on the parameter's device after loading a dict saved on the CPU."""
    device = torch.device("cuda", rank)
    params = [p.to(device) for p in flatten(make_params())]
    saved = torch.optim.Adam([p.detach().cpu().requires_grad_(p.requires_grad) for p in params], lr=0.01)
    for param in (p for group in saved.param_groups for p in group["params"] if p.requires_grad):
        param.grad = torch.ones_like(param)
    saved.step()
    zero = ZeroRedundancyOptimizer(params, torch.optim.Adam, lr=0.01, capturable=True)
    zero.load_state_dict(saved.state_dict())
    for state in zero.local_optimizer.state.values():
        assert all(value.device == device for value in state.values()), state
    zero.consolidate_state_dict(to=0)  # shards travel over NCCL from their CUDA tensors
    if rank == 0:
        assert len(zero.state_dict()["state"]) == len(saved.state_dict()["state"])


@pytest.mark.skipif(cuda_world_size() < 2, reason="needs 2 CUDA devices")
def test_state_goes_where_the_local_optimizer_needs_it_on_nccl() -> None:
    run_on_ranks(_device_placement_body, 2, backend="nccl")
