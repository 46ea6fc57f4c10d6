"""``distoptim.checkpoint``: a sharded save that appears only when complete (also when written in the background), a
load that refuses what is not one (or is damaged) before loading anything, checkpoints in which a parameter had no
optimizer state yet (or no master weights) resume exactly, and none of it needs numpy."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from distoptim import ZeroRedundancyOptimizer, checkpoint
from distoptim.checkpoint.convert import dcp_to_torch_optim
from tests._dist import run_on_ranks
from tests._reference import assert_same_tensors, averaged_gradients, flatten, make_params, set_gradients
from tests.zero.test_api import _without_numpy
from tests.zero.test_sharded_checkpoint import _hold_writes

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


def _reference(rank: int, steps: int = 4) -> list[torch.Tensor]:
    """Uninterrupted steps of a plain AdamW (master copy of the bf16 parameter kept by hand)."""
    params = flatten(make_params(SPEC))
    stepped = [p.detach().float().requires_grad_() if p.dtype != torch.float32 else p for p in params]
    optimizer = torch.optim.AdamW(stepped, lr=0.01)
    for step in range(steps):
        grads = _gradients(params, rank, step)
        set_gradients([None if g is None else g.float() for g in grads], stepped)
        optimizer.step()
        with torch.no_grad():
            params[2].copy_(stepped[2])
    return params


def _resume_body(rank: int, world_size: int, root: str) -> None:
    _without_numpy()  # distoptim depends on torch alone: saving and loading must work without numpy
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


def _async_body(rank: int, world_size: int, root: str) -> None:
    _without_numpy()
    path = Path(root) / "ckpt"
    params = flatten(make_params(SPEC))
    zero = ZeroRedundancyOptimizer(params, torch.optim.AdamW, partition="even", master_dtype=torch.float32, lr=0.01)
    _steps(zero, params, rank, range(2))
    release = _hold_writes()
    saving = checkpoint.save(
        {"optim": zero.sharded_state_dict(), "model": dict(enumerate(params))}, path, async_save=True
    )
    _steps(zero, params, rank, range(2, 3))  # training goes on while the checkpoint is written (after step 2's copy)
    assert not saving.done() and not path.exists()
    release.set()
    assert saving.result(timeout=30) is None
    assert sorted(os.listdir(root)) == ["ckpt"], "the finished checkpoint, renamed into place"

    # a fresh run at another partition resumes from it as if it had never stopped
    resumed = flatten(make_params(SPEC, seed=7))
    zero = ZeroRedundancyOptimizer(resumed, torch.optim.AdamW, partition="greedy", master_dtype=torch.float32, lr=0.5)
    state = {"optim": zero.sharded_state_dict(), "model": dict(enumerate(resumed))}
    checkpoint.load(state, path)
    zero.load_sharded_state_dict(state["optim"])
    _steps(zero, resumed, rank, range(2, 4))
    assert_same_tensors(resumed, _reference(rank), "resumed from an asynchronous save")

    # a background save that fails (a full disk on rank 1): its future raises on every rank, the checkpoint at
    # the path is the previous one, and the next save says so before it starts
    if rank == 1:
        from torch.distributed.checkpoint.filesystem import _FileSystemWriter

        def full(*args: Any, **kwargs: Any) -> Any:
            raise OSError(28, "No space left on device")

        mock.patch.object(_FileSystemWriter, "write_data", full).start()
    failing = checkpoint.save({"optim": zero.sharded_state_dict()}, path, async_save=True)
    error = failing.exception(timeout=30)
    assert isinstance(error, OSError if rank == 1 else ValueError) and "No space left on device" in str(error)
    with pytest.warns(UserWarning, match="an earlier asynchronous checkpoint save failed: .*No space left"):
        checkpoint.load(state, path)
    assert_same_tensors(resumed, _reference(rank, steps=2), "the checkpoint the failed save did not replace")


def test_async_save_copies_the_state_and_resumes_bit_exactly(tmp_path: Path) -> None:
    run_on_ranks(_async_body, 2, str(tmp_path))


def _state(zero: ZeroRedundancyOptimizer, params: list[torch.Tensor]) -> dict[str, Any]:
    return {"optim": zero.sharded_state_dict(), "model": {"w": params[0], "v": params[1], "u": params[2]}}


def _write_flat_checkpoint_of_0_2(path: Path) -> None:
    """A checkpoint as distoptim 0.2 wrote it: parameter-shaped state flat (memory order), layouts with strides."""
    params = flatten(make_params(SPEC))
    plain = torch.optim.AdamW(params, lr=0.01)
    set_gradients([torch.full_like(p, 0.5) for p in params], params)
    plain.step()
    saved = plain.state_dict()
    optim: dict[str, Any] = {
        "param_groups": pickle.dumps(saved["param_groups"]),
        "param_layouts": pickle.dumps([(tuple(p.shape), tuple(p.stride())) for p in params]),
    }
    for index, entry in saved["state"].items():
        for name, value in entry.items():
            optim[f"state.{index}.{name}"] = value.reshape(-1) if value.dim() > 0 else value
    model = {"w": params[0], "v": params[1], "u": params[2]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized": a save by this process alone
        dcp.save({"optim": optim, "model": model}, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


def _damage(root: Path, weight: torch.Tensor) -> None:
    """Copies of the checkpoint ``good`` with a data file missing, one truncated, the metadata truncated, bytes of
    ``weight`` (a saved tensor) changed in place in the data file holding it, bytes of the metadata changed, the
    manifest unreadable, and the manifest gone."""
    for name, file, size in (("missing", "__1_0.distcp", None), ("truncated", "__0_0.distcp", 100)):
        shutil.copytree(root / "good", root / name)
        if size is None:
            (root / name / file).unlink()
        else:
            os.truncate(root / name / file, size)
    shutil.copytree(root / "good", root / "unreadable")
    os.truncate(root / "unreadable" / ".metadata", 50)
    shutil.copytree(root / "good", root / "flipped")
    pattern = bytes(weight.detach().contiguous().view(torch.uint8).flatten().tolist())
    assert sum(_flip(file, pattern) for file in (root / "flipped").glob("*.distcp")) == 1
    shutil.copytree(root / "good", root / "flipped metadata")
    _flip(root / "flipped metadata" / ".metadata")
    shutil.copytree(root / "good", root / "bad manifest")
    (root / "bad manifest" / ".checksums").write_text("{not json")
    shutil.copytree(root / "good", root / "unchecked")  # as dcp.save or an older distoptim wrote it: no checksums
    (root / "unchecked" / ".checksums").unlink(missing_ok=True)


def _flip(path: Path, pattern: bytes | None = None) -> bool:
    """Invert 16 bytes of the file at ``path`` in place (its size unchanged): at the start of ``pattern`` if the
    file holds it (False if not), else in the middle."""
    data = bytearray(path.read_bytes())
    start = len(data) // 2 if pattern is None else data.find(pattern)
    if start < 0:
        return False
    data[start : start + 16] = bytes(255 - b for b in data[start : start + 16])
    path.write_bytes(bytes(data))
    return True


def _snapshot(zero: ZeroRedundancyOptimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    tensors = [v for entry in zero.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]
    return [t.detach().clone() for t in params + tensors]


def _refusal_body(rank: int, world_size: int, root: str) -> None:
    params = flatten(make_params(SPEC))
    zero = ZeroRedundancyOptimizer(params, torch.optim.AdamW, lr=0.01)
    _steps(zero, params, rank, range(3))
    shapes, truncated = Path(root) / "shapes", Path(root) / "truncated"
    cases = {
        "missing": ("does not exist", Path(root) / "nowhere"),
        "foreign": ("not a checkpoint: it has no .metadata", Path(root) / "foreign"),
        "partial": ("did not finish", Path(root) / "partial"),
        "other model": ("lacks 2 of the entries", Path(root) / "other"),
        "other shapes": (r"holds model\.w with shape \(4, 6\), but the state to load has shape \(6, 4\)", shapes),
        "missing data file": (r"is damaged: its data file __1_0\.distcp is missing", Path(root) / "missing"),
        "flipped data bytes": (r"bytes of its file __\d_0\.distcp changed since the save", Path(root) / "flipped"),
        "flipped metadata": (r"bytes of its file \.metadata changed since the save", Path(root) / "flipped metadata"),
        "truncated data file": (r"__0_0\.distcp holds 100 bytes where its metadata says at least", truncated),
        "truncated metadata": (r"its file \.metadata holds 50 bytes where \d+ were saved", Path(root) / "unreadable"),
        "damaged manifest": (r"its manifest \.checksums cannot be read", Path(root) / "bad manifest"),
        "flat state of distoptim 0.2": (r"saved by distoptim 0\.2.*--to-torch", Path(root) / "flat"),
    }
    if rank == 0:
        (Path(root) / "foreign").mkdir()
        (Path(root) / "foreign" / "weights.bin").write_bytes(b"\0")
        (Path(root) / ".partial.partial").mkdir()
        (Path(root) / ".partial.partial" / "__0_0.distcp").write_bytes(b"\0")
        _write_flat_checkpoint_of_0_2(Path(root) / "flat")
    checkpoint.save({"optim": zero.sharded_state_dict(), "model": {"w": params[0]}}, Path(root) / "other")
    other_shapes = {"w": params[0].detach().t().contiguous(), "v": params[1], "u": params[2]}
    checkpoint.save({"optim": zero.sharded_state_dict(), "model": other_shapes}, shapes)
    checkpoint.save(_state(zero, params), Path(root) / "good")
    if rank == 0:
        _damage(Path(root), params[0])
    dist.barrier()
    params = flatten(make_params(SPEC, seed=7))  # another run, stepped on other gradients: a load would change it
    zero = ZeroRedundancyOptimizer(params, torch.optim.AdamW, lr=0.01)
    _steps(zero, params, rank + 5, range(3))
    before = _snapshot(zero, params)
    for name, (message, path) in cases.items():
        with pytest.raises(ValueError, match=message):  # on every rank
            checkpoint.load(_state(zero, params), path)
        assert_same_tensors(_snapshot(zero, params), before, f"{name}: nothing loaded")
    with pytest.warns(UserWarning, match=r"has no \.checksums .*cannot be checked for damage"):
        checkpoint.load(_state(zero, params), Path(root) / "unchecked")  # loads, unverified, with a warning
    state = _state(zero, params)
    checkpoint.load(state, Path(root) / "good")  # the intact one loads
    zero.load_sharded_state_dict(state["optim"])
    assert not all(torch.equal(a, b) for a, b in zip(_snapshot(zero, params), before))


def test_incomplete_foreign_or_damaged_checkpoints_are_refused_on_every_rank_before_loading_anything(
    tmp_path: Path,
) -> None:
    run_on_ranks(_refusal_body, 2, str(tmp_path))
    # the converter refuses the damaged ones too: exit code 1 and the message
    from tests.zero.test_sharded_checkpoint import _cli

    flipped = _cli(str(tmp_path / "flipped"), "--to-torch", str(tmp_path / "optim.pt"))
    assert flipped.returncode == 1 and re.search(r"bytes of its file __\d_0\.distcp changed since", flipped.stderr)
    assert not (tmp_path / "optim.pt").exists()
    for name, says in (("flipped metadata", ".metadata changed since the save"), ("unreadable", "holds 50 bytes")):
        with pytest.raises(ValueError, match=re.escape(says)):
            dcp_to_torch_optim(tmp_path / name)
    assert dcp_to_torch_optim(tmp_path / "good")["state"]  # the intact one converts


def _index_swapped_body(rank: int, world_size: int, root: str) -> None:
    """``.metadata`` replaced by another checkpoint's after the load checked it: the load reads the index it
    checked (the data files are intact), not the new one, whose offsets would point elsewhere."""
    import distoptim.checkpoint.files as files

    ours, other = Path(root) / "ours", Path(root) / "other"
    if rank == 0:
        other.mkdir()
    x = torch.arange(8.0)
    checkpoint.save({"x": x}, ours)
    checkpoint.save({"first": torch.zeros(64), "x": torch.full((8,), 7.0)}, other)
    checked = files._checked_source

    def then_swapped(*args: Any) -> Any:
        result = checked(*args)
        dist.barrier()
        if rank == 0:
            shutil.copyfile(other / ".metadata", ours / ".metadata")
        dist.barrier()
        return result

    state = {"x": torch.zeros(8)}
    with mock.patch.object(files, "_checked_source", then_swapped):
        checkpoint.load(state, ours)
    assert torch.equal(state["x"], x)


def test_a_load_reads_the_index_it_checked(tmp_path: Path) -> None:
    run_on_ranks(_index_swapped_body, 2, str(tmp_path))
