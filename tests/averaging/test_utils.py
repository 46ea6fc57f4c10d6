"""``distoptim.averagers``' averaging functions against torch's ``model_averaging.utils``, and torch's texts where
torch warns or raises for the same case (issue 44, deviations 4 and 5).

Three ranks: dividing by 3 is inexact, so equal bits mean the same arithmetic (the same promoted dtype, division
before the sum); a subgroup of two leaves the third rank outside.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.model_averaging import averagers as torch_averagers
from torch.distributed.algorithms.model_averaging import utils as torch_utils
from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGDOptimizer

from distoptim import PostLocalSGDOptimizer
from distoptim.averagers import (
    PeriodicModelAverager,
    average_parameters,
    average_parameters_or_parameter_groups,
    get_params_to_average,
)
from tests._dist import run_on_ranks


def _params(rank: int) -> list[nn.Parameter]:
    """Mixed dtypes (torch averages them in their promoted dtype), values that differ per rank, some with grads."""
    gen = torch.Generator().manual_seed(rank)
    dtypes = (torch.float32, torch.float16, torch.float64, torch.bfloat16, torch.float32)
    params = [nn.Parameter(torch.randn(3, 5, generator=gen).to(dtype)) for dtype in dtypes]
    for param in params[::2]:
        param.grad = torch.ones_like(param)
    return params


def _clone(params: list[nn.Parameter]) -> list[nn.Parameter]:
    clones = [nn.Parameter(p.detach().clone()) for p in params]
    for clone, param in zip(clones, params, strict=True):
        clone.grad = None if param.grad is None else param.grad.clone()
    return clones


def _assert_same(ours: list[nn.Parameter], theirs: list[nn.Parameter], what: str) -> None:
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: parameter {index} differs"


def _parity_body(rank: int, world_size: int) -> None:
    pair = dist.new_group([0, 1])  # rank 2 is outside it
    for group in (None, pair):
        ours, theirs = _params(rank), _params(rank)
        storages = [p.data_ptr() for p in ours]
        average_parameters((p for p in ours), group)  # a generator, as torch's signature allows
        torch_utils.average_parameters(iter(theirs), group)
        _assert_same(ours, theirs, f"average_parameters over {group}")
        assert [p.data_ptr() for p in ours] == storages, "averaged in place: storage kept"
        if group is pair and rank == 2:
            _assert_same(ours, _params(rank), "a rank outside the group")
    for make_input in (list, lambda ps: [{"params": ps[:2], "lr": 0.1}, {"params": ps[2:]}]):
        ours, theirs = _params(rank), _params(rank)
        assert get_params_to_average(make_input(ours)) == ours[::2]
        assert [id(p) for p in torch_utils.get_params_to_average(make_input(theirs))] == [id(p) for p in theirs[::2]]
        average_parameters_or_parameter_groups(make_input(ours), None)
        torch_utils.average_parameters_or_parameter_groups(make_input(theirs), None)
        _assert_same(ours, theirs, "average_parameters_or_parameter_groups")
    _check_missing_step_warning()
    _check_averager_texts()


def _warning_text(optimizer: Any, state_dict: dict[str, Any]) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.load_state_dict(state_dict)
    assert len(caught) == 1 and caught[0].category is UserWarning, [str(w.message) for w in caught]
    return str(caught[0].message)


def _check_missing_step_warning() -> None:
    """A state dict without "step" warns with torch's text (ours may only add to its end)."""
    params = _clone(_params(dist.get_rank()))
    ours = PostLocalSGDOptimizer(torch.optim.SGD(params, lr=0.1), PeriodicModelAverager(period=2))
    theirs = TorchPostLocalSGDOptimizer(torch.optim.SGD(params, lr=0.1), torch_averagers.PeriodicModelAverager(2))
    without_step = {k: v for k, v in ours.state_dict().items() if k != "step"}
    torch_text = _warning_text(theirs, without_step)
    assert torch_text == "Loaded state dict does not contain a step counter for an averager. Setting step counter to 0."
    assert _warning_text(ours, without_step).startswith(torch_text)


def _message(build: Any) -> tuple[type, str]:
    """What ``build()`` raises or warns (the first warning), as (class, text)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            build()
        except Exception as error:
            return type(error), str(error)
    assert caught, "neither raised nor warned"
    return caught[0].category, str(caught[0].message)


def _check_averager_texts() -> None:
    """Where torch's averagers raise or warn, ours do with the same class and torch's text first (3 ranks)."""
    cases = [
        ("PeriodicModelAverager", {"period": 0}),
        ("PeriodicModelAverager", {"period": 2, "warmup_steps": -1}),
        ("PeriodicModelAverager", {"period": 1}),
        ("HierarchicalModelAverager", {"period_group_size_dict": {}}),
        ("HierarchicalModelAverager", {"period_group_size_dict": {0: 3}}),
        ("HierarchicalModelAverager", {"period_group_size_dict": {1: 3}}),
        ("HierarchicalModelAverager", {"period_group_size_dict": {2: 1, 4: 1}}),
        ("HierarchicalModelAverager", {"period_group_size_dict": {4: 3}, "warmup_steps": -1}),
    ]
    from torch.distributed.algorithms.model_averaging import hierarchical_model_averager as torch_hierarchical

    import distoptim.averagers as ours

    theirs = {"PeriodicModelAverager": torch_averagers, "HierarchicalModelAverager": torch_hierarchical}
    for name, kwargs in cases:
        torch_class, torch_text = _message(functools.partial(getattr(theirs[name], name), **kwargs))
        our_class, our_text = _message(functools.partial(getattr(ours, name), **kwargs))
        assert our_class is torch_class and our_text.startswith(torch_text), (name, kwargs, our_text, torch_text)


def test_averaging_functions_match_torch_bit_for_bit() -> None:
    run_on_ranks(_parity_body, 3)


def test_unsupported_entries_raise_torch_error_and_text() -> None:
    plain = torch.zeros(2)
    for bad, got in (([plain], torch.Tensor), ([3], int), (plain, torch.Tensor), ({"params": []}, str)):
        with pytest.raises(NotImplementedError) as ours:
            get_params_to_average(bad)  # type: ignore[arg-type]
        torch_text = f"Parameter input of type {got} is not supported"
        assert str(ours.value).startswith(torch_text), str(ours.value)
        assert isinstance(ours.value, TypeError), "still the TypeError distoptim raised before"
        with pytest.raises(NotImplementedError, match=f"^{torch_text}$"):  # torch iterates a dict's keys
            torch_utils.get_params_to_average(bad)  # type: ignore[arg-type]
