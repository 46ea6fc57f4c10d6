"""The CUDA paths, run where a GPU is (``benchmarks/gpu_check.sh`` on a lent machine); skipped elsewhere.

- NCCL at world size 1 (one GPU): every mode of ZeRO (gradients all-reduced or reduced to owners, stepped explicitly
  or inside DDP's backward, bucket views on and off, both partitions, NCCL's chunked collectives; p2p is refused) and
  ShardedDataParallel (overlapped sync on and off) equal the plain optimizer, and two steady-state iterations run
  under ``torch.cuda.set_sync_debug_mode("error")``: any call that makes the CPU wait for the GPU raises.
- NCCL: a checkpoint (consolidated, and sharded through ``distoptim.checkpoint``) resumes bit for bit; Muon + AdamW
  in one optimizer equals the plain pair.
- gloo with 2 ranks on one GPU: ZeRO-2 and ShardedDataParallel with CUDA tensors, against DDP + the plain optimizer.
"""

from __future__ import annotations

import functools
import itertools
import os
import tempfile
import traceback
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer, checkpoint
from distoptim.comm import collectives as comm
from tests._dist import cuda_world_size, run_on_ranks
from tests.zero._hooks import register

pytestmark = pytest.mark.skipif(cuda_world_size() < 1, reason="needs a CUDA device")

KWARGS = {"lr": 0.01, "weight_decay": 0.1}


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)).to(device)


def _batch(rank: int, step: int, device: torch.device) -> torch.Tensor:
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank)).to(device)


MODES = [
    *(("ddp", *mode) for mode in itertools.product(["all_reduce", "to_owners"], ["explicit", "hook", "interleaved"])),
    ("sdp", "overlap", "explicit"),
    ("sdp", "no_overlap", "explicit"),
]


def _build(
    mode: tuple[str, str, str], partition: str, bucket_view: bool, device: torch.device, rank: int, **options: Any
) -> Any:
    kind, how, stepping = mode
    model = _model(device).to(options.pop("dtype", torch.float32))
    zero = ZeroRedundancyOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        partition=partition,
        parameters_as_bucket_view=bucket_view,
        overlap_with_ddp=stepping != "explicit",
        **options,
        **KWARGS,
    )
    if kind == "sdp":
        wrapped: Any = ShardedDataParallel(model, zero, bucket_cap_mb=0.01, overlap_param_sync=how == "overlap")
    else:
        wrapped = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=0.01)
        register(wrapped, zero, how, stepping)
    return model, zero, wrapped


def _iteration(wrapped: Any, zero: Any, x: torch.Tensor, stepping: str) -> None:
    zero.zero_grad()
    wrapped(x).square().mean().backward()
    if stepping == "explicit":
        zero.step()


TOLERANCES = {"fp32": (1e-5, 1e-6), "bf16": (0.0, 5e-4), "int8": (0.0, 5e-3), "master": (0.0, 3e-3)}
"""Against plain AdamW after 4 steps: the compressed states' own error here is 9e-5 (bf16) and 1.2e-3 (int8) on the
CPU; a wrong update moves a parameter by about lr = 1e-2 per step. "master": a bf16 model through fp32 masters, against
AdamW on fp32 copies by hand, within 1.5 bf16 ulps at |p| < 0.5 (a master a bit off may round the other way; an lr
10% off moves parameters by 4e-3)."""

CASES = [
    *(
        (mode, partition, view, "fp32")
        for mode, partition, view in itertools.product(MODES, ["greedy", "even"], [False, True])
    ),
    *((mode, "even", True, fmt) for mode in (MODES[0], MODES[7]) for fmt in ("bf16", "int8", "master")),
]


def _check_case(mode: tuple[str, str, str], partition: str, view: bool, fmt: str, batches: list[torch.Tensor]) -> None:
    device = batches[0].device
    master = fmt == "master"
    dtype = torch.bfloat16 if master else torch.float32
    options = {"master_dtype": torch.float32, "dtype": dtype} if master else {"state_format": fmt}
    model, zero, wrapped = _build(mode, partition, view, device, 0, **options)
    reference = _model(device).to(dtype)
    masters = [p.detach().float() for p in reference.parameters()] if master else list(reference.parameters())
    plain = torch.optim.AdamW(masters, **KWARGS)
    for step, x in enumerate(batches):
        if step >= 2:  # the steady state: no call may make the CPU wait for the GPU
            torch.cuda.set_sync_debug_mode("error")
        try:
            _iteration(wrapped, zero, x.to(dtype), mode[2])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        reference.zero_grad()
        reference(x.to(dtype)).square().mean().backward()
        for kept, param in zip(masters, reference.parameters()):
            kept.grad = param.grad.float() if master else param.grad
        plain.step()
        with torch.no_grad():
            for kept, param in zip(masters, reference.parameters()):
                param.copy_(kept)  # the master rounded (a no-op without masters)
    zero.sync_finished()
    rtol, atol = TOLERANCES[fmt]
    for ours, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, want, rtol=rtol, atol=atol)


def _where(error: BaseException) -> str:
    """The error and the innermost library frame it passed through: one line per failing case."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "distoptim" in f.filename]
    at = f" at {frames[-1].filename.split('src/')[-1]}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}{at}"


def _nccl_body(rank: int, world_size: int) -> None:
    device = torch.device("cuda", rank)
    os.environ[comm.ENVIRONMENT] = comm.Collectives.POINT_TO_POINT.value  # gloo's: refused on NCCL, by every rank
    with pytest.raises(ValueError, match="p2p is gloo's style"):
        _build(MODES[0], "even", True, device, rank)
    batches = [_batch(rank, step, device) for step in range(4)]  # copied before the steady state: those copies wait
    failures = []
    for style, case in itertools.product([comm.Collectives.CHUNKED.value, "auto"], CASES):
        os.environ[comm.ENVIRONMENT] = style
        try:
            _check_case(*case, batches)
        except Exception as error:  # every case runs: one lent GPU session must show every failure at once
            failures.append(f"{case} {style}: {_where(error)}")
    os.environ.pop(comm.ENVIRONMENT, None)
    assert not failures, f"{len(failures)} of {2 * len(CASES)} cases failed:\n" + "\n".join(failures)


def test_nccl_every_mode_matches_and_never_waits_for_the_gpu() -> None:
    run_on_ranks(_nccl_body, 1, backend="nccl", timeout=600)


def _trained(mode: tuple[str, str, str], batches: list[torch.Tensor], **options: Any) -> Any:
    model, zero, wrapped = _build(mode, "even", True, batches[0].device, 0, **options)
    for x in batches:
        _iteration(wrapped, zero, x, mode[2])
    zero.sync_finished()
    return model, zero, wrapped


def _resumed_equals_uninterrupted(mode: tuple[str, str, str], how: str, batches: list[torch.Tensor]) -> None:
    """Save after 2 steps (consolidated, or sharded through ``distoptim.checkpoint``), load into a fresh optimizer and
    train 2 more: the parameters equal 4 uninterrupted steps bit for bit."""
    whole = _trained(mode, batches)[0]
    first_model, first = _trained(mode, batches[:2])[:2]
    model, zero, wrapped = _build(mode, "even", True, batches[0].device, 0)
    with torch.no_grad():
        for param, saved in zip(model.parameters(), first_model.parameters()):
            param.copy_(saved)
    if how == "consolidated":
        first.consolidate_state_dict(to=0)
        zero.load_state_dict(first.state_dict())
    else:
        with tempfile.TemporaryDirectory() as directory:
            checkpoint.save({"optim": first.sharded_state_dict()}, directory + "/ckpt")
            state = {"optim": zero.sharded_state_dict()}
            checkpoint.load(state, directory + "/ckpt")
            zero.load_sharded_state_dict(state["optim"])
    for x in batches[2:]:
        _iteration(wrapped, zero, x, mode[2])
    zero.sync_finished()
    for ours, want in zip(model.parameters(), whole.parameters()):
        torch.testing.assert_close(ours, want, rtol=0, atol=0)


def _muon_matches_plain(mode: tuple[str, str, str], batches: list[torch.Tensor]) -> None:
    """Muon on the matrices and AdamW on the biases, in one optimizer, against the two plain optimizers."""
    model = _model(batches[0].device)
    matrices, rest = ([p for p in model.parameters() if (p.ndim == 2) == want] for want in (True, False))
    groups = [{"params": matrices, "optimizer_class": torch.optim.Muon, "lr": 0.02}, {"params": rest}]
    zero = ZeroRedundancyOptimizer(groups, torch.optim.AdamW, partition="even", **KWARGS)
    device_ids = [0] if batches[0].is_cuda else None
    wrapped = ShardedDataParallel(model, zero) if mode[0] == "sdp" else DDP(model, device_ids=device_ids)
    reference = _model(batches[0].device)
    matrices, rest = ([p for p in reference.parameters() if (p.ndim == 2) == want] for want in (True, False))
    muon, adamw = torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, **KWARGS)
    for x in batches:
        _iteration(wrapped, zero, x, "explicit")
        muon.zero_grad()
        adamw.zero_grad()
        reference(x).square().mean().backward()
        muon.step()
        adamw.step()
    zero.sync_finished()
    for ours, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-6)


def _nccl_state_body(rank: int, world_size: int) -> None:
    batches = [_batch(rank, step, torch.device("cuda", rank)) for step in range(4)]
    failures = []
    for mode in (MODES[0], MODES[2], MODES[7]):
        checks = [(how, functools.partial(_resumed_equals_uninterrupted, mode, how)) for how in ("consolidated", "dcp")]
        checks += [("muon", functools.partial(_muon_matches_plain, mode))] if mode[2] == "explicit" else []
        for name, check in checks:
            try:
                check(batches)
            except Exception as error:
                failures.append(f"{mode} {name}: {_where(error)}")
    assert not failures, f"{len(failures)} checks failed:\n" + "\n".join(failures)


def test_nccl_checkpoints_resume_exactly_and_muon_matches() -> None:
    run_on_ranks(_nccl_state_body, 1, backend="nccl", timeout=300)


def _gloo_on_one_gpu_body(rank: int, world_size: int) -> None:
    device = torch.device("cuda", 0)
    for mode, partition in itertools.product([MODES[3], MODES[6]], ["greedy", "even"]):
        model, zero, wrapped = _build(mode, partition, True, device, rank)
        reference = _model(device)
        ddp, plain = DDP(reference), torch.optim.AdamW(reference.parameters(), **KWARGS)
        for step in range(3):
            _iteration(wrapped, zero, _batch(rank, step, device), "explicit")
            plain.zero_grad()
            ddp(_batch(rank, step, device)).square().mean().backward()
            plain.step()
        zero.sync_finished()
        for ours, want in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-6, msg=f"{mode} {partition}")


def test_gloo_with_two_ranks_on_one_gpu() -> None:
    run_on_ranks(_gloo_on_one_gpu_body, 2, timeout=300)
