"""PostLocalSGDOptimizer + post_localSGD_hook on 4 real ranks, against PyTorch's own pair on the same model and data.

Parity is exact (torch.equal): the hook all-reduces DDP's own bucket exactly as PyTorch's does, and the averager
lays out the same flat buffer, so every floating-point operation happens in the same order.
"""

from __future__ import annotations

import os
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_hook_module
from torch.distributed.algorithms.model_averaging import averagers as torch_averagers
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import PostLocalSGDOptimizer, ZeroRedundancyOptimizer
from distoptim.averagers import PeriodicModelAverager
from distoptim.ddp.post_local_sgd import averaged_ranks
from distoptim.hooks import (
    PostLocalSGDState,
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
    post_localSGD_hook,
)
from tests._dist import cuda_world_size, run_on_ranks

STEPS = 10
WARMUP = 3
PERIOD = 2
CPU = torch.device("cpu")
BUCKET_CAP_MB = 200 / 2**20  # ~200 bytes: several buckets, so the iteration counter must count on the last one

OURS = (PostLocalSGDState, post_localSGD_hook, PostLocalSGDOptimizer, PeriodicModelAverager)


def _theirs() -> tuple[Any, ...]:
    # Imported here: torch.distributed.optim scripts its functional optimizers on import (~1 s in every rank).
    from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGDOptimizer

    return (
        torch_hook_module.PostLocalSGDState,
        torch_hook_module.post_localSGD_hook,
        TorchPostLocalSGDOptimizer,
        torch_averagers.PeriodicModelAverager,
    )


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _train(
    rank: int,
    impl: tuple[Any, ...],
    subgroup: dist.ProcessGroup | None,
    post_local: bool = True,
    local_optim: Callable[[Any], torch.optim.Optimizer] = _sgd,
    inspect: Callable[[Any, Any], None] | None = None,
    device: torch.device = CPU,
) -> tuple[list[list[torch.Tensor]], Any]:
    """DDP with the post-local-SGD hook and optimizer of ``impl``; the parameters after every step, and the state."""
    state_cls, hook, optimizer_cls, averager_cls = impl
    device_ids = None if device.type == "cpu" else [device]
    model = DDP(_model().to(device), device_ids=device_ids, bucket_cap_mb=BUCKET_CAP_MB)
    state = state_cls(
        process_group=None, subgroup=subgroup, start_localSGD_iter=WARMUP, post_local_gradient_allreduce=post_local
    )
    model.register_comm_hook(state, hook)
    optim = optimizer_cls(local_optim(model.parameters()), averager_cls(period=PERIOD, warmup_steps=WARMUP))
    history = []
    for step in range(STEPS):
        x, y = (t.to(device) for t in _batch(rank, step))
        optim.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optim.step()
        history.append([p.detach().clone() for p in model.parameters()])
        if inspect is not None:
            inspect(optim, model)
    return history, state


def _assert_same(ours: list[list[torch.Tensor]], theirs: list[list[torch.Tensor]]) -> None:
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y), f"step {step}: max difference {(x - y).abs().max().item()}"


def _hook_parity_body(rank: int, world_size: int) -> None:
    pairs, _ = dist.new_subgroups(group_size=2)  # {0, 1}, {2, 3}: the "nodes"
    for post_local in (True, False):
        ours, state = _train(rank, OURS, pairs, post_local)
        theirs, _ = _train(rank, _theirs(), pairs, post_local)
        _assert_same(ours, theirs)
        assert state.iter == STEPS  # one count per backward pass, however many buckets
    # After warm-up, the pairs diverge between averagings (step 4 is local only, step 5 averages globally).
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, [ours[4][0], ours[5][0]])
    assert not torch.equal(gathered[0][0], gathered[2][0]) and torch.equal(gathered[0][1], gathered[2][1])

    # subgroup=None: per-node subgroups from the launcher's LOCAL_WORLD_SIZE, created when local SGD starts;
    # PyTorch's would call dist.new_subgroups() and fail without CUDA.
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    implicit, state = _train(rank, OURS, None)
    _assert_same(implicit, _train(rank, OURS, pairs)[0])
    assert dist.get_process_group_ranks(state.subgroup) == [rank - rank % 2, rank - rank % 2 + 1]
    del os.environ["LOCAL_WORLD_SIZE"]  # unknown: the whole group, and nothing is created
    assert PostLocalSGDState(None, None, 0).local_subgroup() is dist.group.WORLD

    # The state pickles: groups cannot, so they are dropped with a warning and the schedule's data kept.
    with pytest.warns(UserWarning, match="do not pickle"):
        clone = pickle.loads(pickle.dumps(state))
    assert (clone.iter, clone.start_localSGD_iter, clone.subgroup) == (STEPS, WARMUP, None)


def test_hook_and_optimizer_match_torch() -> None:
    run_on_ranks(_hook_parity_body, 4)


def _zero_body(rank: int, world_size: int) -> None:
    # ZeRO within each pair of ranks (a "node"), gradients all-reduced within the pair after warm-up, parameters
    # averaged over all four ranks: it must train exactly like PyTorch's stack with a plain local SGD.
    pairs, _ = dist.new_subgroups(group_size=2)

    def zero(params: Any) -> torch.optim.Optimizer:
        return ZeroRedundancyOptimizer(
            params,
            optimizer_class=torch.optim.SGD,
            process_group=pairs,
            parameters_as_bucket_view=True,
            lr=0.1,
            momentum=0.9,
        )

    pointers: list[int] = []

    def check_views(optim: Any, model: Any) -> None:
        # Averaging writes in place: parameters keep their storage, which is ZeRO's one flat fp32 bucket.
        params = list(model.parameters())
        if not pointers:
            pointers.extend(p.data_ptr() for p in params)
        assert [p.data_ptr() for p in params] == pointers
        assert len({p.untyped_storage().data_ptr() for p in params}) == 1

    ours, _ = _train(rank, OURS, pairs, local_optim=zero, inspect=check_views)
    _assert_same(ours, _train(rank, _theirs(), pairs)[0])


def test_zero_as_the_local_optimizer_keeps_in_sync() -> None:
    run_on_ranks(_zero_body, 4)


def _overlap_train(
    rank: int,
    wrap: Any,
    zero_group: dist.ProcessGroup | None,
    subgroup: dist.ProcessGroup,
    post_local: bool,
    torchs: bool = False,
) -> list[list[torch.Tensor]]:
    """ZeRO (over ``zero_group``) stepped inside the backward by ``wrap(post_localSGD_hook, ...)`` (``torchs``: torch's
    hook and state); averaged by hand."""
    model = DDP(_model(), bucket_cap_mb=BUCKET_CAP_MB)
    state_class = torch_hook_module.PostLocalSGDState if torchs else PostLocalSGDState
    state = state_class(None, subgroup, start_localSGD_iter=WARMUP, post_local_gradient_allreduce=post_local)
    hook = torch_hook_module.post_localSGD_hook if torchs else post_localSGD_hook
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.SGD, process_group=zero_group, overlap_with_ddp=True, lr=0.1, momentum=0.9
    )
    model.register_comm_hook(state, wrap(hook, model, zero, step_from_first_backward=True))
    averager = PeriodicModelAverager(period=PERIOD, warmup_steps=WARMUP)
    history = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        zero.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        zero.step()
        averager.average_parameters(model.parameters())
        history.append([p.detach().clone() for p in model.parameters()])
    return history


def _overlap_body(rank: int, world_size: int) -> None:
    # Over the hook's subgroup, overlap ZeRO trains as torch's stack with a plain SGD; sharded over ranks the hook
    # stops averaging after warm-up (all four, or a pair without post_local_gradient_allreduce), it is refused on
    # every rank before its first step instead of training each shard on its owner's gradient alone.
    pairs, _ = dist.new_subgroups(group_size=2)
    assert averaged_ranks(PostLocalSGDState(None, None, 0, post_local_gradient_allreduce=False)) == [rank]
    assert averaged_ranks(PostLocalSGDState(None, None, 0)) == [0, 1, 2, 3]  # no LOCAL_WORLD_SIZE: one node
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # the per-node subgroups local_subgroup() would make: pairs
    assert averaged_ranks(PostLocalSGDState(None, None, 0)) == [rank // 2 * 2, rank // 2 * 2 + 1]
    del os.environ["LOCAL_WORLD_SIZE"]
    theirs = _train(rank, _theirs(), pairs)[0]
    for wrap in (hook_with_zero_step, hook_with_zero_step_interleaved):
        ours = _overlap_train(rank, wrap, pairs, pairs, True)
        for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m, s=step: f"step {s}: {m}")
    for wrap, zero_group, post_local, torchs in (
        (hook_with_zero_step, None, True, False),
        (hook_with_zero_step_interleaved, pairs, False, False),
        (hook_with_zero_step, None, True, True),  # torch's own hook and state, recognised by the state's attributes
    ):
        with pytest.raises(ValueError, match="Build ZeRO over the hook's subgroup"):
            _overlap_train(rank, wrap, zero_group, pairs, post_local, torchs)


def test_overlap_zero_must_shard_within_the_hooks_subgroup() -> None:
    run_on_ranks(_overlap_body, 4)


def _local_sgd(rank: int, optim: PostLocalSGDOptimizer, model: nn.Module, steps: range) -> list[torch.Tensor]:
    for step in steps:
        x, y = _batch(rank, step)
        optim.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optim.step()
    return [p.detach().clone() for p in model.parameters()]


def _wrapper_body(rank: int, world_size: int) -> None:
    def fresh() -> tuple[nn.Module, PostLocalSGDOptimizer]:
        model = _model()
        return model, PostLocalSGDOptimizer(_sgd(model.parameters()), PeriodicModelAverager(PERIOD, WARMUP))

    # State-dict round trip: 4 steps, save, rebuild everything, load, 5 more == 9 steps straight. The resume point
    # is off the averaging phase (steps 3, 5, 7 average), so restarting the averager at 0 would show.
    model, optim = fresh()
    straight = _local_sgd(rank, optim, model, range(9))
    model, optim = fresh()
    _local_sgd(rank, optim, model, range(4))
    saved_model, saved_optim = model.state_dict(), optim.state_dict()
    assert saved_optim["step"] == 4
    model, optim = fresh()
    model.load_state_dict(saved_model)
    optim.load_state_dict(saved_optim)
    assert optim.averager.step == 4
    resumed = _local_sgd(rank, optim, model, range(4, 9))
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a, b)
    without_step = {k: v for k, v in saved_optim.items() if k != "step"}
    with pytest.warns(UserWarning, match=r"^Loaded state dict does not contain a step counter for an averager\."):
        optim.load_state_dict(without_step)
    assert optim.averager.step == 0
    changed = [{**group, "lr": 123.0} for group in saved_optim["param_groups"]]
    with pytest.raises(ValueError, match=r"state_dict\['step'\] must be >= 0"):
        optim.load_state_dict({**saved_optim, "param_groups": changed, "step": -1})
    assert optim.averager.step == 0 and all(g["lr"] != 123.0 for g in optim.param_groups)  # nothing of it loaded

    # The wrapper reads through to the wrapped optimizer: groups, state, defaults, schedulers, closures.
    inner = optim.optim
    assert optim.param_groups is inner.param_groups and optim.state is inner.state and optim.defaults is inner.defaults
    scheduler = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    x, y = _batch(rank, 0)

    def closure() -> float:
        optim.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return float(loss.detach())

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "scheduler stepped before optimizer" warning
        assert isinstance(optim.step(closure), float)
        scheduler.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(0.05)
    extra = nn.Parameter(torch.zeros(2))
    optim.add_param_group({"params": [extra], "lr": 0.01})
    assert inner.param_groups[-1]["params"] == [extra]
    optim.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        PostLocalSGDOptimizer(object(), optim.averager)  # type: ignore[arg-type]


def test_state_dict_round_trip_and_wrapper_behaviour() -> None:
    run_on_ranks(_wrapper_body, 2)


def _cuda_body(rank: int, world_size: int) -> None:
    # NCCL may choose different algorithms for different communicators, so bitwise equality with PyTorch's run is
    # not guaranteed here as it is on gloo: compare with torch.testing's default float32 tolerances instead.
    device = torch.device("cuda", rank)
    theirs, _ = _train(rank, _theirs(), dist.group.WORLD, device=device)
    ours, _ = _train(rank, OURS, None, device=device)  # per-node subgroups: LOCAL_WORLD_SIZE is the world here
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b)
    flat = torch.cat([p.reshape(-1) for p in ours[-1]])  # the last step (9) averages: every rank agrees
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(g, flat) for g in gathered)


@pytest.mark.skipif(cuda_world_size() == 0, reason="needs CUDA")
def test_cuda_nccl_matches_torch() -> None:
    run_on_ranks(_cuda_body, min(cuda_world_size(), 4), backend="nccl")


def test_hook_state_round_trips_its_iteration() -> None:
    state = PostLocalSGDState(None, None, start_localSGD_iter=5)
    state.iter = 7
    resumed = PostLocalSGDState(None, None, start_localSGD_iter=5)
    resumed.load_state_dict(state.state_dict())
    assert resumed.iter == 7 and resumed.state_dict() == {"iter": 7}
    for bad in ({}, {"iter": -1}, {"iter": "7"}, [7]):
        with pytest.raises(ValueError, match="expected PostLocalSGDState.state_dict"):
            resumed.load_state_dict(bad)  # type: ignore[arg-type]


class _TwoDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16).double(), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)).double())).float())


def _static_graph_body(rank: int, world_size: int) -> None:
    """A static graph with several buckets from the first iteration on (two dtypes): there DDP marks no bucket last,
    and the hook must still count that iteration (the warm-up ends when it does without a static graph)."""
    runs = []
    for static_graph in (False, True):
        torch.manual_seed(0)
        model = _TwoDtypes()
        ddp = DDP(model, bucket_cap_mb=0.0005, static_graph=static_graph)
        state = PostLocalSGDState(None, None, start_localSGD_iter=2, post_local_gradient_allreduce=False)
        ddp.register_comm_hook(state, post_localSGD_hook)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            sgd.zero_grad()
            ddp(x).square().mean().backward()
            sgd.step()
        assert state.iter == 4, (static_graph, state.iter)
        runs.append([p.detach().clone() for p in model.parameters()])
    for ours, theirs in zip(*runs):
        assert torch.equal(ours, theirs)


def test_a_static_graph_counts_its_first_iteration() -> None:
    run_on_ranks(_static_graph_body, 2)


class _ThreeDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16).bfloat16(), nn.Linear(16, 16).double(), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x.bfloat16())).double())).float())


def _mixed_train(rank: int, impl: tuple[Any, ...], subgroup: dist.ProcessGroup) -> list[list[torch.Tensor]]:
    """DDP over bf16/f64/f32 layers with ``impl``'s hook and post-local-SGD optimizer: each step's gradients (what
    the hook averaged) and parameters (what the averager averaged)."""
    state_cls, hook, optimizer_cls, averager_cls = impl
    torch.manual_seed(0)
    model = DDP(_ThreeDtypes(), bucket_cap_mb=BUCKET_CAP_MB)
    model.register_comm_hook(state_cls(None, subgroup, start_localSGD_iter=2), hook)
    optim = optimizer_cls(torch.optim.SGD(model.parameters(), lr=0.1), averager_cls(period=2, warmup_steps=2))
    history = []
    for step in range(6):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        optim.zero_grad()
        model(x).square().mean().backward()
        history.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        optim.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history


def _mixed_dtypes_body(rank: int, world_size: int) -> None:
    subgroup = dist.new_group(list(range(world_size)))  # a subgroup object of its own after warm-up
    _assert_same(_mixed_train(rank, OURS, subgroup), _mixed_train(rank, _theirs(), subgroup))


def test_hook_and_optimizer_average_mixed_dtypes_as_torch() -> None:
    """Three ranks (dividing by 3 rounds), bf16/f64/f32 buckets and parameters: bitwise torch's numbers."""
    run_on_ranks(_mixed_dtypes_body, 3)
