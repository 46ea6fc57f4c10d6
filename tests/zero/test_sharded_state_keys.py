"""A sharded load into an optimizer whose hyperparameters make other state than the checkpoint's (SGD without the
saved momentum, Adam without the saved amsgrad): its template has no entry for the saved keys, which DCP would skip,
so the load is refused on every rank rather than dropping them (the saved param groups name the keys)."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from distoptim import ZeroRedundancyOptimizer, checkpoint
from distoptim.checkpoint import convert
from distoptim.checkpoint import dcp_state as sharded
from tests._dist import run_on_ranks
from tests._reference import assert_same_tensors, averaged_gradients, flatten, make_params, set_gradients

BF16, F32 = torch.bfloat16, torch.float32
SPEC = [[((64, 80), F32, True), ((80,), F32, True)], [((40, 16), BF16, True), ((7,), F32, True)]]
CASES = [  # saved with, loaded with (a refusal), the key the load would drop, the setting named
    (torch.optim.SGD, {"momentum": 0.9}, {}, "momentum_buffer", "momentum=0.9"),
    (torch.optim.Adam, {"amsgrad": True}, {}, "max_exp_avg_sq", "amsgrad=True"),
    (
        torch.optim.Adam,
        {"amsgrad": True, "state_format": "int8"},
        {"state_format": "int8"},
        "max_exp_avg_sq",
        "amsgrad",
    ),
    (torch.optim.RMSprop, {"centered": True, "momentum": 0.5}, {"momentum": 0.5}, "grad_avg", "centered=True"),
]


def _zero(params: list[list[torch.Tensor]], optimizer_class: type, kwargs: dict[str, Any]) -> ZeroRedundancyOptimizer:
    groups = [{"params": params[0]}, {"params": params[1], "lr": 0.005}]
    return ZeroRedundancyOptimizer(groups, optimizer_class, lr=0.01, master_dtype=F32, **kwargs)


def _consolidated(zero: ZeroRedundancyOptimizer, rank: int) -> dict[str, Any] | None:
    zero.consolidate_state_dict(0)
    return copy.deepcopy(zero.state_dict()) if rank == 0 else None


def _refused_body(
    rank: int, world_size: int, path: str, optimizer_class: type, saved: dict[str, Any], loaded: dict[str, Any]
) -> str:
    params = make_params(SPEC)
    zero = _zero(params, optimizer_class, saved)
    for step in range(2):
        set_gradients(averaged_gradients(flatten(params), rank, step), flatten(params))
        zero.step()
    state = zero.sharded_state_dict()
    groups = pickle.loads(state["param_groups"])
    assert all(group[sharded.STATE_KEYS] for group in groups), groups  # every saved key, with its parameters
    if "state_format" in saved:  # the first parameter's state kept in int8: its keys as saved
        assert groups[0][sharded.STATE_KEYS]["max_exp_avg_sq.int8_absmax"] == [0], groups
    checkpoint.save({"optim": state}, path)
    expected = _consolidated(zero, rank)

    other = _zero(make_params(SPEC, seed=1), optimizer_class, loaded)
    before = copy.deepcopy(other.param_groups[0])
    template = {"optim": other.sharded_state_dict()}
    checkpoint.load(template, path)
    with pytest.raises(
        ValueError, match=r"holds optimizer state \[.*\] for parameter .* would drop it: build the"
    ) as info:
        other.load_sharded_state_dict(template["optim"])
    assert not other.state and repr(other.param_groups[0]) == repr(before)  # nothing loaded

    again = _zero(make_params(SPEC, seed=1), optimizer_class, saved)  # the fix: the checkpoint's hyperparameters
    template = {"optim": again.sharded_state_dict()}
    checkpoint.load(template, path)
    again.load_sharded_state_dict(template["optim"])
    got = _consolidated(again, rank)
    if rank == 0:
        assert got is not None and expected is not None
        assert got["param_groups"] == expected["param_groups"]
        assert got["state"].keys() == expected["state"].keys()
        for index, entry in expected["state"].items():
            assert got["state"][index].keys() == entry.keys()
            assert_same_tensors(list(got["state"][index].values()), list(entry.values()), f"parameter {index}")
    return str(info.value)


@pytest.mark.parametrize(("optimizer_class", "saved", "loaded", "key", "setting"), CASES)
def test_a_load_whose_template_lacks_saved_state_is_refused_on_every_rank(
    tmp_path: Path, optimizer_class: type, saved: dict[str, Any], loaded: dict[str, Any], key: str, setting: str
) -> None:
    for message in run_on_ranks(_refused_body, 2, str(tmp_path / "ck"), optimizer_class, saved, loaded):
        assert key in message and setting in message and "momentum=0.9, amsgrad=True" in message, message


def _message_body(
    rank: int, world_size: int, path: str, optimizer_class: type, saved: dict[str, Any], loaded: dict[str, Any]
) -> str:
    other = _zero(make_params(SPEC, seed=1), optimizer_class, loaded)
    template = {"optim": other.sharded_state_dict()}
    checkpoint.load(template, path)
    try:
        other.load_sharded_state_dict(template["optim"])
    except ValueError as error:
        return str(error)
    return "loaded"


def _older_body(rank: int, world_size: int, path: str) -> None:
    """A checkpoint without ``state_keys`` (an earlier distoptim's) loads as it did: unchecked."""
    other = _zero(make_params(SPEC, seed=1), torch.optim.SGD, {})
    template = {"optim": other.sharded_state_dict()}
    checkpoint.load(template, path)
    groups = pickle.loads(template["optim"]["param_groups"])
    for group in groups:
        del group[sharded.STATE_KEYS]
    template["optim"]["param_groups"] = pickle.dumps(groups)
    other.load_sharded_state_dict(template["optim"])
    assert other.param_groups[0]["momentum"] == 0.9 and not other.state


def test_an_older_checkpoint_without_state_keys_loads_as_before(tmp_path: Path) -> None:
    run_on_ranks(_refused_body, 2, str(tmp_path / "ck"), torch.optim.SGD, {"momentum": 0.9}, {})
    run_on_ranks(_older_body, 2, str(tmp_path / "ck"))


def test_a_checkpoint_converted_from_torch_names_its_keys(tmp_path: Path) -> None:
    params = flatten(make_params(SPEC))
    plain = torch.optim.SGD([{"params": params[:2]}, {"params": params[2:], "lr": 0.005}], lr=0.01, momentum=0.9)
    set_gradients([torch.ones_like(p) for p in params], params)
    plain.step()
    convert.torch_optim_to_dcp(plain.state_dict(), tmp_path / "ck")
    messages = run_on_ranks(_message_body, 2, str(tmp_path / "ck"), torch.optim.SGD, {}, {})
    assert all("['momentum_buffer']" in message for message in messages), messages
    back = convert.dcp_to_torch_optim(tmp_path / "ck")
    assert all(sharded.STATE_KEYS not in group for group in back["param_groups"])
