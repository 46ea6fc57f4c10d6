"""Master weights: a bf16 model stepped through fp32 copies of each rank's fragments equals doing it by hand on one
process (fp32 copies + the torch.optim optimizer on them, gradients upcast, parameters = the copies rounded)."""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ZeroRedundancyOptimizer
from tests._dist import run_on_ranks
from tests._reference import (
    MasterWeightsReference,
    assert_same_tensors,
    averaged_gradients,
    flatten,
    make_params,
    set_gradients,
)
from tests.zero._hooks import register

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
# bf16 parameters (one straddling ranks under the even cut, one tiny, one frozen), one fp32 parameter and one fp64
# parameter (wider than the masters: stepped as it is, never rounded to fp32)
SPEC = [
    [((37, 3), BF16, True), ((5,), BF16, True), ((4, 4), BF16, False)],
    [((6,), F32, True), ((2, 2, 3), BF16, True), ((3, 5), F64, True)],
]
KWARGS = {"lr": 1e-3, "weight_decay": 0.1}
STEPS = 4


class _ByHand:
    """The single-process reference: fp32 copies of the low-precision parameters, AdamW on the copies."""

    def __init__(self, params: list[list[torch.Tensor]]) -> None:
        self.params = flatten(params)
        self.masters = [
            p.detach().float().requires_grad_(p.requires_grad) if p.dtype == BF16 else p for p in self.params
        ]
        groups, at = [], 0
        for group in params:
            groups.append({"params": self.masters[at : at + len(group)]})
            at += len(group)
        groups[1]["lr"] = KWARGS["lr"] / 2
        self.optimizer = torch.optim.AdamW(groups, **KWARGS)

    def step(self, grads: list[torch.Tensor | None]) -> None:
        for master, grad in zip(self.masters, grads):
            master.grad = None if grad is None else grad.to(master.dtype)
        self.optimizer.step()
        with torch.no_grad():
            for param, master in zip(self.params, self.masters):
                if master is not param:
                    param.copy_(master)


def _groups(params: list[list[torch.Tensor]]) -> list[dict[str, Any]]:
    return [{"params": params[0]}, {"params": params[1], "lr": KWARGS["lr"] / 2}]


def _parity_body(rank: int, world_size: int) -> dict[str, Any] | None:
    saved = None
    for partition, bucket_view in itertools.product(("greedy", "even"), (False, True)):
        what = f"{partition} bucket_view={bucket_view} world={world_size}"
        ours, theirs = make_params(SPEC), make_params(SPEC)
        zero = ZeroRedundancyOptimizer(
            _groups(ours),
            torch.optim.AdamW,
            parameters_as_bucket_view=bucket_view,
            partition=partition,
            master_dtype=F32,
            **KWARGS,
        )
        reference = _ByHand(theirs)
        for step in range(STEPS):
            grads = averaged_gradients(flatten(ours), rank, step)
            set_gradients(grads, flatten(ours))
            zero.step()
            reference.step(grads)
            assert_same_tensors(flatten(ours), flatten(theirs), f"{what} step {step}")
        assert all(p.dtype == d for p, (_, d, _) in zip(flatten(ours), (s for g in SPEC for s in g)))
        zero.consolidate_state_dict(to=0)
        if rank == 0:
            state = zero.state_dict()["state"]
            for index, master in enumerate(reference.masters):
                if master.requires_grad and master is not reference.params[index]:
                    assert torch.equal(state[index]["master_weight"], master.detach()), (what, index)
                    assert state[index]["exp_avg"].dtype == F32, "optimizer state is kept in fp32"
                if master is reference.params[index] and index in state:
                    assert "master_weight" not in state[index], (what, index, "no master for fp32 / fp64")
                    assert state[index]["exp_avg"].dtype == master.dtype, (what, index)
            if (partition, bucket_view) == ("even", True):
                saved = {
                    "optimizer": zero.state_dict(),
                    "params": [p.detach().clone() for p in flatten(ours)],
                    "masters": [m.detach().clone() for m in reference.masters],
                }
    return saved


def _resume_body(rank: int, world_size: int, saved: dict[str, Any]) -> None:
    """Resumed at another world size and partition from the consolidated dict: bit-exact, master weights included;
    without them, a warning and master copies taken from the parameters."""
    ours, theirs = make_params(SPEC), make_params(SPEC)
    with torch.no_grad():
        for param, other, value in zip(flatten(ours), flatten(theirs), saved["params"]):
            param.copy_(value)
            other.copy_(value)
    zero = ZeroRedundancyOptimizer(_groups(ours), torch.optim.AdamW, partition="greedy", master_dtype=F32, **KWARGS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a complete dict loads without a warning
        zero.load_state_dict(saved["optimizer"])
    reference = _ByHand(theirs)
    with torch.no_grad():
        for master, value in zip(reference.masters, saved["masters"]):
            master.copy_(value)
    reference.optimizer.load_state_dict(
        {**saved["optimizer"], "state": {i: {k: v for k, v in e.items() if k != "master_weight"}
                                         for i, e in saved["optimizer"]["state"].items()}}
    )  # fmt: skip
    for step in range(STEPS, STEPS + 3):
        grads = averaged_gradients(flatten(ours), rank, step)
        set_gradients(grads, flatten(ours))
        zero.step()
        reference.step(grads)
        assert_same_tensors(flatten(ours), flatten(theirs), f"resumed, step {step}")
    without = {**saved["optimizer"], "state": {i: {k: v for k, v in e.items() if k != "master_weight"}
                                               for i, e in saved["optimizer"]["state"].items()}}  # fmt: skip
    with pytest.warns(UserWarning, match="no master weights"):
        zero.load_state_dict(without)
    plain = ZeroRedundancyOptimizer(_groups(make_params(SPEC)), torch.optim.AdamW, **KWARGS)
    with pytest.warns(UserWarning, match="carries master weights but this optimizer keeps none"):
        plain.load_state_dict(saved["optimizer"])
    with pytest.raises(TypeError, match="master_dtype must be a floating-point torch.dtype"):
        ZeroRedundancyOptimizer(_groups(make_params(SPEC)), torch.optim.AdamW, master_dtype="fp32", **KWARGS)


def test_master_weights_match_doing_it_by_hand_and_resume_bit_exactly() -> None:
    saved = run_on_ranks(_parity_body, 3)[0]
    run_on_ranks(_parity_body, 1)
    run_on_ranks(_resume_body, 2, saved)


def _small_updates_body(rank: int, world_size: int) -> list[float]:
    """Adam with a learning rate under bf16's resolution: bf16 parameters never move, master weights accumulate."""
    moved = []
    for master_dtype in (None, F32):
        param = torch.ones(64, dtype=BF16, requires_grad=True)
        zero = ZeroRedundancyOptimizer([param], torch.optim.Adam, partition="even", master_dtype=master_dtype, lr=1e-4)
        for _ in range(100):
            param.grad = torch.ones_like(param)
            zero.step()
        moved.append((1 - param.detach().float()).abs().max().item())
    return moved


def test_master_weights_keep_updates_bf16_would_lose() -> None:
    stalled, progressed = run_on_ranks(_small_updates_body, 2)[0]
    assert stalled == 0.0, "plain bf16 Adam: each 1e-4 update rounds away"
    assert progressed > 5e-3, progressed


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(BF16)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=F64))  # wider than the masters: no master

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x.to(BF16)).double() * self.scale


def _ddp_body(rank: int, world_size: int) -> None:
    """With DDP: explicit step with all-reduce or reduce-to-owners (+ clipping), and both overlap hooks, against DDP
    gradients stepped by hand through fp32 copies."""
    configs = itertools.product(("greedy", "even"), ("explicit", "hook", "interleaved"), ("all_reduce", "to_owners"))
    for partition, stepping, reduction in configs:
        what = f"{partition} {stepping} {reduction}"
        model, reference = _Net(), _Net()
        ddp, reference_ddp = DDP(model, bucket_cap_mb=0.0003), DDP(reference, bucket_cap_mb=0.0003)
        zero = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.AdamW, overlap_with_ddp=stepping != "explicit", partition=partition,
            parameters_as_bucket_view=partition == "even", master_dtype=F32, lr=0.01,
        )  # fmt: skip
        register(ddp, zero, reduction, stepping)
        masters = [p.detach().float().requires_grad_() if p.dtype == BF16 else p for p in reference.parameters()]
        by_hand = torch.optim.AdamW(masters, lr=0.01)
        for iteration in range(3):
            batch = torch.randn(5, 8, generator=torch.Generator().manual_seed(100 * iteration + rank))
            zero.zero_grad()
            ddp(batch).float().square().mean().backward()
            reference_ddp.zero_grad()
            reference_ddp(batch).float().square().mean().backward()
            if stepping == "explicit":
                total = zero.clip_grad_norm_(0.5)
                expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
                torch.testing.assert_close(total, expected.float(), rtol=1e-2, atol=0, msg=what)
                zero.step()
            for master, param in zip(masters, reference.parameters()):
                if master is not param:
                    master.grad = param.grad.float()
            by_hand.step()
            with torch.no_grad():
                for master, param in zip(masters, reference.parameters()):
                    if master is not param:
                        param.copy_(master)
            for index, (param, want) in enumerate(zip(model.parameters(), reference.parameters())):
                label = f"{what} iteration {iteration} parameter {index}"
                torch.testing.assert_close(param, want, rtol=0, atol=0, msg=lambda m, label=label: f"{label}: {m}")


def test_master_weights_with_ddp_hooks_and_gradient_sharding() -> None:
    run_on_ranks(_ddp_body, 2, timeout=180)


def _frozen_adagrad_body(rank: int, world_size: int) -> None:
    """Adagrad over fp32 masters, parameter 0 frozen when built: the construction ``sum`` a consolidated dict shows
    for it (and a load keeps until unfreezing gives it an owner) is the masters' optimizer's, fp32; it was made over
    the bf16 parameter: bf16(0.1), and the resumed masters drifted from the reference by 1.6e-5."""
    kwargs = {"lr": 0.05, "initial_accumulator_value": 0.1}
    spec = [[((16, 8), BF16, False), ((12, 4), BF16, True)]]
    ours, theirs = flatten(make_params(spec)), flatten(make_params(spec))
    reference = MasterWeightsReference(theirs, [{"params": theirs}], torch.optim.Adagrad, kwargs, master=True)

    def train(zero: ZeroRedundancyOptimizer, params: list[torch.Tensor], steps: range) -> None:
        for step in steps:
            set_gradients(averaged_gradients(params, rank, step), params, theirs)
            zero.step()
            reference.step(None)

    def consolidated(zero: ZeroRedundancyOptimizer) -> dict[str, Any]:
        zero.consolidate_state_dict(to=0)
        box = [zero.state_dict() if rank == 0 else None]
        torch.distributed.broadcast_object_list(box, 0)
        return box[0]  # type: ignore[return-value]

    zero = ZeroRedundancyOptimizer(ours, torch.optim.Adagrad, master_dtype=F32, **kwargs)
    train(zero, ours, range(2))
    saved = consolidated(zero)
    resumed = [p.detach().clone().requires_grad_(p.requires_grad) for p in ours]
    again = ZeroRedundancyOptimizer(resumed, torch.optim.Adagrad, master_dtype=F32, **kwargs)
    with warnings.catch_warnings():  # it keeps masters: a rank owning none of them once warned they were ignored
        warnings.filterwarnings("error", "the checkpoint carries master weights")
        again.load_state_dict(saved)
    resumed[0].requires_grad_(True)
    train(again, resumed, range(2, 5))
    state = consolidated(again)["state"]
    expected = reference.optimizer.state
    for index, master in enumerate(reference.stepped):
        assert_same_tensors(
            [state[index]["master_weight"], state[index]["sum"]], [master, expected[master]["sum"]], f"{index}"
        )
    assert_same_tensors(resumed, theirs, "parameters")


def test_construction_state_of_a_frozen_parameter_is_made_in_the_master_dtype() -> None:
    run_on_ranks(_frozen_adagrad_body, 2)


def _masters_ignored_body(rank: int, world_size: int, path: str) -> int:
    """A checkpoint with master weights loaded into an optimizer without ``master_dtype``: they are ignored with one
    warning, on every rank, from a sharded load too (it dropped them without a word)."""
    import distoptim.checkpoint

    ours = make_params(SPEC)
    zero = ZeroRedundancyOptimizer(_groups(ours), torch.optim.AdamW, master_dtype=F32, **KWARGS)
    set_gradients(averaged_gradients(flatten(ours), rank, 0), flatten(ours))
    zero.step()
    distoptim.checkpoint.save({"optim": zero.sharded_state_dict()}, path)
    plain = ZeroRedundancyOptimizer(_groups(make_params(SPEC)), torch.optim.AdamW, **KWARGS)
    state = {"optim": plain.sharded_state_dict()}
    distoptim.checkpoint.load(state, path)
    with pytest.warns(UserWarning, match="carries master weights but this optimizer keeps none") as caught:
        plain.load_sharded_state_dict(state["optim"])
    zero.consolidate_state_dict(to=0)
    box = [zero.state_dict() if rank == 0 else None]
    torch.distributed.broadcast_object_list(box, 0)
    with pytest.warns(UserWarning, match="carries master weights but this optimizer keeps none") as also:
        plain.load_state_dict(box[0])  # type: ignore[arg-type]
    return len(caught) + len(also)


def test_sharded_master_weights_loaded_without_master_dtype_warn(tmp_path: Any) -> None:
    assert run_on_ranks(_masters_ignored_body, 2, str(tmp_path / "checkpoint")) == [2, 2]
