"""``distoptim.checkpoint``: a sharded save that appears only when complete, a load that refuses what is not one, and
checkpoints in which a parameter had no optimizer state yet (or no master weights) resume exactly."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distoptim import ZeroRedundancyOptimizer, checkpoint
from tests._dist import run_on_ranks
from tests._reference import assert_same_tensors, averaged_gradients, flatten, make_params, set_gradients

SPEC = [[((6, 4), torch.float32, True), ((5,), torch.float32, True), ((7,), torch.bfloat16, True)]]
LATE = 1  # the parameter that gets its first gradient only after the checkpoint


def _gradients(params: list[torch.Tensor], rank: int, step: int) -> list[torch.Tensor | None]:
    grads = averaged_gradients(params, rank, step)
    if step < 2:
        grads[LATE] = None
    return grads


def _steps(zero: ZeroRedundancyOptimizer, params: list[torch.Tensor], rank: int, steps: range) -> None:
    for step in steps:
        set_gradients(_gradients(params, rank, step), params)
        zero.step()


def _reference(rank: int) -> list[torch.Tensor]:
    """Four uninterrupted steps of a plain AdamW (master copy of the bf16 parameter kept by hand)."""
    params = flatten(make_params(SPEC))
    stepped = [p.detach().float().requires_grad_() if p.dtype != torch.float32 else p for p in params]
    optimizer = torch.optim.AdamW(stepped, lr=0.01)
    for step in range(4):
        grads = _gradients(params, rank, step)
        set_gradients([None if g is None else g.float() for g in grads], stepped)
        optimizer.step()
        with torch.no_grad():
            params[2].copy_(stepped[2])
    return params


def _resume_body(rank: int, world_size: int, root: str) -> None:
    path = Path(root) / "ckpt"
    params = flatten(make_params(SPEC))
    zero = ZeroRedundancyOptimizer(params, torch.optim.AdamW, partition="even", master_dtype=torch.float32, lr=0.01)
    _steps(zero, params, rank, range(2))
    checkpoint.save({"optim": zero.sharded_state_dict(), "model": {str(i): p for i, p in enumerate(params)}}, path)
    checkpoint.save({"optim": zero.sharded_state_dict(), "model": {str(i): p for i, p in enumerate(params)}}, path)
    assert sorted(os.listdir(root)) == ["ckpt"], "a save leaves only the finished checkpoint behind"
    late = [t.tensor for group in zero.local_shard.groups for t in group if t.index == LATE]
    assert not any(t in zero.state for t in late), "exporting for a save gave a stateless parameter some state"

    # a fresh run at another partition: the late parameter had no state when saved, and starts without any
    resumed = flatten(make_params(SPEC, seed=7))
    zero = ZeroRedundancyOptimizer(resumed, torch.optim.AdamW, partition="greedy", master_dtype=torch.float32, lr=0.5)
    state = {"optim": zero.sharded_state_dict(), "model": {str(i): p for i, p in enumerate(resumed)}}
    checkpoint.load(state, path)
    zero.load_sharded_state_dict(state["optim"])
    index = {id(p): i for i, p in enumerate(resumed)}
    assert all(index[id(t.param)] != LATE for t in zero.local_shard.masters if t.tensor in zero.state)
    _steps(zero, resumed, rank, range(2, 4))
    assert_same_tensors(resumed, _reference(rank), "resumed")

    # a checkpoint without master weights loads into an optimizer that keeps them: taken from the parameters
    plain = flatten(make_params(SPEC))
    unmastered = ZeroRedundancyOptimizer(plain, torch.optim.AdamW, lr=0.01)
    _steps(unmastered, plain, rank, range(3))
    checkpoint.save({"optim": unmastered.sharded_state_dict()}, path)
    mastered = ZeroRedundancyOptimizer(
        flatten(make_params(SPEC)), torch.optim.AdamW, partition="even", master_dtype=torch.float32, lr=0.01
    )
    state = {"optim": mastered.sharded_state_dict()}
    checkpoint.load(state, path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mastered.load_sharded_state_dict(state["optim"])
    warned = any("no master weights" in str(w.message) for w in caught)
    assert warned == bool(mastered.local_shard.masters), "a warning where a master copy was started afresh"
    for local in mastered.local_shard.masters:
        assert torch.equal(local.tensor, local.param_piece().float())

    # a save killed between moving the old checkpoint aside and the new one into place: the old one still loads,
    # and the next save puts it back before replacing it
    if rank == 0:
        path.rename(Path(root) / ".ckpt.previous")
    dist.barrier()
    state = {"optim": unmastered.sharded_state_dict()}
    with pytest.warns(UserWarning, match="a save was interrupted while replacing it"):
        checkpoint.load(state, path)
    unmastered.load_sharded_state_dict(state["optim"])
    checkpoint.save({"optim": unmastered.sharded_state_dict()}, path)
    assert sorted(os.listdir(root)) == ["ckpt"]


def test_resume_with_a_parameter_that_had_no_state_and_without_master_weights(tmp_path: Path) -> None:
    run_on_ranks(_resume_body, 2, str(tmp_path))


def _refusal_body(rank: int, world_size: int, root: str) -> None:
    params = flatten(make_params(SPEC))
    zero = ZeroRedundancyOptimizer(params, torch.optim.AdamW, lr=0.01)
    cases = {
        "missing": ("does not exist", Path(root) / "nowhere"),
        "foreign": ("not a checkpoint: it has no .metadata", Path(root) / "foreign"),
        "partial": ("did not finish", Path(root) / "partial"),
        "other model": ("lacks 2 of the entries", Path(root) / "other"),
    }
    if rank == 0:
        (Path(root) / "foreign").mkdir()
        (Path(root) / "foreign" / "weights.bin").write_bytes(b"\0")
        (Path(root) / ".partial.partial").mkdir()
        (Path(root) / ".partial.partial" / "__0_0.distcp").write_bytes(b"\0")
    checkpoint.save({"optim": zero.sharded_state_dict(), "model": {"w": params[0]}}, Path(root) / "other")
    for name, (message, path) in cases.items():
        state = {"optim": zero.sharded_state_dict(), "model": {"w": params[0], "v": params[1], "u": params[2]}}
        with pytest.raises(ValueError, match=message):  # on every rank, never a partial load
            checkpoint.load(state, path)
        assert name


def test_incomplete_or_foreign_directories_are_refused_on_every_rank(tmp_path: Path) -> None:
    run_on_ranks(_refusal_body, 2, str(tmp_path))
