"""Low-bit state under the overlap hooks (``overlap_with_ddp=True``, both hooks, torch's warm-up): bitwise the
parameters and decoded state of ``CodecReference`` (one process, the plain optimizer on the exact average, its state
put through the codec after each step), which skips the warm-up's backwards; and a consolidated round trip."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ZeroRedundancyOptimizer
from distoptim.hooks import allreduce_hook, hook_with_zero_step, hook_with_zero_step_interleaved
from distoptim.zero import codecs
from tests._dist import run_on_ranks
from tests.zero.test_state_formats import (
    SHAPES,
    CodecReference,
    _assert_bitwise,
    exact_average,
    local_grads,
    make_params,
)

HOOKS = {"hook": hook_with_zero_step, "interleaved": hook_with_zero_step_interleaved}
CLASSES: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
}
WARMUP = 2  # torch's hooks take no step in the first two backwards (test_overlap_warmup.py)
STEPS = 5


class Linear(nn.Module):
    """``sum(p * x)`` over ``SHAPES``' parameters: in fp32 each parameter's gradient is its input, exactly."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(p.detach().to(dtype)) for p in make_params())

    def forward(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * x.to(p.dtype)).float().sum() for p, x in zip(self.weights, inputs))  # type: ignore[return-value]


def _overlapped(hook: str, name: str, fmt: str, partition: str, **options: Any) -> tuple[DDP, ZeroRedundancyOptimizer]:
    """DDP over ``Linear`` and ZeRO with ``hook`` stepping it (``"explicit"``: no overlap, ``zero.step()`` steps)."""
    cls, kwargs = CLASSES[name]
    model = Linear(options.pop("dtype", torch.float32))
    ddp = DDP(model, bucket_cap_mb=0.03)  # several buckets once rebuilt: parts cut by buckets
    overlap = hook != "explicit"
    zero = ZeroRedundancyOptimizer(
        model.parameters(), cls, overlap_with_ddp=overlap, partition=partition, state_format=fmt, **kwargs, **options
    )
    if overlap:
        ddp.register_comm_hook(None, HOOKS[hook](allreduce_hook, ddp, zero))
    return ddp, zero


def _backward(ddp: DDP, zero: ZeroRedundancyOptimizer, rank: int, world_size: int, step: int) -> None:
    zero.zero_grad()
    ddp(local_grads(rank, world_size, step)).backward()
    zero.step()  # confirms the hook's step (a no-op after a warm-up backward)


def _parity_body(rank: int, world_size: int, configs: list[tuple[str, str, str, str]]) -> tuple[int, int]:
    """Returns how many state keys this rank held encoded, and how many int8 parameters it held a piece of."""
    encoded = cuts = 0
    for hook, name, fmt, partition in configs:
        what = f"{hook} {name} {fmt} {partition}"
        ddp, zero = _overlapped(hook, name, fmt, partition)
        cls, kwargs = CLASSES[name]
        reference = CodecReference(make_params(), cls, fmt, **kwargs)
        for step in range(STEPS):
            _backward(ddp, zero, rank, world_size, step)
            if step >= WARMUP:
                reference.step(exact_average(world_size, step))
            _assert_bitwise(list(ddp.module.parameters()), reference.params, f"{what} step {step}")
        if fmt == "int8":  # the even partition cuts an int8 parameter at a block's start only
            shard = zero.local_shard.groups
            cut = [t for group in shard for t in group if not t.whole and t.param.numel() >= codecs.MIN_NUMEL]
            assert all(t.offset % codecs.BLOCK == 0 for t in cut), [(t.index, t.offset) for t in cut]
            cuts += len(cut)
        encoded += sum(1 for entry in zero.local_optimizer.state.values() for key in entry if key.endswith("." + fmt))
        zero.consolidate_state_dict(to=0)
        if rank == 0:
            state = zero.state_dict()["state"]
            for index, param in enumerate(reference.params):
                expected = reference.optimizer.state[param]
                assert sorted(state[index]) == sorted(expected), (what, index, sorted(state[index]))
                for key, value in expected.items():
                    assert torch.equal(state[index][key], value), f"{what}: state[{index}][{key!r}]"
    return encoded, cuts


CONFIGS = list(itertools.product(HOOKS, CLASSES, ["int8", "bf16"], ["even", "greedy"]))


@pytest.mark.parametrize("world_size", [2, 4])
def test_overlap_hooks_bitwise_with_codec_reference(world_size: int) -> None:
    configs = CONFIGS if world_size == 2 else [c for i, c in enumerate(CONFIGS) if i % 3 == 0]
    results = run_on_ranks(_parity_body, world_size, configs, timeout=300)
    assert all(encoded > 0 for encoded, _ in results), results
    assert sum(cuts for _, cuts in results) > 0, results  # the even partition cut int8 parameters (at blocks)


def _everyone(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _consolidated_body(rank: int, world_size: int, hook: str) -> None:
    """int8 in overlap mode: a consolidated state_dict is fp32 (decoded), a new overlap optimizer loads it (encodes
    again) and continues bitwise with the one that saved it."""
    ddp, zero = _overlapped(hook, "adamw", "int8", "even")
    for step in range(WARMUP + 2):
        _backward(ddp, zero, rank, world_size, step)
    zero.consolidate_state_dict(to=0)
    saved = _everyone(zero.state_dict() if rank == 0 else None)
    tensors = [v for entry in saved["state"].values() for v in entry.values() if v.dim() > 0]
    assert tensors and all(v.dtype == torch.float32 for v in tensors) and len(saved["state"]) == len(SHAPES)

    again_ddp, again = _overlapped(hook, "adamw", "int8", "greedy")
    with torch.no_grad():
        for param, value in zip(again_ddp.module.parameters(), ddp.module.parameters()):
            param.copy_(value)
    again.load_state_dict(saved)
    assert any(key.endswith(".int8") for entry in again.local_optimizer.state.values() for key in entry)
    for step in range(WARMUP):  # the new hook warms up again: two backwards that step nothing
        _backward(again_ddp, again, rank, world_size, step)
    for step in range(WARMUP + 2, WARMUP + 5):
        _backward(ddp, zero, rank, world_size, step)
        _backward(again_ddp, again, rank, world_size, step)
        _assert_bitwise(list(again_ddp.module.parameters()), list(ddp.module.parameters()), f"resumed step {step}")


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_consolidated_round_trip_in_overlap_mode(hook: str) -> None:
    run_on_ranks(_consolidated_body, 2, hook)


def _edited_format_body(rank: int, world_size: int, hook: str) -> str:
    ddp, zero = _overlapped(hook, "adamw", "int8", "even")
    for step in range(WARMUP + 1):
        _backward(ddp, zero, rank, world_size, step)
    if rank == 0:  # one rank's edit: every rank raises (in the hooks' agreement)
        zero.param_groups[0]["state_format"] = "bf16"
    with pytest.raises(ValueError) as raised:
        _backward(ddp, zero, rank, world_size, WARMUP + 1)
    return str(raised.value)


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_edited_group_format_is_refused_on_every_rank(hook: str) -> None:
    errors = run_on_ranks(_edited_format_body, 2, hook)
    assert all("its 'state_format' was changed to 'bf16'" in error for error in errors), errors


def _master_body(rank: int, world_size: int) -> None:
    """A bf16 model with fp32 master weights and int8 state: each hook equal bitwise to the same program stepped by
    ``zero.step()`` without overlap (bitwise against the codec's reference in test_state_formats_modes.py), which
    skips the warm-up's backwards."""
    options = {"dtype": torch.bfloat16, "master_dtype": torch.float32}
    for hook, partition in [("hook", "even"), ("interleaved", "greedy"), ("interleaved", "even")]:
        ddp, zero = _overlapped(hook, "adamw", "int8", partition, **options)
        plain_ddp, plain = _overlapped("explicit", "adamw", "int8", partition, **options)
        for step in range(STEPS):
            _backward(ddp, zero, rank, world_size, step)
            plain.zero_grad()
            plain_ddp(local_grads(rank, world_size, step)).backward()
            if step >= WARMUP:
                plain.step()
            _assert_bitwise(
                list(ddp.module.parameters()), list(plain_ddp.module.parameters()), f"{hook} {partition} {step}"
            )
            masters, plain_masters = (
                [t.tensor for group in z.local_shard.groups for t in group] for z in (zero, plain)
            )
            _assert_bitwise(masters, plain_masters, f"{hook} {partition} masters {step}")
        assert any(key.endswith(".int8") for entry in zero.local_optimizer.state.values() for key in entry)


def test_master_weights_under_the_overlap_hooks() -> None:
    run_on_ranks(_master_body, 2)
