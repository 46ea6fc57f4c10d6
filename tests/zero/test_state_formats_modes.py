"""Low-bit state in every mode: DDP + ZeRO-1 (even, greedy), bf16 models with fp32 master weights, GradScaler,
clip_grad_norm_, add_param_group, ShardedDataParallel; each against DDP + the plain optimizer whose state goes
through the same codec after every step, bitwise (clipping: within its norm's rounding)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer
from distoptim.zero import codecs
from tests._dist import run_on_ranks
from tests._reference import MasterWeightsReference

KWARGS = {"lr": 0.01, "weight_decay": 0.1}


def _model(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 48), nn.Tanh(), nn.Linear(48, 100)).to(dtype)


def _loss(model: nn.Module, rank: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return model(torch.randn(8, 64, generator=generator).to(dtype)).float().square().mean()


def roundtrip(optimizer: torch.optim.Optimizer, default: str) -> None:
    """The codec's round trip on the plain optimizer's state: what the low-bit state holds after a step."""
    for group in optimizer.param_groups:
        fmt = group.get("state_format", default)
        for param in group["params"]:
            if fmt == "fp32" or param.numel() < codecs.MIN_NUMEL or param not in optimizer.state:
                continue
            entry = optimizer.state[param]
            for key in [k for k, v in entry.items() if codecs.is_encodable(k, v) and v.shape == param.shape]:
                entry[key] = codecs.decode(key, codecs.encode(key, entry[key], fmt), fmt, entry[key].dtype)


def _check(model: nn.Module, reference: nn.Module, what: str, exact: bool) -> None:
    for index, (a, b) in enumerate(zip(model.parameters(), reference.parameters())):
        if exact:
            assert torch.equal(a, b), f"{what}: parameter {index} differs by {(a - b).abs().max()}"
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=2e-3, msg=f"{what}: parameter {index}")


def _ddp_body(rank: int, world_size: int) -> None:
    configs = [
        ("even", "int8", torch.float32, None, False),
        ("greedy", "int8", torch.float32, None, False),
        ("even", "int8", torch.bfloat16, None, False),  # fp32 masters, int8 moments
        ("greedy", "bf16", torch.bfloat16, None, False),
        ("even", "int8", torch.float32, None, True),  # GradScaler
        ("even", "int8", torch.float32, 0.05, False),  # clip_grad_norm_
    ]
    for partition, fmt, dtype, clip, scaled in configs:
        what = f"{partition} {fmt} {dtype} clip={clip} scaler={scaled}"
        model, reference = _model(dtype), _model(dtype)
        ddp, reference_ddp = DDP(model), DDP(reference)
        master = torch.float32 if dtype != torch.float32 else None
        zero = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.AdamW, partition=partition, master_dtype=master, state_format=fmt, **KWARGS
        )
        plain = MasterWeightsReference(
            list(reference.parameters()), [{"params": list(reference.parameters())}], torch.optim.AdamW, KWARGS, True
        )
        scalers = [torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2) for _ in range(2)]
        for step in range(4):
            zero.zero_grad()
            plain.optimizer.zero_grad()
            reference.zero_grad()
            for net, scaler in ((ddp, scalers[0]), (reference_ddp, scalers[1])):
                loss = _loss(net, rank, step, dtype)
                (scaler.scale(loss) if scaled else loss).backward()
            if clip is not None:
                zero.clip_grad_norm_(clip)
            if scaled:
                scalers[0].step(zero)
                scalers[0].update()
                scalers[1].step(plain.optimizer)
                scalers[1].update()
            else:
                zero.step()
                plain.step(None if clip is None else (clip, 2.0))
            roundtrip(plain.optimizer, fmt)
            _check(model, reference, f"{what} step {step}", exact=clip is None)
        assert any(k.endswith(f".{fmt}") for e in zero.local_optimizer.state.values() for k in e), what


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_zero1_modes(world_size: int) -> None:
    run_on_ranks(_ddp_body, world_size, timeout=240)


def _added_groups_body(rank: int, world_size: int) -> None:
    for first, partition in itertools.product(["int8", "fp32"], ["even", "greedy"]):
        model, reference = _model(torch.float32), _model(torch.float32)
        ddp, reference_ddp = DDP(model), DDP(reference)
        layers, ref_layers = list(model)[::2], list(reference)[::2]
        zero = ZeroRedundancyOptimizer(
            layers[0].parameters(), torch.optim.AdamW, partition=partition, state_format=first, **KWARGS
        )
        plain = torch.optim.AdamW(ref_layers[0].parameters(), **KWARGS)
        for step in range(5):
            if step == 2:
                zero.add_param_group({"params": list(layers[1].parameters()), "state_format": "int8"})
                plain.add_param_group({"params": list(ref_layers[1].parameters()), "state_format": "int8"})
            if step == 3:
                zero.add_param_group({"params": list(layers[2].parameters()), "state_format": "bf16", "lr": 0.02})
                plain.add_param_group({"params": list(ref_layers[2].parameters()), "state_format": "bf16", "lr": 0.02})
            zero.zero_grad()
            plain.zero_grad()
            for net in (ddp, reference_ddp):
                _loss(net, rank, step, torch.float32).backward()
            zero.step()
            plain.step()
            roundtrip(plain, first)
            _check(model, reference, f"{first} {partition} step {step}", exact=True)


def test_add_param_group_with_formats() -> None:
    run_on_ranks(_added_groups_body, 2, timeout=240)


def _muon_body(rank: int, world_size: int) -> None:
    """Muon with bf16 momentum on two matrices beside AdamW with int8 state on the rest (per-group classes)."""
    model, reference = _model(torch.float32), _model(torch.float32)
    ddp, reference_ddp = DDP(model), DDP(reference)
    muon = {"lr": 0.02, "momentum": 0.95}

    def groups(net: nn.Sequential, zero: bool) -> list[dict[str, Any]]:
        matrices = [net[0].weight, net[4].weight]
        rest = [p for p in net.parameters() if all(p is not m for m in matrices)]
        named = {"optimizer_class": torch.optim.Muon} if zero else {}
        return [{"params": matrices, "state_format": "bf16", **muon, **named}, {"params": rest, "state_format": "int8"}]

    zero = ZeroRedundancyOptimizer(groups(model, True), torch.optim.AdamW, partition="even", **KWARGS)
    plain_groups = groups(reference, False)
    plains = [torch.optim.Muon([plain_groups[0]]), torch.optim.AdamW([plain_groups[1]], **KWARGS)]
    for step in range(4):
        zero.zero_grad()
        for plain in plains:
            plain.zero_grad()
        for net in (ddp, reference_ddp):
            _loss(net, rank, step, torch.float32).backward()
        zero.step()
        for plain in plains:
            plain.step()
            roundtrip(plain, "fp32")
        _check(model, reference, f"Muon bf16 + AdamW int8 step {step}", exact=True)
    formats = {k.rsplit(".", 1)[-1] for e in zero.local_optimizer.state.values() for k in e if "." in k}
    assert formats, formats


def test_muon_bf16_beside_adamw_int8() -> None:
    run_on_ranks(_muon_body, 2, timeout=240)


def _sdp_body(rank: int, world_size: int) -> None:
    model, reference = _model(torch.float32), _model(torch.float32)
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, partition="even", state_format="int8", **KWARGS
    )
    sdp, reference_ddp = ShardedDataParallel(model, zero, bucket_cap_mb=0.01), DDP(reference)
    plain = torch.optim.AdamW(reference.parameters(), **KWARGS)
    for step in range(4):
        zero.zero_grad()
        plain.zero_grad()
        for net in (sdp, reference_ddp):
            _loss(net, rank, step, torch.float32).backward()
        zero.step()
        plain.step()
        roundtrip(plain, "int8")
        zero.sync_finished()
        _check(model, reference, f"ShardedDataParallel step {step}", exact=world_size in (2, 4))
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_data_parallel_int8(world_size: int) -> None:
    run_on_ranks(_sdp_body, world_size, timeout=240)
