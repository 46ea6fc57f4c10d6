"""ZeroRedundancyOptimizer under ``Join`` (uneven inputs), against torch's own class: a joined rank steps its shard
with its ``.grad`` as it stands and syncs it, in every partition and bucket-view mode and under
``reduce_to_owners_hook``; what Join cannot do right (a GradScaler, ShardedDataParallel, hybrid sharding) is refused
on every rank, before anything changes."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer
from distoptim._flat import flat_view
from distoptim.hooks import reduce_to_owners_hook
from tests._dist import run_on_ranks

MODES = list(itertools.product(["greedy", "even"], [False, True]))  # partition, parameters_as_bucket_view


class _GradientSetter(Joinable):
    """torch's test's earlier joinable: on a joined rank, sets the gradient DDP's shadowed all-reduce would give,
    before the optimizer's join hook steps with it."""

    def __init__(self, params: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> None:
        super().__init__()
        self.params, self.grads = params, grads

    def join_hook(self, **kwargs: Any) -> JoinHook:
        setter = self

        class _SetGrads(JoinHook):
            def main_hook(self) -> None:
                for param, grad in zip(setter.params, setter.grads.pop(0)):
                    param.grad = grad.clone()

        return _SetGrads()

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        return dist.group.WORLD


def _torch_pattern_body(rank: int, world_size: int) -> None:
    """torch's ``_test_zero_join``: DDP + Adam on uneven inputs is the truth (recorded on the last rank); ZeRO with
    those gradients set by hand, and by the setter's join hook once this rank has joined, must match it each step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3), nn.Linear(3, 3))
    initial = copy.deepcopy(model)
    ddp = DDP(model)
    local = torch.optim.Adam(ddp.parameters(), lr=0.01)
    inputs = [torch.randn(20, 2) for _ in range(3 + rank)]
    labels = torch.randn(20, 3)
    grads, params = [], []
    with ddp.join():
        for _ in range(2):
            for batch in inputs:
                nn.functional.mse_loss(ddp(batch), labels).backward()
                grads.append([p.grad.detach().clone() for p in model.parameters()])
                local.step()
                params.append([p.detach().clone() for p in model.parameters()])
    shared = [grads, params]
    dist.broadcast_object_list(shared, src=world_size - 1)
    grads, params = shared
    builds = [lambda ps: TorchZero(ps, torch.optim.Adam, lr=0.01)]
    builds += [
        lambda ps, partition=partition, view=view: ZeroRedundancyOptimizer(
            ps, torch.optim.Adam, parameters_as_bucket_view=view, partition=partition, lr=0.01
        )
        for partition, view in MODES
    ]
    for build in builds:
        net = copy.deepcopy(initial)
        zero = build(net.parameters())
        setter = _GradientSetter(list(net.parameters()), grads[len(grads) - 2 * (world_size - rank - 1) :])
        iteration = 0
        with Join([setter, zero]):
            for _ in range(2):
                for _batch in inputs:
                    Join.notify_join_context(setter)
                    for param, grad in zip(net.parameters(), grads[iteration]):
                        param.grad = grad.clone()
                    zero.step()
                    for index, (param, want) in enumerate(zip(net.parameters(), params[iteration])):
                        what = f"{type(zero).__module__} {getattr(zero, 'partition', '')} step {iteration} [{index}]"
                        torch.testing.assert_close(param.detach(), want, rtol=0, atol=0, msg=lambda m, w=what: w + m)
                    iteration += 1
        for param, want in zip(net.parameters(), params[-1]):  # the joined rank's shard was stepped and synced
            torch.testing.assert_close(param.detach(), want, rtol=0, atol=0)


def test_joined_rank_steps_its_shard_as_torchs_test_expects() -> None:
    run_on_ranks(_torch_pattern_body, 2)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(2, 3, 3)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(12, 5), nn.Tanh(), nn.Linear(5, 2))
        self.to(memory_format=torch.channels_last)  # memory order unlike row-major: even pieces cut it elsewhere

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv(x.contiguous(memory_format=torch.channels_last))))


def _batch(rank: int, iteration: int) -> torch.Tensor:
    return torch.randn(4, 2, 4, 4, generator=torch.Generator().manual_seed(100 * iteration + rank))


SGD = {"lr": 0.05, "momentum": 0.9}
BATCHES = [2, 3, 4]  # rank r's number of batches: ranks 0 and 1 join early


def _train_under_join(rank: int, build: Any, to_owners: bool = False) -> tuple[list[torch.Tensor], Any]:
    """DDP + ZeRO under ``Join([ddp, zero])``: zero_grad, backward, step, for this rank's batches."""
    model = _Net()
    ddp = DDP(model, bucket_cap_mb=0.0002)
    zero = build(model.parameters())
    if to_owners:
        ddp.register_comm_hook(zero, reduce_to_owners_hook)
    with Join([ddp, zero]):
        for iteration in range(BATCHES[rank]):
            zero.zero_grad()
            ddp(_batch(rank, iteration)).square().mean().backward()
            zero.step()
    return [p.detach().clone() for p in model.parameters()], zero


def _owners(zero: ZeroRedundancyOptimizer) -> list[torch.Tensor]:
    """Each parameter's owner per element, in memory order."""
    owners = []
    for param in zero.global_params:
        owner = torch.empty(param.numel(), dtype=torch.long)
        for fragment in zero.fragments_of(param):
            owner[fragment.offset : fragment.offset + fragment.length] = fragment.rank
        owners.append(owner)
    return owners


def _reference(world_size: int, owners: list[torch.Tensor]) -> list[torch.Tensor]:
    """Plain SGD where each element takes the DDP average (joined ranks give zeros) while its owner is active, and
    its owner's last average (the ``.grad`` it holds) once the owner has joined: torch's semantics, any partition."""
    model = _Net()
    optim = torch.optim.SGD(model.parameters(), **SGD)
    last: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
    for iteration in range(max(BATCHES)):
        active = [iteration < count for count in BATCHES]
        model.zero_grad()
        for r in range(world_size):
            if active[r]:
                model(_batch(r, iteration)).square().mean().backward()
        average = [flat_view(p.grad) / world_size for p in model.parameters()]  # memory order
        last = [average if active[r] else last[r] for r in range(world_size)]
        for index, (param, owner) in enumerate(zip(model.parameters(), owners)):
            applied = average[index].clone()
            for r in range(world_size):
                if not active[r]:
                    applied[owner == r] = last[r][index][owner == r]
            assert param.grad is not None and param.grad.stride() == param.stride()
            flat_view(param.grad).copy_(applied)
        optim.step()
    return [p.detach() for p in model.parameters()]


def _ddp_body(rank: int, world_size: int) -> None:
    """Each mode against the reference above, and the greedy partition (torch's) against torch's class bitwise."""
    torchs, zero = _train_under_join(rank, lambda ps: TorchZero(ps, torch.optim.SGD, **SGD))
    for (partition, view), to_owners in itertools.product(MODES, [False, True]):
        build = lambda ps, partition=partition, view=view: ZeroRedundancyOptimizer(
            ps, torch.optim.SGD, parameters_as_bucket_view=view, partition=partition, **SGD
        )
        got, zero = _train_under_join(rank, build, to_owners)
        what = f"{partition} bucket_view={view} to_owners={to_owners}"
        for index, (a, b) in enumerate(zip(got, _reference(world_size, _owners(zero)))):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, w=f"{what} [{index}]": f"{w}: {m}")
        if partition == "greedy" and not to_owners:  # the same owners and gradients as torch's: the same bits
            for index, (a, b) in enumerate(zip(got, torchs)):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, w=f"{what} [{index}]": f"{w}: {m}")


def test_ddp_and_zero_under_join_match_torchs_zero() -> None:
    run_on_ranks(_ddp_body, 3, timeout=300)


def _refusals_body(rank: int, world_size: int) -> None:
    """ShardedDataParallel and hybrid sharding refuse Join where it is built (the wrapper, where a Join came first);
    a GradScaler under Join raises on every rank at the first step a rank has joined, before any rank stepped."""
    net = _Net()
    sdp = ShardedDataParallel(net, ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1))
    for joinables in ([sdp], [sdp, sdp.zero], [sdp.zero]):
        with pytest.raises(NotImplementedError, match=r"Join \(uneven inputs\) is not supported with Sharded"):
            Join(joinables)
    joined_first = _Net()  # Join built over the optimizer before the wrapper: its hook would hang the backward
    zero = ZeroRedundancyOptimizer(joined_first.parameters(), torch.optim.SGD, lr=0.1)
    refusal = r"Join \(uneven inputs\) is not supported with Sharded"
    with Join([DDP(joined_first), zero]), pytest.raises(NotImplementedError, match=refusal):
        ShardedDataParallel(joined_first, zero)
    kept = Join([DDP(joined_first), zero])  # a Join kept may be entered again: open until dropped (review r-24a)
    with kept:
        pass
    with pytest.raises(NotImplementedError, match=refusal):
        ShardedDataParallel(joined_first, zero)
    del kept
    ShardedDataParallel(joined_first, zero)  # those Joins are gone (review r-45f: torch keeps its config set)
    shards = [dist.new_group([r]) for r in range(world_size)]
    replicas = dist.new_group(list(range(world_size)))
    hybrid = ZeroRedundancyOptimizer(
        _Net().parameters(), torch.optim.SGD, process_group=shards[rank], replicate_group=replicas, lr=0.1
    )
    with pytest.raises(NotImplementedError, match=r"not supported with hybrid sharding \(replicate_group\)"):
        Join([hybrid])

    model = _Net()
    ddp = DDP(model)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, partition="even", lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    refusal = r"while the others step under a torch.amp.GradScaler"
    with pytest.raises(RuntimeError, match=refusal), Join([ddp, zero]):
        for iteration in range(1 + rank):
            zero.zero_grad()
            scaler.scale(ddp(_batch(rank, iteration)).square().mean()).backward()
            scaler.step(zero)
            scaler.update()
            after_first = [p.detach().clone() for p in model.parameters()]
    for param, kept in zip(model.parameters(), after_first):  # neither rank stepped at the refused step
        assert torch.equal(param.detach(), kept)
    ShardedDataParallel(model, zero)  # that Join exited on the refusal (no post-hook) and is gone: not open


def test_join_refusals_on_every_rank() -> None:
    run_on_ranks(_refusals_body, 2)


LISTED_FIRST = r"Join lists the ZeroRedundancyOptimizer first"


def _listed_first_body(rank: int, world_size: int) -> list[torch.Tensor]:
    """``Join([zero, ddp])``: a joined rank's shadow of the step would meet DDP's collectives (torch's ZeRO aborts in
    gloo there). Refused where ``Join`` is built, on every rank; the same optimizer
    then trains under ``Join([ddp, zero])`` exactly as one never refused, in each mode. A disabled Join and the
    program reading ``join_device`` are not refused; a Join exited inside another leaves that one open, where
    ShardedDataParallel is still refused (review r-23b)."""
    from distoptim.hooks import allreduce_hook, hook_with_zero_step, hook_with_zero_step_interleaved

    trained = []
    for hook, refused in itertools.product((None, hook_with_zero_step, hook_with_zero_step_interleaved), (1, 0)):
        model = _Net()
        ddp = DDP(model, bucket_cap_mb=0.0002)
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, overlap_with_ddp=hook is not None, **SGD)
        if hook is not None:
            ddp.register_comm_hook(None, hook(allreduce_hook, ddp, zero, step_from_first_backward=True))
        for joinables in [[zero, ddp], [zero]] if refused else []:
            with pytest.raises(ValueError, match=LISTED_FIRST):
                Join(joinables)
        assert Join.notify_join_context(zero) is None  # the refused Join's mark undone: no notice at each step
        Join([zero, ddp], enable=False)  # disabled: shadows nothing
        with Join([ddp, zero]):
            if refused and hook is None:  # a Join exited inside an open one: that one stays open
                with Join([ddp, zero]):
                    pass
                with pytest.raises(NotImplementedError, match=r"Join \(uneven inputs\) is not supported with Sharded"):
                    ShardedDataParallel(model, zero)
            for iteration in range(rank + 2):
                assert zero.join_device == torch.device("cpu")  # read by the program: no refusal
                zero.zero_grad()
                ddp(_batch(rank, iteration)).square().mean().backward()
                if hook is None:
                    zero.step()
        trained.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    for refused_run, fresh_run in zip(trained[::2], trained[1::2]):
        assert torch.equal(refused_run, fresh_run)
    return trained


def test_zero_listed_first_in_join_is_refused_on_every_rank_where_join_is_built() -> None:
    first, second = run_on_ranks(_listed_first_body, 2)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def _two_weights() -> nn.Module:
    """Two weights of one size: the greedy and the even partitions give each rank one of them (torch's owners)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4, bias=False), nn.Tanh(), nn.Linear(4, 4, bias=False))


def _train_scheduled(rank: int, build: Any, batches: list[int], bump_on: int = -1) -> list[torch.Tensor]:
    """DDP + an optimizer under ``Join`` with a StepLR stepped after every step: a joined rank's scheduler stops, so
    its lr is its own. Rank ``bump_on`` doubles its lr alone at its third step (a change no other rank made)."""
    model = _two_weights()
    ddp = DDP(model)
    optim = build(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optim, 1, gamma=0.5)
    with Join([ddp, optim]):
        for iteration in range(batches[rank]):
            optim.zero_grad()
            ddp(
                torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * iteration + rank))
            ).square().sum().backward()
            if rank == bump_on and iteration == 2:
                optim.param_groups[0]["lr"] *= 2
            optim.step()
            scheduler.step()
    return [p.detach().clone() for p in model.parameters()]


def _scheduled_body(rank: int, world_size: int) -> None:
    """torch's ZeRO steps a joined rank's shard with that rank's own lr; distoptim does too, bitwise, in both
    partitions (their owners are torch's here)."""
    torchs = _train_scheduled(rank, lambda ps: TorchZero(ps, torch.optim.SGD, **SGD), [3, 6])
    for partition in ["greedy", "even"]:
        build = lambda ps, partition=partition: ZeroRedundancyOptimizer(ps, torch.optim.SGD, partition=partition, **SGD)
        for a, b in zip(_train_scheduled(rank, build, [3, 6]), torchs):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, w=partition: f"{w}: {m}")


def test_lr_scheduler_under_join_matches_torchs_zero() -> None:
    run_on_ranks(_scheduled_body, 2)


def _training_ranks_disagree_body(rank: int, world_size: int) -> None:
    """Rank 0 has joined (its lr is its own); rank 1 changes its lr alone: every rank raises, the joined one too."""
    torch.testing.assert_close(  # torch's ZeRO runs it (no check): the reference for what is not refused
        _train_scheduled(rank, lambda ps: TorchZero(ps, torch.optim.SGD, **SGD), [1, 4, 4], bump_on=-1),
        _train_scheduled(rank, lambda ps: ZeroRedundancyOptimizer(ps, torch.optim.SGD, **SGD), [1, 4, 4]),
        rtol=0,
        atol=0,
    )
    build = lambda ps: ZeroRedundancyOptimizer(ps, torch.optim.SGD, **SGD)
    with pytest.raises(ValueError, match=r"step: rank (1 and rank 2|2 and rank 1) disagree \(param group 0: 'lr' "):
        _train_scheduled(rank, build, [1, 4, 4], bump_on=1)


def test_hyperparameters_of_training_ranks_still_agree_under_join() -> None:
    run_on_ranks(_training_ranks_disagree_body, 3, timeout=300)
