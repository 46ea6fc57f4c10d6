"""Optimizer state of a parameter that is frozen when the ZeroRedundancyOptimizer places it: no rank owns such a
parameter, yet torch's optimizer keeps its state (loaded, or made at construction as Adagrad's ``sum``)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import distoptim.checkpoint
from distoptim import ZeroRedundancyOptimizer
from tests._dist import run_on_ranks
from tests._reference import assert_same_tensors, averaged_gradients, make_params, set_gradients

SPEC = [[((8, 4), torch.float32, True), ((8,), torch.float32, True), ((3, 8), torch.float32, True)]]


def _train(optimizers: list[Any], copies: list[list[torch.Tensor]], rank: int, steps: range) -> None:
    for step in steps:
        set_gradients(averaged_gradients(copies[0], rank, step), *copies)
        for optimizer in optimizers:
            optimizer.step()


def _trained_then_frozen_body(rank: int, world_size: int, optimizer_class: type, kwargs: dict[str, Any]) -> None:
    (plain,) = make_params(SPEC)
    reference = optimizer_class(plain, **kwargs)
    _train([reference], [plain], rank, range(2))
    plain[0].requires_grad_(False)
    _train([reference], [plain], rank, range(2, 3))
    saved = copy.deepcopy(reference.state_dict())
    ours = [p.detach().clone().requires_grad_(p.requires_grad) for p in plain]
    zero = ZeroRedundancyOptimizer(ours, optimizer_class, **kwargs)  # ours[0] frozen: no rank owns it
    with pytest.raises(ValueError, match=r"parameter 0 has optimizer state .* requires_grad=False"):
        zero.load_state_dict(saved)
    ours[0].requires_grad_(True)  # the fix the message names: trainable while loading, frozen again after
    zero.load_state_dict(saved)
    ours[0].requires_grad_(False)
    _train([zero], [ours], rank, range(3, 4))
    _train([reference], [plain], rank, range(3, 4))
    for params in (plain, ours):
        params[0].requires_grad_(True)
    _train([zero, reference], [ours, plain], rank, range(4, 6))
    assert_same_tensors(ours, plain, "after unfreezing")


@pytest.mark.parametrize(
    ("optimizer_class", "kwargs"),
    [(torch.optim.Adam, {"lr": 0.1}), (torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.1})],
)
def test_state_of_a_parameter_frozen_at_placement_is_refused_at_load_not_dropped(
    optimizer_class: type, kwargs: dict[str, Any]
) -> None:
    run_on_ranks(_trained_then_frozen_body, 2, optimizer_class, kwargs)


def _adagrad_saved_with_parameter_0_frozen(rank: int) -> dict[str, Any]:
    """A consolidated Adagrad state dict (on every rank) of two steps with parameter 0 frozen when placed: its
    ``sum`` is the constructor's 0.1, untrained."""
    (saving_params,) = make_params(SPEC)
    saving_params[0].requires_grad_(False)
    saving = ZeroRedundancyOptimizer(saving_params, torch.optim.Adagrad, lr=0.05, initial_accumulator_value=0.1)
    _train([saving], [saving_params], rank, range(2))
    saving.consolidate_state_dict(0)
    objects = [saving.state_dict() if rank == 0 else None]
    torch.distributed.broadcast_object_list(objects, 0)
    assert objects[0] is not None
    return objects[0]


def _failed_add_keeps_loaded_state_body(rank: int, world_size: int) -> None:
    """A parameter frozen when placed holds its loaded state until it has an owner. An ``add_param_group`` whose
    placing fails after giving it one (here a listener raises) puts that state back: the retry and the steps after
    train as torch's optimizer, which never dropped it."""
    objects = [_adagrad_saved_with_parameter_0_frozen(rank)]
    spec = [[*SPEC[0], ((5,), torch.float32, True)]]  # the first three as SPEC's, and one added later
    (ours,) = make_params(spec)
    (plain,) = make_params(spec)
    for params in (ours, plain):
        params[0].requires_grad_(False)
    zero = ZeroRedundancyOptimizer(ours[:3], torch.optim.Adagrad, lr=0.05)
    reference = torch.optim.Adagrad(plain[:3], lr=0.05)
    zero.load_state_dict(copy.deepcopy(objects[0]))
    reference.load_state_dict(copy.deepcopy(objects[0]))
    for params in (ours, plain):
        params[0].requires_grad_(True)

    def fail() -> None:
        raise RuntimeError("injected")

    zero.placer.listeners.insert(0, fail)  # after the placing that gives parameter 0 an owner and its state
    with pytest.raises(RuntimeError, match="injected"):
        zero.add_param_group({"params": [ours[3]], "lr": 0.02})
    zero.placer.listeners.remove(fail)
    zero.add_param_group({"params": [ours[3]], "lr": 0.02})
    reference.add_param_group({"params": [plain[3]], "lr": 0.02})
    _train([zero, reference], [ours, plain], rank, range(2, 4))
    assert_same_tensors(ours, plain, "after a failed add_param_group")
    _same_consolidated_state(zero, reference, rank)


def test_a_failed_add_param_group_keeps_the_loaded_state_of_a_parameter_frozen_when_placed() -> None:
    run_on_ranks(_failed_add_keeps_loaded_state_body, 2)


def _same_consolidated_state(zero: ZeroRedundancyOptimizer, reference: torch.optim.Optimizer, rank: int) -> None:
    zero.consolidate_state_dict(0)
    if rank == 0:
        got, want = zero.state_dict()["state"], reference.state_dict()["state"]
        assert sorted(got) == sorted(want)
        for index, entry in want.items():
            assert sorted(got[index]) == sorted(entry), index
            assert_same_tensors([got[index][k] for k in entry], list(entry.values()), f"state[{index}]")


def _construction_state_body(rank: int, world_size: int) -> None:
    (ours,) = make_params(SPEC)
    (plain,) = make_params(SPEC)
    for params in (ours, plain):
        params[1].requires_grad_(False)
    kwargs = {"lr": 0.1, "initial_accumulator_value": 0.1, "lr_decay": 0.01}
    zero = ZeroRedundancyOptimizer(ours, torch.optim.Adagrad, **kwargs)
    reference = torch.optim.Adagrad(plain, **kwargs)
    _train([zero, reference], [ours, plain], rank, range(2))
    _same_consolidated_state(zero, reference, rank)  # no rank owns parameter 1
    for params in (ours, plain):
        params[1].requires_grad_(True)
    _same_consolidated_state(zero, reference, rank)  # owned now, not stepped yet
    _train([zero, reference], [ours, plain], rank, range(2, 4))
    _same_consolidated_state(zero, reference, rank)
    assert_same_tensors(ours, plain, "after unfreezing")
    for optimizer in (zero, reference):  # torch's add_param_group makes no state: none until its first step
        optimizer.add_param_group({"params": [torch.ones(5, requires_grad=True)]})
    _same_consolidated_state(zero, reference, rank)


def test_consolidated_state_holds_what_adagrad_makes_at_construction_for_frozen_parameters() -> None:
    run_on_ranks(_construction_state_body, 2)


def _sharded_body(rank: int, world_size: int, path: str) -> None:
    (trained,) = make_params(SPEC)
    kwargs = {"lr": 0.1}
    saving = ZeroRedundancyOptimizer(trained, torch.optim.Adam, **kwargs)
    _train([saving], [trained], rank, range(2))
    distoptim.checkpoint.save({"optim": saving.sharded_state_dict()}, path)
    ours = [p.detach().clone().requires_grad_(True) for p in trained]
    ours[0].requires_grad_(False)  # frozen when placed: no rank owns it
    loading = ZeroRedundancyOptimizer(ours, torch.optim.Adam, **kwargs)
    state = {"optim": loading.sharded_state_dict()}
    distoptim.checkpoint.load(state, path)
    with pytest.raises(ValueError, match=r"load_sharded_state_dict: parameter 0 has optimizer state from training"):
        loading.load_sharded_state_dict(state["optim"])
    ours[0].requires_grad_(True)  # the fix the message names: trainable while loading (it gets an owner)
    state = {"optim": loading.sharded_state_dict()}
    distoptim.checkpoint.load(state, path)
    loading.load_sharded_state_dict(state["optim"])
    _train([saving, loading], [trained, ours], rank, range(2, 4))
    assert_same_tensors(ours, trained, "after loading")


def test_a_sharded_load_refuses_to_drop_the_state_of_a_parameter_frozen_when_placed(tmp_path: Path) -> None:
    run_on_ranks(_sharded_body, 2, str(tmp_path / "ckpt"))


class _EmaSGD(torch.optim.SGD):
    """A torch optimizer that makes state at construction with no ``step`` count: an average of the weights."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["average"] = p.detach().clone()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["average"].lerp_(p, 0.5)
        return loss


def _construction_state_without_step_body(rank: int, world_size: int) -> None:
    (plain,) = make_params(SPEC)
    (ours,) = make_params(SPEC)
    for params in (ours, plain):
        params[1].requires_grad_(False)
    reference, zero = _EmaSGD(plain, lr=0.1), ZeroRedundancyOptimizer(ours, _EmaSGD, lr=0.1)
    _train([zero, reference], [ours, plain], rank, range(2))
    zero.consolidate_state_dict(0)
    objects = [zero.state_dict() if rank == 0 else None]
    torch.distributed.broadcast_object_list(objects, 0)
    for saved in (reference.state_dict(), objects[0]):  # torch's dict, and its own: the frozen one's untrained
        (again,) = make_params(SPEC)
        again[1].requires_grad_(False)
        ZeroRedundancyOptimizer(again, _EmaSGD, lr=0.1).load_state_dict(copy.deepcopy(saved))
    trained = copy.deepcopy(reference.state_dict())
    trained["state"][1]["average"] += 1.0  # state it trained with: refused still
    (again,) = make_params(SPEC)
    again[1].requires_grad_(False)
    with pytest.raises(ValueError, match=r"parameter 1 has optimizer state .* requires_grad=False"):
        ZeroRedundancyOptimizer(again, _EmaSGD, lr=0.1).load_state_dict(trained)


def test_state_a_class_makes_at_construction_without_a_step_count_loads() -> None:
    run_on_ranks(_construction_state_without_step_body, 2)


def _loaded_construction_state_body(rank: int, world_size: int, partition: str) -> None:
    objects = [_adagrad_saved_with_parameter_0_frozen(rank)]
    (ours,) = make_params(SPEC)
    (plain,) = make_params(SPEC)
    for params in (ours, plain):
        params[0].requires_grad_(False)
    zero = ZeroRedundancyOptimizer(ours, torch.optim.Adagrad, partition=partition, lr=0.05)  # its sum would be 0
    reference = torch.optim.Adagrad(plain, lr=0.05)
    zero.load_state_dict(copy.deepcopy(objects[0]))
    reference.load_state_dict(copy.deepcopy(objects[0]))
    _same_consolidated_state(zero, reference, rank)  # the loaded sum 0.1, as torch holds
    for params in (ours, plain):
        params[0].requires_grad_(True)
    _same_consolidated_state(zero, reference, rank)  # owned now, not stepped yet
    _train([zero, reference], [ours, plain], rank, range(2, 3))
    assert_same_tensors(ours, plain, "after unfreezing")
    _same_consolidated_state(zero, reference, rank)


@pytest.mark.parametrize("partition", ["greedy", "even"])
def test_a_frozen_parameter_keeps_the_construction_state_it_loaded(partition: str) -> None:
    run_on_ranks(_loaded_construction_state_body, 2, partition)
