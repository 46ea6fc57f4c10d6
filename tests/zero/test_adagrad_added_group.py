"""Adagrad's ``sum`` for a group added after a consolidated load: torch's lazy init fills it with the rebuilt
optimizer's constructor ``initial_accumulator_value`` (``self.defaults``), never the added group's own value."""

from __future__ import annotations

import copy

import torch

from distoptim import ZeroRedundancyOptimizer
from tests._dist import run_on_ranks
from tests._reference import assert_same_tensors, averaged_gradients, make_params, set_gradients

SPEC = [[((8, 4), torch.float32, True), ((8,), torch.float32, True), ((3, 8), torch.float32, True)]]
EXTRA = [[((5, 3), torch.float32, True)]]


def _step(optimizers: list[torch.optim.Optimizer], copies: list[list[torch.Tensor]], rank: int, step: int) -> None:
    set_gradients(averaged_gradients(copies[0], rank, step), *copies)
    for optimizer in optimizers:
        optimizer.step()


def _resumed_then_added_body(rank: int, world_size: int) -> None:
    (plain,) = make_params(SPEC)
    ours = [p.detach().clone().requires_grad_() for p in plain]
    reference = torch.optim.Adagrad(plain, lr=0.1, initial_accumulator_value=0.1)
    zero = ZeroRedundancyOptimizer(ours, torch.optim.Adagrad, lr=0.1, initial_accumulator_value=0.1)
    _step([reference, zero], [plain, ours], rank, 0)
    zero.consolidate_state_dict(0)
    objects = [zero.state_dict() if rank == 0 else None]
    torch.distributed.broadcast_object_list(objects, 0)
    saved_reference = copy.deepcopy(reference.state_dict())
    reference = torch.optim.Adagrad(plain, lr=0.1)  # torch's defaults but lr: initial_accumulator_value 0
    zero = ZeroRedundancyOptimizer(ours, torch.optim.Adagrad, lr=0.1)
    reference.load_state_dict(saved_reference)
    zero.load_state_dict(objects[0])
    (extra_plain,) = make_params(EXTRA, seed=1)
    extra_ours = [p.detach().clone().requires_grad_() for p in extra_plain]
    reference.add_param_group({"params": extra_plain, "initial_accumulator_value": 0.1})
    zero.add_param_group({"params": extra_ours, "initial_accumulator_value": 0.1})
    for step in (1, 2):
        _step([reference, zero], [plain + extra_plain, ours + extra_ours], rank, step)
    assert_same_tensors(ours + extra_ours, plain + extra_plain, "after the added group's steps")


def test_added_group_after_resume_starts_adagrad_sum_from_the_rebuilt_constructor() -> None:
    run_on_ranks(_resumed_then_added_body, 2)
