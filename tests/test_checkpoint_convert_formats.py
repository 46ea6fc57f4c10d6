"""``python -m distoptim checkpoint`` of an optimizer whose state is kept in fewer bits: ``--to-torch`` writes the
consolidated state dict's fp32 state bit for bit (int8 blocks in a transposed parameter's memory order too);
``--from-torch`` encodes, so an int8 optimizer loads the result at another world size and resumes bit for bit; int8
state of another memory order than the loading parameter's is refused on every rank."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from distoptim import ZeroRedundancyOptimizer, checkpoint
from tests._dist import run_on_ranks

SHAPES = [(80, 70), (4097,), (300,), (96, 64)]  # the last one transposed: a dense parameter not row-major
KWARGS = {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}


def _params(transposed: bool = True) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=generator) for shape in SHAPES]
    if transposed:
        params[-1] = params[-1].t().contiguous().t()  # the same values, column-major
    return [p.requires_grad_() for p in params]


def _train(zero: ZeroRedundancyOptimizer, params: list[torch.Tensor], rank: int, steps: range) -> None:
    """Gradients on a dyadic grid (multiples of 2**-8): their average over 2 ranks is exact."""
    for step in steps:
        generator = torch.Generator().manual_seed(1000 * step + rank)
        for param in params:
            grad = (torch.randn(param.shape, generator=generator) * 4).mul(256).round().div(256)
            dist.all_reduce(grad)
            param.grad = grad.div_(dist.get_world_size())
        zero.step()


def _consolidated(zero: ZeroRedundancyOptimizer) -> dict[str, Any]:
    zero.consolidate_state_dict(to=0)
    box = [zero.state_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _save_body(rank: int, world_size: int, path: str, fmt: str) -> dict[str, Any]:
    params = _params()
    zero = ZeroRedundancyOptimizer(params, torch.optim.AdamW, partition="even", state_format=fmt, **KWARGS)
    _train(zero, params, rank, range(3))
    state = zero.sharded_state_dict()
    assert any(key.endswith(f".{fmt}") for key in state), sorted(state)[:8]
    checkpoint.save({"optim": state}, path)
    return {"optim": _consolidated(zero), "params": [p.detach().clone() for p in params]}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "distoptim", "checkpoint", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def _assert_same_state(got: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    assert sorted(got["state"]) == sorted(expected["state"]), what
    for index, entry in expected["state"].items():
        assert sorted(got["state"][index]) == sorted(entry), (what, index)
        for name, value in entry.items():
            assert got["state"][index][name].dtype == value.dtype, (what, index, name)
            assert torch.equal(got["state"][index][name], value), (what, index, name)


def _resume_body(
    rank: int, world_size: int, path: str, original: str, saved: dict[str, Any], transposed: bool
) -> dict[str, Any] | str:
    """Load the converted checkpoint (``path``) and the original sharded one into int8 optimizers of this world size:
    the same consolidated state as saved, and the same parameters after more steps."""
    runs = []
    for directory in (path, original):
        params = _params(transposed)
        with torch.no_grad():
            for param, value in zip(params, saved["params"]):
                param.copy_(value)
        zero = ZeroRedundancyOptimizer(params, torch.optim.AdamW, partition="greedy", state_format="int8", **KWARGS)
        state = {"optim": zero.sharded_state_dict()}
        try:
            checkpoint.load(state, directory)
            zero.load_sharded_state_dict(state["optim"])
        except ValueError as error:
            return f"ValueError: {error}"
        assert any(key.endswith(".int8") for entry in zero.local_optimizer.state.values() for key in entry)
        _assert_same_state(_consolidated(zero), saved["optim"], f"loaded from {directory}")
        _train(zero, params, rank, range(3, 5))
        runs.append([p.detach().clone() for p in params])
    for converted, resumed in zip(*runs):
        assert torch.equal(converted, resumed)
    return "resumed"


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_to_torch_decodes_as_the_consolidated_state_dict(tmp_path: Path, fmt: str) -> None:
    saved = run_on_ranks(_save_body, 2, str(tmp_path / "sharded"), fmt)[0]
    result = _cli(str(tmp_path / "sharded"), "--to-torch", str(tmp_path / "optim.pt"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"wrote {tmp_path / 'optim.pt'}: torch.optim state dict, 4 parameters"), result
    converted = torch.load(tmp_path / "optim.pt", weights_only=False)
    assert all(not name.endswith((".int8", ".int8_absmax", ".bf16")) for e in converted["state"].values() for name in e)
    _assert_same_state(converted, saved["optim"], "--to-torch")
    plain = torch.optim.AdamW(_params(), **KWARGS)
    plain.load_state_dict(converted)  # what a plain optimizer loads


def test_from_torch_encodes_for_an_int8_optimizer(tmp_path: Path) -> None:
    saved = run_on_ranks(_save_body, 2, str(tmp_path / "original"), "int8")[0]
    torch.save(saved["optim"], tmp_path / "optim.pt")
    torch.save(_params(), tmp_path / "params.pt")  # the parameters themselves: the transposed one's memory order
    result = _cli(
        str(tmp_path / "converted"), "--from-torch", str(tmp_path / "optim.pt"), "--params", str(tmp_path / "params.pt")
    )
    assert result.returncode == 0 and result.stdout.startswith("wrote"), result.stderr
    resumed = run_on_ranks(_resume_body, 2, str(tmp_path / "converted"), str(tmp_path / "original"), saved, True)
    assert resumed == ["resumed", "resumed"], resumed

    # --state-format: a plain dict (no state_format in its groups) for an int8 optimizer; the state it gives back is
    # the codec's, which this saved state already is (decoding then encoding gives the same codes)
    plain = {
        **saved["optim"],
        "param_groups": [{k: v for k, v in g.items() if k != "state_format"} for g in saved["optim"]["param_groups"]],
    }
    torch.save(plain, tmp_path / "plain.pt")
    args = ["--from-torch", str(tmp_path / "plain.pt"), "--params", str(tmp_path / "params.pt")]
    assert _cli(str(tmp_path / "as_fp32"), *args).returncode == 0
    assert _cli(str(tmp_path / "as_int8"), *args, "--state-format", "int8").returncode == 0
    as_int8 = run_on_ranks(_resume_body, 2, str(tmp_path / "as_int8"), str(tmp_path / "original"), saved, True)
    assert as_int8 == ["resumed", "resumed"], as_int8
    as_fp32 = run_on_ranks(_resume_body, 2, str(tmp_path / "as_fp32"), str(tmp_path / "original"), saved, True)
    assert all("lacks" in r for r in as_fp32), as_fp32  # fp32 keys: an int8 optimizer refuses them


def test_int8_state_of_another_memory_order_is_refused(tmp_path: Path) -> None:
    saved = run_on_ranks(_save_body, 2, str(tmp_path / "sharded"), "int8")[0]
    results = run_on_ranks(_resume_body, 2, str(tmp_path / "sharded"), str(tmp_path / "sharded"), saved, False)
    assert all(
        r.startswith("ValueError: parameter 3's int8 state was saved in blocks of memory order") for r in results
    )
    # converted without the parameters, the state is encoded row-major: refused by the transposed parameter
    torch.save(saved["optim"], tmp_path / "optim.pt")
    assert _cli(str(tmp_path / "rows"), "--from-torch", str(tmp_path / "optim.pt")).returncode == 0
    results = run_on_ranks(_resume_body, 2, str(tmp_path / "rows"), str(tmp_path / "sharded"), saved, True)
    assert all("saved in blocks of memory order (strides) row-major" in r for r in results), results


def test_from_torch_before_a_first_step_resumes_adagrads_sum_unrounded(tmp_path: Path) -> None:
    """``--from-torch`` encodes Adagrad's construction ``sum`` (step 0) as a sharded save does; the load makes it
    again as the class does, so the run resumes as one that never stopped (not from bf16's 0.10009765625)."""
    from distoptim.checkpoint.convert import torch_optim_to_dcp
    from tests.zero.test_state_formats import make_params
    from tests.zero.test_state_formats_checkpoint import ADAGRAD, _unstepped_load_body

    plain = torch.optim.Adagrad(make_params(), **ADAGRAD)
    torch_optim_to_dcp(plain.state_dict(), tmp_path / "checkpoint", state_format="bf16")
    run_on_ranks(_unstepped_load_body, 2, str(tmp_path / "checkpoint"), "sharded")
