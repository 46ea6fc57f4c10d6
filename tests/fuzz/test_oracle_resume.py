"""The oracle of a resumed program: torch's optimizer a resumed job rebuilds (``constructor_to_load``) keeps its
constructor's ``defaults`` through the load, and Adagrad's lazy ``sum`` of a parameter ``add_param_group`` gives
starts from ``self.defaults["initial_accumulator_value"]``, never the group's own (seeds 701768, 702625: the oracle
round-tripped its first optimizer, whose defaults were the program's 0.1, where the resumed subject's are 0)."""

from __future__ import annotations

import json

import pytest

from tests.fuzz.program import Program
from tests.fuzz.session import run_programs

ADAGRAD = {"lr": 0.05, "lr_decay": 0.01, "initial_accumulator_value": 0.1}


def _program(kind: str, mode: str) -> Program:
    actions = [
        {"name": "backward", "args": {"micro": 1, "no_sync": False}},
        {"name": "step", "args": {}},
        {"name": "resume", "args": {"kind": kind}},
        {"name": "add_group", "args": {}},
        {"name": "zero_grad", "args": {"via": "optimizer", "set_to_none": True}},
        {"name": "backward", "args": {"micro": 1, "no_sync": False}},
        {"name": "step", "args": {}},
    ]
    options = {"partition": "even", "bucket_view": False, "master": False, "exact": mode == "zero1"}
    data = {"seed": 1, "features": ["extra"], "mode": mode, "options": options, "optimizer": "Adagrad"}
    return Program.from_json(json.dumps({**data, "kwargs": ADAGRAD, "actions": actions}))


@pytest.mark.parametrize(
    ("kind", "mode"), [("consolidated", "zero1"), ("consolidated", "zero2_hook"), ("sharded", "zero1")]
)
def test_a_group_added_after_a_resume_starts_adagrad_sum_from_the_rebuilt_constructor(kind: str, mode: str) -> None:
    [verdict] = run_programs([_program(kind, mode)])
    assert verdict["category"] == "pass", verdict
