"""``python -m distoptim checkpoint --from-torch`` of optimizers whose state is not all parameter-shaped (Adafactor's
row and column factors, scalar steps): the shapes it records are the parameters', so the sharded checkpoint loads
into ZeroRedundancyOptimizer and trains on as the plain optimizer does; where the state cannot tell a shape, the
shapes are asked for (``--params``), never guessed. Each conversion says what it wrote."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from distoptim import ZeroRedundancyOptimizer
from distoptim.checkpoint import convert
from tests._dist import run_on_ranks
from tests._reference import assert_same_tensors, averaged_gradients, local_gradients, set_gradients

SHAPES = [(8, 16), (16,), (3, 4, 5), (1, 6), (5, 1)]  # Adafactor factors 2-D and 3-D ones, keeps 1-D ones whole


def _params() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator).requires_grad_() for shape in SHAPES]


def _train(
    optimizers: list[torch.optim.Optimizer], params: list[list[torch.Tensor]], rank: int, steps: range, what: str = ""
) -> None:
    for step in steps:
        grads = averaged_gradients(params[0], rank, step) if rank >= 0 else local_gradients(params[0], 0, step)
        for optimizer, own in zip(optimizers, params):
            set_gradients([g.clone() for g in grads], own)
            optimizer.step()
        for other in params[1:]:
            assert_same_tensors(params[0], other, f"{what} step {step}")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "distoptim", "checkpoint", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def _resume_body(rank: int, world_size: int, path: str, saved: dict[str, Any]) -> None:
    """The converted checkpoint loads into ZeRO (both partitions) and trains on exactly as the plain optimizer."""
    for partition in ("greedy", "even"):
        ours, theirs = _params(), _params()
        with torch.no_grad():
            for param, other, value in zip(ours, theirs, saved["params"]):
                param.copy_(value)
                other.copy_(value)
        zero = ZeroRedundancyOptimizer(ours, torch.optim.Adafactor, partition=partition, lr=0.01)
        plain = torch.optim.Adafactor(theirs, lr=0.01)
        plain.load_state_dict(copy.deepcopy(saved["optim"]))  # torch.optim keeps (steps) the tensors it loads
        state = {"optim": zero.sharded_state_dict()}
        dcp.load(state, checkpoint_id=path)
        zero.load_sharded_state_dict(state["optim"])
        _train([zero, plain], [ours, theirs], rank, range(3, 6), partition)


def test_an_adafactor_state_dict_converts_and_resumes_in_zero(tmp_path: Path) -> None:
    params = _params()
    plain = torch.optim.Adafactor(params, lr=0.01)
    _train([plain], [params], -1, range(3))  # one process: no group
    saved = {"optim": plain.state_dict(), "params": [p.detach().clone() for p in params]}
    torch.save(saved["optim"], tmp_path / "optim.pt")
    result = _cli(str(tmp_path / "sharded"), "--from-torch", str(tmp_path / "optim.pt"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(f"wrote {tmp_path / 'sharded'}: sharded checkpoint"), result.stdout
    assert "5 parameters in 1 param group, 14 state entries for 5 of them; under key 'optim'" in result.stdout
    assert convert.parameter_shapes(saved["optim"]) == SHAPES
    run_on_ranks(_resume_body, 2, str(tmp_path / "sharded"), saved)
    back = _cli(str(tmp_path / "sharded"), "--to-torch", str(tmp_path / "back.pt"))
    assert back.returncode == 0, back.stderr
    assert back.stdout.strip() == (
        f"wrote {tmp_path / 'back.pt'}: torch.optim state dict, 5 parameters in 1 param group, 14 state entries for "
        "5 of them; from key 'optim'"
    )
    round_trip = torch.load(tmp_path / "back.pt", weights_only=False)
    for index, entry in saved["optim"]["state"].items():
        for name, value in entry.items():
            assert torch.equal(round_trip["state"][index][name], value), (index, name)


def test_shapes_the_state_cannot_tell_are_asked_for(tmp_path: Path) -> None:
    """An optimizer's own entry of another shape (a preconditioner) shows nothing of the parameter: the conversion
    asks for the shapes (a list, or the model's state dict through param_names) and checks them against the state."""
    weight, bias = torch.zeros(4, 3, requires_grad=True), torch.zeros(4, requires_grad=True)
    plain = torch.optim.SGD([("w", weight), ("b", bias)], lr=0.1)
    state = plain.state_dict()
    state["state"] = {0: {"preconditioner": torch.eye(3)}, 1: {"momentum_buffer": torch.ones(4)}}
    torch.save(state, tmp_path / "optim.pt")
    refused = _cli(str(tmp_path / "a"), "--from-torch", str(tmp_path / "optim.pt"))
    assert refused.returncode == 1 and "does not show the parameter's shape" in refused.stderr, refused.stderr
    assert "--params FILE" in refused.stderr and not (tmp_path / "a").exists()
    for name, given in {"list": [(4, 3), (4,)], "model": {"w": weight, "b": bias}}.items():
        torch.save(given, tmp_path / f"{name}.pt")
        result = _cli(
            str(tmp_path / name), "--from-torch", str(tmp_path / "optim.pt"), "--params", str(tmp_path / f"{name}.pt")
        )
        assert result.returncode == 0 and result.stdout.startswith("wrote"), (name, result.stderr)
    torch.save([(4, 3), (5,)], tmp_path / "wrong.pt")
    wrong = _cli(
        str(tmp_path / "b"), "--from-torch", str(tmp_path / "optim.pt"), "--params", str(tmp_path / "wrong.pt")
    )
    assert (
        wrong.returncode == 1 and "parameter 1's state is for shape (4,), but the shapes given say (5,)" in wrong.stderr
    )
    unnamed = {
        **state,
        "param_groups": [{k: v for k, v in g.items() if k != "param_names"} for g in state["param_groups"]],
    }
    with pytest.raises(ValueError, match="carry no param_names"):
        convert.parameter_shapes(unnamed, {"w": weight, "b": bias})
