"""Sharded checkpoints through torch.distributed.checkpoint: each rank writes its own fragments, and a checkpoint
resumes bit-exactly at another world size and partition, master weights included."""

from __future__ import annotations

import copy
import os
import pickle
import re
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from distoptim import ZeroRedundancyOptimizer, checkpoint
from distoptim._flat import flat_view
from distoptim.checkpoint import convert
from distoptim.checkpoint import dcp_state as sharded
from distoptim.checkpoint.boxes import memory_range_boxes
from tests._dist import run_on_ranks
from tests._reference import assert_same_tensors, averaged_gradients, flatten, make_params, set_gradients

F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
SPEC = [
    [((33, 7), F32, True), ((0,), F32, True), ((5,), F32, True), ((4, 4), F32, False)],
    [((6, 2), BF16, True), ((17,), F32, True), ((3, 5), F64, True)],  # fp64: wider than the masters, none
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
            p.detach().float().requires_grad_(p.requires_grad) if master and p.dtype == BF16 else p for p in self.params
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


def _hold_writes() -> threading.Event:
    """From now on DCP's file writer waits until the returned event is set: an asynchronous save that had not
    copied the state before returning would write what the training changed meanwhile."""
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    release, write = threading.Event(), _FileSystemWriter.write_data

    def held(self: Any, *args: Any, **kwargs: Any) -> Any:
        assert release.wait(timeout=30), "the test never released the writer"
        return write(self, *args, **kwargs)

    mock.patch.object(_FileSystemWriter, "write_data", held).start()
    return release


def _save_body(
    rank: int, world_size: int, path: str, partition: str, master: bool, asynchronous: bool = False
) -> dict[str, Any]:
    """Three steps, then a sharded checkpoint: with ``dcp.save``, or ``dcp.async_save`` while two more steps run."""
    ours, theirs = make_params(SPEC), make_params(SPEC)
    zero, reference = _zero(ours, partition, master), _Reference(theirs, master)
    _train(zero, reference, flatten(ours), rank, range(3))
    state = {"optim": zero.sharded_state_dict(), "model": {str(i): p for i, p in enumerate(flatten(ours))}}
    saved = copy.deepcopy(
        {
            "params": [p.detach() for p in flatten(ours)],
            "stepped": [p.detach() for p in reference.stepped],
            "reference": reference.optimizer.state_dict(),
        }
    )
    if asynchronous:
        release = _hold_writes()
        future = dcp.async_save(state, checkpoint_id=path, process_group=dist.new_group(backend="gloo"))
        _train(zero, reference, flatten(ours), rank, range(3, 5))
        release.set()
        future.result()
    else:
        dcp.save(state, checkpoint_id=path)
    own = sum(
        v.numel() * v.element_size() for e in zero.state.values() for v in e.values() if isinstance(v, torch.Tensor)
    )
    own += sum(t.tensor.numel() * t.tensor.element_size() for t in zero.local_shard.masters)
    written = os.path.getsize(os.path.join(path, f"__{rank}_0.distcp"))
    model_bytes = sum(p.numel() * p.element_size() for p in flatten(ours))
    assert written <= own + model_bytes + 64 * 1024, (written, own)  # its own shard (and model copy), not the whole
    return saved


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


def _template_raises_body(rank: int, world_size: int) -> str:
    params = [torch.randn(8, 6, requires_grad=True), torch.randn(0, 5, requires_grad=True)]
    zero = ZeroRedundancyOptimizer(params, torch.optim.Adafactor, lr=0.01)  # a 0-element parameter: 1 / 0 there
    try:
        zero.sharded_state_dict()
    except Exception as error:  # the owner's own error; the others a ValueError naming it
        return f"{type(error).__name__}: {error}"
    return "returned"


def test_a_template_step_that_raises_on_one_rank_raises_on_every_rank() -> None:
    """``sharded_state_dict()``'s placeholder step (torch's Adafactor divides by zero on a 0-element parameter, on its
    owner only) raises inside an agreement: every rank raises, none waits in the gathers after it."""
    outcomes = run_on_ranks(_template_raises_body, 2, timeout=60)
    assert sorted(o.split(":")[0] for o in outcomes) == ["ValueError", "ZeroDivisionError"], outcomes
    assert all("ZeroDivisionError" in o for o in outcomes), outcomes


def test_dcp_async_save_of_a_sharded_state_resumes_bit_exactly(tmp_path: Path) -> None:
    """``dcp.async_save(zero.sharded_state_dict())``: its staging copies the fragments (the steps taken while the
    save is written change nothing in it), and a run loaded from it at another world size goes on bit-exactly."""
    path = str(tmp_path / "checkpoint")
    saved = run_on_ranks(_save_body, 2, path, "even", True, True)[0]
    run_on_ranks(_load_body, 3, path, "greedy", True, saved)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "distoptim", "checkpoint", *args], capture_output=True, text=True, timeout=120
    )


def test_conversion_to_and_from_torch_optim_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
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

    # a damaged checkpoint: one line saying what is wrong, no traceback
    damages = {
        "missing": ("__1_0.distcp", None, r"its data file __1_0\.distcp is missing"),
        "truncated": ("__2_0.distcp", 100, r"__2_0\.distcp holds 100 bytes where its metadata says at least \d+"),
        "metadata": (".metadata", 50, r"\.metadata cannot be read \(UnpicklingError: .*\): the checkpoint is damaged"),
    }
    for name, (file, size, says) in damages.items():
        damaged = tmp_path / name
        shutil.copytree(sharded, damaged)
        if size is None:
            (damaged / file).unlink()
        else:
            os.truncate(damaged / file, size)
        assert convert.main([str(damaged), "--to-torch", str(converted)]) == 1, name  # what the CLI runs
        errors = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning:")]
        assert len(errors) == 1 and re.search(says, errors[0]), (name, errors)  # dcp.save's: no checksums


def test_conversion_reads_the_flat_format_of_distoptim_0_2(tmp_path: Path) -> None:
    """distoptim 0.2 saved parameter-shaped state flat, in the parameter's memory order, with its strides: the
    conversion still gives torch.optim's dict of such a checkpoint, for channels_last and transposed parameters."""
    params = _conv_params("channels_last")
    plain = torch.optim.AdamW(params, **CONV_KWARGS)
    _conv_steps(plain, params, range(2))
    expected = plain.state_dict()
    payload: dict[str, Any] = {
        "param_groups": pickle.dumps(expected["param_groups"]),
        "param_layouts": pickle.dumps([(tuple(p.shape), tuple(p.stride())) for p in params]),
    }
    for index, entry in expected["state"].items():
        for name, value in entry.items():
            payload[f"state.{index}.{name}"] = flat_view(value).clone() if value.dim() > 0 else value
    old = tmp_path / "old"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized": a save in this one process, yes
        dcp.save({"optim": payload}, storage_writer=dcp.FileSystemWriter(str(old)), no_dist=True)
    converted = convert.dcp_to_torch_optim(old)
    assert converted["param_groups"] == expected["param_groups"]
    for index, entry in expected["state"].items():
        for name, value in entry.items():
            assert torch.equal(converted["state"][index][name], value), (index, name)


# --------------------------------------------------------------------------------------------- memory layouts
def test_memory_range_boxes_tile_the_range_in_any_layout() -> None:
    """Every range of a dense tensor's elements in memory order is the union of its boxes (at most 2 * ndim - 1, or
    each within a size limit), each a strided view of the range's 1-D copy that equals the logical slice it stands
    for and fills one stretch of that copy."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(400):
        shape = [int(n) for n in torch.randint(1, 5, (int(torch.randint(1, 5, (), generator=generator)),))]
        order = torch.randperm(len(shape), generator=generator).tolist()
        logical = torch.arange(torch.Size(shape).numel()).reshape(shape)
        laid_out = logical.permute(order).contiguous().permute([order.index(d) for d in range(len(shape))])
        memory = flat_view(laid_out)
        offset = int(torch.randint(0, memory.numel() + 1, (), generator=generator))
        length = int(torch.randint(0, memory.numel() - offset + 1, (), generator=generator))
        piece = memory[offset : offset + length].clone()
        limit = int(torch.randint(1, 9, (), generator=generator)) if offset % 2 else None
        boxes = memory_range_boxes(laid_out.shape, laid_out.stride(), offset, length, limit)
        assert limit is not None or len(boxes) <= 2 * len(shape) - 1 or length == 0
        covered = []
        for box in boxes:
            assert limit is None or torch.Size(box.sizes).numel() <= limit
            window = tuple(slice(at, at + size) for at, size in zip(box.offsets, box.sizes))
            view = piece.as_strided(box.sizes, laid_out.stride(), box.start)
            assert torch.equal(view, logical[window])
            stretch = piece[box.start : box.start + view.numel()]  # one stretch of memory (what DCP is handed)
            assert sorted(view.reshape(-1).tolist()) == sorted(stretch.tolist())
            covered += logical[window].reshape(-1).tolist()
        assert sorted(covered) == sorted(piece.tolist()), (shape, order, offset, length)


CONV_SHAPES = [(6, 4, 3, 3), (6,), (5, 6, 2, 2), (5,), (3, 5)]  # even: the first split at 2 ranks, both at 3
LAYOUTS = ("contiguous", "channels_last")  # channels_last: the convolutions channels_last, the matrix transposed
CONV_KWARGS = {"lr": 0.01, "weight_decay": 0.1}


def _laid_out(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "channels_last" and tensor.dim() == 4:
        return tensor.contiguous(memory_format=torch.channels_last)
    if layout == "channels_last" and tensor.dim() == 2:
        return tensor.t().contiguous().t()
    return tensor.contiguous()


def _conv_params(layout: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [_laid_out(torch.randn(shape, generator=generator), layout).requires_grad_() for shape in CONV_SHAPES]


def _conv_steps(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], steps: range) -> None:
    """Steps on gradients that depend on the step only (as after DDP's averaging), laid out like the parameters."""
    for step in steps:
        generator = torch.Generator().manual_seed(100 + step)
        for param in params:
            param.grad = torch.empty_like(param).copy_(torch.randn(param.shape, generator=generator))
        optimizer.step()


def _conv_zero(params: list[torch.Tensor], partition: str) -> ZeroRedundancyOptimizer:
    return ZeroRedundancyOptimizer(params, torch.optim.AdamW, partition=partition, **CONV_KWARGS)


def _layout_save_body(rank: int, world_size: int, root: str, partition: str, chunk_bytes: int) -> None:
    """Two steps in each layout; a sharded checkpoint and a consolidated one (``torch.optim``'s format) of each."""
    sharded.CHUNK_BYTES = chunk_bytes
    for layout in LAYOUTS:
        params = _conv_params(layout)
        zero = _conv_zero(params, partition)
        if partition == "even":
            assert len(zero.plan.fragments[0]) > 1, "the first convolution straddles ranks"
        _conv_steps(zero, params, range(2))
        checkpoint.save({"optim": zero.sharded_state_dict(), "model": dict(enumerate(params))}, Path(root) / layout)
        chunks = dcp.FileSystemReader(Path(root) / layout).read_metadata().state_dict_metadata["optim.state.0.exp_avg"]
        assert all(4 * torch.Size(chunk.sizes).numel() <= chunk_bytes for chunk in chunks.chunks)  # type: ignore[union-attr]
        zero.consolidate_state_dict(to=0)
        if rank == 0:
            torch.save(zero.state_dict(), Path(root) / f"{layout}.pt")


def _layout_load_body(rank: int, world_size: int, root: str, partition: str, chunk_bytes: int) -> None:
    """Every checkpoint, sharded and consolidated, into every layout: the run goes on as a plain AdamW that never
    stopped (on contiguous parameters), and the consolidated dict loads into that plain AdamW too."""
    sharded.CHUNK_BYTES = chunk_bytes
    reference = _conv_params("contiguous")
    plain = torch.optim.AdamW(reference, **CONV_KWARGS)
    at = {}
    for step in range(4):
        _conv_steps(plain, reference, range(step, step + 1))
        at[step + 1] = [p.detach().clone() for p in reference]
        if step == 1:
            at_two = copy.deepcopy(plain.state_dict())
    for saved in LAYOUTS:
        consolidated = torch.load(Path(root) / f"{saved}.pt", weights_only=False)
        for name, value in consolidated["state"][0].items():  # torch.optim's format: parameter-shaped, by position
            assert torch.equal(value, at_two["state"][0][name]), f"consolidated from {saved}: {name}"
        for layout in LAYOUTS:
            for source in ("sharded", "consolidated"):
                params = _conv_params(layout)
                zero = _conv_zero(params, partition)
                if source == "sharded":
                    state = {"optim": zero.sharded_state_dict(), "model": dict(enumerate(params))}
                    checkpoint.load(state, Path(root) / saved)
                    zero.load_sharded_state_dict(state["optim"])
                else:
                    with torch.no_grad():
                        for param, value in zip(params, at[2]):
                            param.copy_(value)
                    zero.load_state_dict(consolidated)
                what = f"{source} checkpoint saved {saved}, loaded {layout}"
                assert_same_tensors(params, at[2], what)
                _conv_steps(zero, params, range(2, 4))
                assert_same_tensors(params, at[4], f"{what}, two steps on")
        params = _conv_params("contiguous")
        with torch.no_grad():
            for param, value in zip(params, at[2]):
                param.copy_(value)
        resumed = torch.optim.AdamW(params, **CONV_KWARGS)
        resumed.load_state_dict(consolidated)
        _conv_steps(resumed, params, range(2, 4))
        assert_same_tensors(params, at[4], f"consolidated from {saved}, into a plain AdamW")


@pytest.mark.parametrize(
    ("partition", "save_ranks", "load_ranks", "chunk_bytes"),
    [("greedy", 2, 2, sharded.CHUNK_BYTES), ("even", 2, 2, sharded.CHUNK_BYTES), ("even", 3, 2, 60)],
)
def test_checkpoints_are_independent_of_memory_layout(
    tmp_path: Path, partition: str, save_ranks: int, load_ranks: int, chunk_bytes: int
) -> None:
    """A channels_last model's checkpoint loads into a contiguous one and back (sharded: by logical index, a split
    parameter's boxes included, also when cut into chunks of 15 elements; consolidated: torch.optim's
    parameter-shaped tensors)."""
    run_on_ranks(_layout_save_body, save_ranks, str(tmp_path), partition, chunk_bytes)
    run_on_ranks(_layout_load_body, load_ranks, str(tmp_path), partition, chunk_bytes, timeout=120)
