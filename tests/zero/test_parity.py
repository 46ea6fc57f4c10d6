"""ZeroRedundancyOptimizer against a single-process optimizer stepping on the averaged gradients."""

from __future__ import annotations

import pytest
import torch
from torch.optim.lr_scheduler import StepLR

from distoptim import ZeroRedundancyOptimizer
from tests._dist import cuda_world_size, run_on_ranks
from tests._reference import assert_same_tensors, averaged_gradients, flatten, make_params

CONFIGS = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.Adam, {"lr": 0.01}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
]
STEPS = 4


def _groups(params: list[list[torch.Tensor]], lr: float) -> list[dict[str, object]]:
    return [{"params": params[0]}, {"params": params[1], "lr": lr / 2}]


def _parity_body(rank: int, world_size: int, device_type: str = "cpu") -> list[int]:
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    owned_counts = []
    for optimizer_class, kwargs in CONFIGS:
        for bucket_view in (False, True):
            what = f"{optimizer_class.__name__} bucket_view={bucket_view} world={world_size}"
            params, expected = make_params(device=device), make_params(device=device)
            zero = ZeroRedundancyOptimizer(
                _groups(params, kwargs["lr"]), optimizer_class, parameters_as_bucket_view=bucket_view, **kwargs
            )
            reference = optimizer_class(_groups(expected, kwargs["lr"]), **kwargs)
            schedulers = [StepLR(zero, step_size=2, gamma=0.5), StepLR(reference, step_size=2, gamma=0.5)]
            flat, flat_expected = flatten(params), flatten(expected)
            for step in range(STEPS):
                grads = averaged_gradients(flat, rank, step)
                for param, ref, grad in zip(flat, flat_expected, grads):
                    param.grad = None if grad is None else grad.clone()
                    ref.grad = None if grad is None else grad.clone()
                zero.step()
                reference.step()
                for scheduler in schedulers:
                    scheduler.step()
                assert_same_tensors(flat, flat_expected, f"{what} step {step}")
            assert [g["lr"] for g in zero.param_groups] == [g["lr"] for g in reference.param_groups]
            owned_counts.append(len(zero.local_optimizer.state))
    return owned_counts


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_matches_single_process_optimizer(world_size: int) -> None:
    owned = run_on_ranks(_parity_body, world_size)
    trainable = sum(p.requires_grad for group in make_params() for p in group)
    for config in range(len(CONFIGS) * 2):
        assert sum(counts[config] for counts in owned) == trainable  # each trainable parameter's state on one rank


@pytest.mark.skipif(cuda_world_size() < 2, reason="needs 2 CUDA devices")
def test_matches_single_process_optimizer_on_nccl() -> None:
    run_on_ranks(_parity_body, 2, "cuda", backend="nccl")


# Zero-sized parameters at the start, middle and end; one frozen parameter is unfrozen later (gradual unfreezing).
TRAINABILITY_SPEC = [
    [((0,), torch.float32, True), ((16, 8), torch.float32, True), ((8, 8), torch.float32, False)],
    [((0, 4), torch.float32, True), ((4, 16), torch.float32, True), ((6,), torch.bfloat16, True)],
    [((12,), torch.float32, False), ((0,), torch.float32, True)],
]
UNFREEZE_AT, FREEZE_AT = {5: (2, 6), 7: (0,)}, {8: (4,)}  # step -> flat indices


def _trainability_body(rank: int, world_size: int) -> None:
    """requires_grad changed between steps (the same on every rank): ZeRO re-partitions and equals a plain optimizer."""
    for (optimizer_class, kwargs), bucket_view in zip(CONFIGS, (False, True, True)):
        what = f"{optimizer_class.__name__} bucket_view={bucket_view} world={world_size}"
        params, expected = make_params(TRAINABILITY_SPEC), make_params(TRAINABILITY_SPEC)
        zero = ZeroRedundancyOptimizer(
            [{"params": g} for g in params], optimizer_class, parameters_as_bucket_view=bucket_view, **kwargs
        )
        reference = optimizer_class([{"params": g} for g in expected], **kwargs)
        flat, flat_expected = flatten(params), flatten(expected)
        for step in range(10):
            for index in UNFREEZE_AT.get(step, ()):
                flat[index].requires_grad_(True)
                flat_expected[index].requires_grad_(True)
            for index in FREEZE_AT.get(step, ()):
                flat[index].requires_grad_(False)
                flat_expected[index].requires_grad_(False)
            grads = averaged_gradients(flat, rank, step)
            for param, ref, grad in zip(flat, flat_expected, grads):
                param.grad = None if grad is None else grad.clone()
                ref.grad = None if grad is None else grad.clone()
            zero.step()
            reference.step()
            assert_same_tensors(flat, flat_expected, f"{what} step {step}")
        owned = [zero.owner_of(p) for p in flat]
        assert all(owned[i] >= 0 for i in (2, 4, 6)), "unfrozen parameters got owners; a frozen one keeps its own"
        zero.consolidate_state_dict(to=0)
        if rank == 0:
            state, expected_state = zero.state_dict()["state"], reference.state_dict()["state"]
            assert state.keys() == expected_state.keys()
            for index, entry in expected_state.items():
                for key, value in entry.items():
                    assert torch.equal(torch.as_tensor(state[index][key]), torch.as_tensor(value)), (index, key)


@pytest.mark.parametrize("world_size", [2, 3])
def test_requires_grad_changed_between_steps(world_size: int) -> None:
    run_on_ranks(_trainability_body, world_size)
