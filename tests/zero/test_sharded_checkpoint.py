"""Sharded checkpoints through torch.distributed.checkpoint: each rank writes its own fragments, and a checkpoint
resumes bit-exactly at another world size and partition, master weights included."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from distoptim import ZeroRedundancyOptimizer
from tests._dist import run_on_ranks
from tests._reference import assert_same_tensors, averaged_gradients, flatten, make_params, set_gradients

F32, BF16 = torch.float32, torch.bfloat16
SPEC = [
    [((33, 7), F32, True), ((0,), F32, True), ((5,), F32, True), ((4, 4), F32, False)],
    [((6, 2), BF16, True), ((17,), F32, True)],
]
KWARGS = {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}


def _groups(params: list[list[torch.Tensor]]) -> list[dict[str, Any]]:
    return [{"params": params[0]}, {"params": params[1], "lr": 0.005}]


def _zero(params: list[list[torch.Tensor]], partition: str, master: bool) -> ZeroRedundancyOptimizer:
    return ZeroRedundancyOptimizer(
        _groups(params), torch.optim.AdamW, partition=partition, master_dtype=F32 if master else None, **KWARGS
    )


class _Reference:
    """One process: AdamW on fp32 copies of the bf16 parameters when ``master``, on the parameters otherwise."""

    def __init__(self, params: list[list[torch.Tensor]], master: bool) -> None:
        self.params = flatten(params)
        self.stepped = [
            p.detach().float().requires_grad_(p.requires_grad) if master and p.dtype != F32 else p for p in self.params
        ]
        first = len(params[0])
        self.optimizer = torch.optim.AdamW(_groups([self.stepped[:first], self.stepped[first:]]), **KWARGS)

    def step(self, grads: list[torch.Tensor | None]) -> None:
        set_gradients([None if g is None else g.to(s.dtype) for g, s in zip(grads, self.stepped)], self.stepped)
        self.optimizer.step()
        with torch.no_grad():
            for param, stepped in zip(self.params, self.stepped):
                if stepped is not param:
                    param.copy_(stepped)


def _train(
    zero: ZeroRedundancyOptimizer, reference: _Reference, ours: list[torch.Tensor], rank: int, steps: range
) -> None:
    for step in steps:
        grads = averaged_gradients(ours, rank, step)
        set_gradients(grads, ours)
        zero.step()
        reference.step(grads)
        assert_same_tensors(ours, reference.params, f"step {step}")


def _bytes(values: Any) -> int:
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def _save_body(rank: int, world_size: int, path: str, partition: str, master: bool) -> dict[str, Any]:
    ours, theirs = make_params(SPEC), make_params(SPEC)
    zero, reference = _zero(ours, partition, master), _Reference(theirs, master)
    _train(zero, reference, flatten(ours), rank, range(3))
    dcp.save(
        {"optim": zero.sharded_state_dict(), "model": {str(i): p for i, p in enumerate(flatten(ours))}},
        checkpoint_id=path,
    )
    own = sum(
        v.numel() * v.element_size() for e in zero.state.values() for v in e.values() if isinstance(v, torch.Tensor)
    )
    own += sum(t.tensor.numel() * t.tensor.element_size() for t in zero.local_shard.masters)
    written = os.path.getsize(os.path.join(path, f"__{rank}_0.distcp"))
    model_bytes = sum(p.numel() * p.element_size() for p in flatten(ours))
    assert written <= own + model_bytes + 64 * 1024, (
        written,
        own,
    )  # its own shard (and model copy), not the whole state
    return {
        "params": [p.detach().clone() for p in flatten(ours)],
        "stepped": [p.detach().clone() for p in reference.stepped],
        "reference": reference.optimizer.state_dict(),
    }


def _load_body(rank: int, world_size: int, path: str, partition: str, master: bool, saved: dict[str, Any]) -> None:
    ours, theirs = make_params(SPEC), make_params(SPEC)
    with torch.no_grad():
        for param, other, value in zip(flatten(ours), flatten(theirs), saved["params"]):
            param.copy_(value)
            other.copy_(value)
    zero, reference = _zero(ours, partition, master), _Reference(theirs, master)
    with torch.no_grad():
        for stepped, value in zip(reference.stepped, saved["stepped"]):
            stepped.copy_(value)
    reference.optimizer.load_state_dict(saved["reference"])
    zero.param_groups[0]["lr"] = 123.0  # the checkpoint's hyperparameters win
    state = {"optim": zero.sharded_state_dict()}
    dcp.load(state, checkpoint_id=path)
    zero.load_sharded_state_dict(state["optim"])
    assert zero.param_groups[0]["lr"] == KWARGS["lr"]
    _train(zero, reference, flatten(ours), rank, range(3, 6))
    with pytest.raises(ValueError, match="not a loaded sharded optimizer state"):
        zero.load_sharded_state_dict({})


@pytest.mark.parametrize(
    ("save", "load", "master"),
    [((3, "greedy"), (2, "even"), False), ((4, "even"), (3, "greedy"), False), ((2, "even"), (3, "even"), True)],
)
def test_sharded_checkpoint_resumes_at_another_world_size_and_partition(
    tmp_path: Path, save: tuple[int, str], load: tuple[int, str], master: bool
) -> None:
    path = str(tmp_path / "checkpoint")
    saved = run_on_ranks(_save_body, save[0], path, save[1], master)[0]
    run_on_ranks(_load_body, load[0], path, load[1], master, saved)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "distoptim", "checkpoint", *args], capture_output=True, text=True, timeout=120
    )


def test_conversion_to_and_from_torch_optim_format(tmp_path: Path) -> None:
    """DIR -> torch.optim's dict equals the reference optimizer's; torch.optim's dict -> DIR resumes bit-exactly."""
    sharded, converted = str(tmp_path / "sharded"), tmp_path / "optim.pt"
    saved = run_on_ranks(_save_body, 3, sharded, "even", False)[0]
    result = _cli(sharded, "--to-torch", str(converted))
    assert result.returncode == 0, result.stderr
    ours, reference = torch.load(converted, weights_only=False), saved["reference"]
    assert ours["param_groups"] == reference["param_groups"]
    sizes = [torch.Size(shape).numel() for group in SPEC for shape, _, _ in group]
    expected = {index: entry for index, entry in reference["state"].items() if sizes[index] > 0}
    assert ours["state"].keys() == expected.keys()
    for index, entry in expected.items():
        for name, value in entry.items():
            assert torch.equal(ours["state"][index][name], value), (index, name)
    plain = torch.optim.AdamW(_groups(make_params(SPEC)), **KWARGS)
    plain.load_state_dict(ours)  # a plain optimizer takes it

    from_torch = str(tmp_path / "from-torch")
    torch.save(reference, tmp_path / "reference.pt")
    result = _cli(from_torch, "--from-torch", str(tmp_path / "reference.pt"))
    assert result.returncode == 0, result.stderr
    run_on_ranks(_load_body, 2, from_torch, "greedy", False, saved)
    missing = _cli(str(tmp_path / "nowhere"), "--to-torch", str(converted))
    assert missing.returncode == 1 and "error:" in missing.stderr
    wrong_key = _cli(sharded, "--to-torch", str(converted), "--key", "model")
    assert wrong_key.returncode == 1 and "holds no distoptim optimizer under 'model'" in wrong_key.stderr
