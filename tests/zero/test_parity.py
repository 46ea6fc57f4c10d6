"""ZeroRedundancyOptimizer against a single-process optimizer stepping on the averaged gradients."""

from __future__ import annotations

import pytest
import torch
from torch.optim.lr_scheduler import StepLR

from distoptim import ZeroRedundancyOptimizer
from distoptim.functional import FunctionalAdamW, FunctionalSGD
from distoptim.zero.partition import SPLIT
from tests._dist import cuda_world_size, run_on_ranks
from tests._reference import assert_same_tensors, averaged_gradients, flatten, make_params, set_gradients

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
                set_gradients(averaged_gradients(flat, rank, step), flat, flat_expected)
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
            set_gradients(averaged_gradients(flat, rank, step), flat, flat_expected)
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


# ----------------------------------------------------------------------------------------- the even partition

# Every class whose update is elementwise, with a spread of hyperparameters (torch.optim and functional classes).
ELEMENTWISE_CONFIGS: list[tuple[type, dict[str, object]]] = [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (torch.optim.Adam, {"lr": 0.01, "amsgrad": True}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1, "betas": (0.8, 0.95)}),
    (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01}),
    (torch.optim.Adadelta, {"lr": 1.0, "rho": 0.8}),
    (torch.optim.Adamax, {"lr": 0.02}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
    (torch.optim.Rprop, {"lr": 0.01}),
    (torch.optim.NAdam, {"lr": 0.01, "decoupled_weight_decay": True, "weight_decay": 0.1}),
    (torch.optim.RAdam, {"lr": 0.01}),
    (FunctionalAdamW, {"lr": 0.01}),
    (FunctionalSGD, {"lr": 0.1, "momentum": 0.5}),
]

# A straddler (127 elements over three ranks at 4), tiny ones (one under the padding), zero-sized ones, a frozen one,
# a channels_last-shaped 4-D one and a second dtype.
EVEN_SPEC = [
    [
        ((0,), torch.float32, True),
        ((127,), torch.float32, True),
        ((0, 3), torch.float32, True),
        ((1,), torch.float32, True),
    ],
    [((4, 3, 2, 2), torch.float32, True), ((5,), torch.float32, False), ((9,), torch.bfloat16, True)],
    [
        ((1,), torch.bfloat16, True),
        ((0,), torch.bfloat16, True),
    ],  # at 4 ranks bf16 is 10 elements in chunks of 3: this one is under the padding
]


def _even_parity_body(rank: int, world_size: int) -> None:
    for number, (optimizer_class, kwargs) in enumerate(ELEMENTWISE_CONFIGS):
        bucket_view = number % 2 == 1
        reference_class = getattr(optimizer_class, "spec", None)
        reference_class = optimizer_class if reference_class is None else reference_class.torch_cls
        what = f"{optimizer_class.__name__} bucket_view={bucket_view} world={world_size}"
        params, expected = make_params(EVEN_SPEC), make_params(EVEN_SPEC)
        params[1][0].data = params[1][0].data.to(memory_format=torch.channels_last)  # flat index 4
        expected[1][0].data = expected[1][0].data.to(memory_format=torch.channels_last)
        groups = [{"params": params[0]}, {"params": params[1], "lr": 0.005}, {"params": params[2]}]
        zero = ZeroRedundancyOptimizer(
            groups, optimizer_class, parameters_as_bucket_view=bucket_view, partition="even", **kwargs
        )
        reference = reference_class(
            [{"params": expected[0]}, {"params": expected[1], "lr": 0.005}, {"params": expected[2]}], **kwargs
        )
        flat, flat_expected = flatten(params), flatten(expected)
        for step in range(STEPS):
            set_gradients(averaged_gradients(flat, rank, step), flat, flat_expected)
            zero.step()
            reference.step()
            assert_same_tensors(flat, flat_expected, f"{what} step {step}")
        assert flat[4].is_contiguous(memory_format=torch.channels_last), f"{what}: strides kept"
        if world_size > 1:
            assert zero.owner_of(flat[1]) == SPLIT, "the 127-element parameter straddles ranks"
        zero.consolidate_state_dict(to=0)
        if rank == 0:
            state, expected_state = zero.state_dict(), reference.state_dict()
            assert state["param_groups"] == expected_state["param_groups"], what
            for index, entry in expected_state["state"].items():
                if flat[index].numel() == 0 or not flat[index].requires_grad:
                    continue  # zero-sized and frozen parameters have no owner, so no state (Adagrad's is eager)
                for key, value in entry.items():
                    got = state["state"][index][key]
                    assert torch.equal(torch.as_tensor(got), torch.as_tensor(value)), f"{what}: state {index} {key}"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_even_partition_matches_single_process_optimizer(world_size: int) -> None:
    run_on_ranks(_even_parity_body, world_size, timeout=120)


def _refusals_body(rank: int, world_size: int) -> None:
    params = [torch.zeros(4, requires_grad=True)]
    # a class not known to be elementwise is placed whole, not refused (tests/zero/test_muon.py)
    (fragment,) = (
        ZeroRedundancyOptimizer(params, torch.optim.ASGD, partition="even", lr=0.1).fragments_of(params[0]) or ()
    )
    assert fragment.length == params[0].numel()
    with pytest.raises(ValueError, match="partition must be one of 'greedy', 'even', got 'flat'"):
        ZeroRedundancyOptimizer(params, torch.optim.SGD, partition="flat", lr=0.1)
    with pytest.raises(ValueError, match="construction failed on rank 1|partition"):
        ZeroRedundancyOptimizer(params, torch.optim.SGD, partition="even" if rank == 0 else "greedy", lr=0.1)


def test_even_partition_refuses_what_it_cannot_step() -> None:
    run_on_ranks(_refusals_body, 2)
