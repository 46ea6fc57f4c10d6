"""Single-process checks of post-local SGD: input validation, grouping, schedules' arguments, pickling."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

from distoptim.averagers import PeriodicModelAverager, get_params_to_average
from distoptim.comm.averaging import group_by_device, node_subgroup_size
from distoptim.hooks import PostLocalSGDState


def _param(value: float, dtype: torch.dtype = torch.float32, grad: bool = True) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.full((2,), value, dtype=dtype))
    if grad:
        param.grad = torch.zeros_like(param)
    return param


def test_params_to_average_takes_parameters_and_groups_and_skips_missing_grads() -> None:
    a, b, c = _param(1.0), _param(2.0, grad=False), _param(3.0)
    assert get_params_to_average([a, b, c]) == [a, c]
    assert get_params_to_average(p for p in (a, b, c)) == [a, c]
    plain = torch.zeros(2, requires_grad=True)  # optimizers accept plain leaf tensors inside param groups
    plain.grad = torch.zeros(2)
    groups = [{"params": [a, b], "lr": 0.1}, {"params": [c, plain]}]
    assert get_params_to_average(groups) == [a, c, plain]


def test_params_to_average_rejects_what_it_cannot_average() -> None:
    with pytest.raises(TypeError, match="not a single tensor"):
        get_params_to_average(torch.zeros(3))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="plain torch.Tensor, not an nn.Parameter"):
        get_params_to_average([_param(1.0), torch.zeros(2)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="single param-group dict"):
        get_params_to_average({"params": [_param(1.0)]})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="no 'params' entry"):
        get_params_to_average([{"lr": 0.1}])
    with pytest.raises(TypeError, match="has type str"):
        get_params_to_average(["weight"])  # type: ignore[list-item]


def test_group_by_device_keeps_dtypes_together_in_first_appearance_order() -> None:
    f32a, f64, f32b, f16 = _param(1.0), _param(2.0, torch.float64), _param(3.0), _param(4.0, torch.float16)
    runs = group_by_device([f32a, f64, f32b, f16])  # one run per device: torch averages dtypes promoted together
    assert [[id(t) for t in run] for run in runs] == [[id(f32a), id(f64), id(f32b), id(f16)]]


def test_node_subgroup_size_follows_the_launcher_or_takes_the_whole_group() -> None:
    assert node_subgroup_size(8, {"LOCAL_WORLD_SIZE": "4"}) == 4
    assert node_subgroup_size(8, {"LOCAL_WORLD_SIZE": "8"}) == 8
    assert node_subgroup_size(8, {}) == 8  # unknown: one "node"
    assert node_subgroup_size(8, {"LOCAL_WORLD_SIZE": "x"}) == 8
    with pytest.warns(UserWarning, match="does not split a group of 8"):
        assert node_subgroup_size(8, {"LOCAL_WORLD_SIZE": "3"}) == 8


def test_periodic_averager_validates_before_touching_a_process_group() -> None:
    with pytest.raises(ValueError, match=r"^Arg ``period`` must be a positive value\. Got 0"):  # torch's text first
        PeriodicModelAverager(period=0)
    with pytest.raises(ValueError, match=r"^Arg ``warmup_steps`` must be a non-negative number\. Got -1"):
        PeriodicModelAverager(period=2, warmup_steps=-1)
    with pytest.raises(RuntimeError, match="init_process_group"):  # no default group in the test process
        PeriodicModelAverager(period=2)


def test_post_local_sgd_state_pickles() -> None:
    state = PostLocalSGDState(
        process_group=None, subgroup=None, start_localSGD_iter=7, post_local_gradient_allreduce=False
    )
    state.iter = 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no groups to drop: no warning
        clone = pickle.loads(pickle.dumps(state))
    assert (clone.iter, clone.start_localSGD_iter, clone.post_local_gradient_allreduce) == (3, 7, False)
    assert clone.process_group is None and clone.subgroup is None
    with pytest.raises(ValueError, match="start_localSGD_iter must be >= 0"):
        PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=-1)
