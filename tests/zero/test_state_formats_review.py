"""Issue 43's hostile review: what it found differing silently from the contract, each fixed and kept as a test.

The contract (docs/guides/state-formats.md): ZeRO with a format gives bitwise the parameters and state of one process
running the plain torch.optim optimizer whose eligible state goes through ``tests/zero/_codec.round_trip`` after each
step; the planner's int8 state bytes are "measured by encoding torch.optim's state with this codec"."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from distoptim import ZeroRedundancyOptimizer
from tests._dist import run_on_ranks
from tests.zero._codec import round_trip


def _adagrad_body(rank: int, world_size: int) -> tuple[float, float]:
    param, reference = torch.zeros(4096, requires_grad=True), torch.zeros(4096, requires_grad=True)
    kwargs = {"lr": 1.0, "initial_accumulator_value": 0.1}
    zero = ZeroRedundancyOptimizer([param], torch.optim.Adagrad, state_format="bf16", **kwargs)
    plain = torch.optim.Adagrad([reference], **kwargs)
    param.grad, reference.grad = torch.ones(4096), torch.ones(4096)
    zero.step()
    plain.step()
    round_trip(plain.state, [reference], {reference: "bf16"})
    return float(param[0]), float(reference[0])


def test_adagrad_bf16_initial_accumulator_is_not_rounded_before_the_first_step() -> None:
    got, expected = run_on_ranks(_adagrad_body, 1)[0]
    assert got == expected, (got, expected)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(70, 97), nn.Linear(100, 41, bias=False))  # 6790 and 4100 elements: partial blocks


def _state_bytes_body(rank: int, world_size: int) -> int:
    zero = ZeroRedundancyOptimizer(_model().parameters(), torch.optim.AdamW, state_format="int8")
    for param in zero.global_params:
        param.grad = torch.ones_like(param)
    zero.step()
    state = zero.local_optimizer.state.values()
    return sum(v.numel() * v.element_size() for entry in state for v in entry.values() if isinstance(v, torch.Tensor))


def test_planner_int8_state_bytes_match_the_measured_state() -> None:
    measured = run_on_ranks(_state_bytes_body, 1)[0]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "distoptim",
            "plan",
            "--model",
            "tests.zero.test_state_formats_review:_model",
            "--world-size",
            "1",
            "--state-format",
            "int8",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    planned = next(m for m in json.loads(out)["modes"] if m["mode"] == "zero1")["peak"]["optimizer_state"]
    assert planned == measured, (planned, measured)


def _overlap_added_group_body(rank: int, world_size: int) -> None:
    """Overlap mode, fp32 at construction, a group added with ``"state_format": "int8"``: its state is int8 (it was
    silently kept in fp32 before the overlap hooks took formats), bitwise the single-process reference."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from distoptim.hooks import allreduce_hook, hook_with_zero_step
    from tests.zero.test_state_formats import exact_average, local_grads, make_params
    from tests.zero.test_state_formats_overlap import WARMUP, Linear

    model, reference = Linear(), make_params()
    weights = list(model.weights)
    zero = ZeroRedundancyOptimizer(weights[:2], torch.optim.AdamW, overlap_with_ddp=True, lr=0.01)
    zero.add_param_group({"params": weights[2:], "state_format": "int8"})
    ddp = DDP(model, bucket_cap_mb=0.03)
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    plain = torch.optim.AdamW([{"params": reference[:2]}, {"params": reference[2:]}], lr=0.01)
    formats = {p: "int8" for p in reference[2:] if p.numel() >= 4096}
    for step in range(5):
        zero.zero_grad()
        ddp(local_grads(rank, world_size, step)).backward()
        zero.step()
        if step >= WARMUP:
            for param, grad in zip(reference, exact_average(world_size, step)):
                param.grad = grad
            plain.step()
            round_trip(plain.state, reference, formats)
        for index, (ours, theirs) in enumerate(zip(weights, reference)):
            assert torch.equal(ours.detach(), theirs.detach()), f"parameter {index} at step {step}"
    encoded = [key for entry in zero.local_optimizer.state.values() for key in entry if key.endswith(".int8")]
    assert encoded or not any(p in formats for p in reference), "the added group's state is not int8"


def test_overlap_mode_keeps_an_added_groups_low_bit_format() -> None:
    run_on_ranks(_overlap_added_group_body, 2)


def _bf16_alias_body(rank: int, world_size: int) -> list[int]:
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(4096, generator=generator).to(torch.bfloat16) for _ in range(2)]
    params = [v.clone().requires_grad_() for v in values]
    reference = [v.clone().requires_grad_() for v in values]
    zero = ZeroRedundancyOptimizer(params, torch.optim.AdamW, state_format="bf16", lr=0.01)
    plain = torch.optim.AdamW(reference, lr=0.01)
    differs = []
    for step, stepped in enumerate([(0, 1), (1,), (0, 1)]):  # parameter 0 has no gradient at step 1
        for index, (param, ref) in enumerate(zip(params, reference)):
            grad = torch.full((4096,), float(index + step + 1), dtype=torch.bfloat16)
            param.grad, ref.grad = (grad, grad.clone()) if index in stepped else (None, None)
        zero.step()
        plain.step()
        round_trip(plain.state, [r for r in reference if r.grad is not None], dict.fromkeys(reference, "bf16"))
        differs += [step * 10 + i for i, (p, r) in enumerate(zip(params, reference)) if not torch.equal(p, r)]
    return differs


def test_bf16_state_of_a_bf16_model_is_not_a_view_of_the_scratch_buffer() -> None:
    assert run_on_ranks(_bf16_alias_body, 1)[0] == []


def _sparse_momentum_body(rank: int, world_size: int, fmt: str) -> str:
    torch.manual_seed(0)
    embedding = nn.Embedding(600, 8, sparse=True)  # 4800 elements: int8-eligible; SGD's momentum buffer is sparse
    zero = ZeroRedundancyOptimizer(embedding.parameters(), torch.optim.SGD, state_format=fmt, lr=0.1, momentum=0.9)
    for step in range(3):
        zero.zero_grad()
        embedding(torch.tensor([[rank + step, 3]])).square().sum().backward()  # one rank: no averaging needed
        try:
            zero.step()
        except ValueError as error:
            return f"refused: {error}"
        except RuntimeError as error:
            return f"crashed: {error}"
    return "stepped"


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_sparse_momentum_buffer_is_kept_or_clearly_refused(fmt: str) -> None:
    (result,) = run_on_ranks(_sparse_momentum_body, 1, fmt)
    assert result == "stepped", result  # kept as torch keeps it (sparse), as the reference's round trip does


def _muon_state_bytes_body(rank: int, world_size: int, fmt: str) -> int:
    matrix = torch.zeros(70, 97, requires_grad=True)  # 6790 elements: a format's, with a partial last block
    groups = [{"params": [matrix], "optimizer_class": torch.optim.Muon}]
    zero = ZeroRedundancyOptimizer(groups, torch.optim.AdamW, state_format=fmt)
    matrix.grad = torch.ones_like(matrix)
    zero.step()
    state = zero.local_optimizer.state.values()
    return sum(v.numel() * v.element_size() for entry in state for v in entry.values() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_planner_counts_muons_momentum_in_the_format(fmt: str) -> None:
    """The constructor's ``state_format`` reaches a Muon group (its momentum is encoded); the planner counted
    Muon's state in fp32 whatever the format."""
    from distoptim.plan.figures import PlanConfig, step_cost
    from distoptim.plan.inventory import ParamSpec
    from distoptim.plan.state import OptimizerSpec, resolve_optimizer

    measured = run_on_ranks(_muon_state_bytes_body, 1, fmt)[0]
    spec = ParamSpec("w", (70, 97), torch.float32, True, muon=True)
    config = PlanConfig(1, resolve_optimizer("adamw"), muon=OptimizerSpec(torch.optim.Muon), state_format=fmt)
    assert step_cost(spec, config, torch.float32, zero=True).bytes_for(spec.numel) == measured
