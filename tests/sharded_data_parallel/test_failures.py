"""ShardedDataParallel where the ranks' programs part: forwards through the wrapper that not every rank runs (each
must train as DDP + the plain optimizer, not hang), a backward that raised midway (after a launched reduction every
later forward, step, clear and clip refuses: restart from a checkpoint, as after DDP's; before any, ``zero_grad()``
drops it), two wrappers on one process group (refused; a group each trains as DDP), and what a step costs on the
control plane (nothing per backward, one agreement per plain step)."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer
from distoptim.comm import agreement
from tests._dist import run_on_ranks

KW = {"lr": 0.05, "weight_decay": 0.1}


class Chain(nn.Module):
    def __init__(self, n: int = 4, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(n))
        self.branch = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x + self.branch(x) if use_branch else x


def _x(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def _sdp(
    model: nn.Module, partition: str = "even", group: Any = None, replicas: Any = None, static_graph: bool = False
) -> tuple[Any, ShardedDataParallel]:
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, partition=partition, process_group=group, replicate_group=replicas, **KW
    )
    return zero, ShardedDataParallel(model, zero, bucket_cap_mb=0.0001, static_graph=static_graph)


def _compare(ours: nn.Module, ref: nn.Module, label: str) -> None:
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{label} {n}: {m}")


# ------------------------------------------------------ forwards through the wrapper that not every rank runs
def _uneven(how: str, sdp: ShardedDataParallel, rank: int, step: int) -> torch.Tensor | None:
    """A forward on some ranks only, before this step's training forward (or, ``eval_before_backward``, between it
    and its backward: the loss is returned to be backwarded after)."""
    if how == "validation_with_grad":  # an uneven validation loop, gradients left enabled
        for batch in range(3 if rank == 0 else 1):
            sdp(_x(rank, 500 + batch)).sum()
    elif how == "sample_on_rank0" and rank == 0:  # a sample logged on rank 0
        sdp(_x(rank, 900 + step))
    loss = sdp(_x(rank, step)).square().mean()
    if how == "eval_before_backward" and rank == 0:  # a no_grad evaluation between a forward and its backward
        with torch.no_grad():
            sdp(_x(rank, 700 + step))
    return loss


def _uneven_body(rank: int, world_size: int, how: str) -> None:
    model, reference = Chain(), Chain()
    zero, sdp = _sdp(model)
    ddp, plain = DDP(reference), torch.optim.AdamW(reference.parameters(), **KW)
    for step in range(3):
        zero.zero_grad()
        loss = _uneven(how, sdp, rank, step)
        assert loss is not None
        loss.backward()
        zero.step()
        plain.zero_grad()
        ddp(_x(rank, step)).square().mean().backward()
        plain.step()
        _compare(model, reference, f"{how} step {step}")


@pytest.mark.parametrize("how", ["validation_with_grad", "sample_on_rank0", "eval_before_backward"])
def test_forwards_some_ranks_run_alone_do_not_hang_and_train_as_ddp(how: str) -> None:
    """Before, these hung until the process group's timeout: the ranks compared their pending forwards through the
    c10d store only where a forward was pending, which differed between ranks."""
    run_on_ranks(_uneven_body, 2, how, timeout=60)


# ------------------------------------------------------------------------ a backward that raised midway
class _Fails(Exception):
    pass


def _fail(*_: Any) -> None:
    raise _Fails("the backward fails here")


def _failed_backward_body(rank: int, world_size: int, layer: int) -> list[str]:
    """A step, then a backward that raises in ``layers[layer]``'s backward (ranks 0 and 1 alike); then a forward, a
    step, ``zero_grad`` (each through every object) are tried: what each raised, or "accepted"."""
    model = Chain()
    zero, sdp = _sdp(model)
    sdp(_x(rank, 0)).square().mean().backward()
    zero.step()
    handle = model.layers[layer].register_full_backward_pre_hook(_fail)
    with contextlib.suppress(_Fails):
        sdp(_x(rank, 1)).square().mean().backward()
    handle.remove()
    outcomes = []
    for attempt in (
        lambda: sdp(_x(rank, 2)),
        zero.step,
        zero.zero_grad,
        sdp.zero_grad,
        lambda: zero.clip_grad_norm_(1),
    ):
        try:
            attempt()
            outcomes.append("accepted")
        except RuntimeError as error:
            outcomes.append(str(error))
    return outcomes


def test_a_backward_that_raised_after_launching_reductions_is_refused_until_a_restart() -> None:
    """The first layer's backward raises after the later layers' buckets were launched: every later forward, step,
    clear and clip refuses on every rank (the ranks' reductions no longer pair up), naming the restart."""
    for outcomes in run_on_ranks(_failed_backward_body, 2, 0, timeout=60):
        assert all("Restart from a checkpoint" in outcome for outcome in outcomes), outcomes


def _raise_apart(model: Chain, sdp: ShardedDataParallel, rank: int) -> None:
    """A backward raising on group rank 0 once the branch's weight's bucket was launched (its hook runs after the
    wrapper's), on group rank 1 before any gradient: the group's point-to-point tags drift apart."""
    out = sdp(_x(rank, 1))
    hook = model.branch.weight.register_post_accumulate_grad_hook(_fail) if rank % 2 == 0 else out.register_hook(_fail)
    with contextlib.suppress(_Fails):
        out.square().mean().backward()
    hook.remove()


def _raised_apart_body(rank: int, world_size: int) -> str:
    """Rank 0's backward raises once the branch's weight's bucket was launched, rank 1's before any gradient: their
    point-to-point tags drift apart. A wrapper built again on that process group is refused on every rank (its
    reductions would pair with the stale ones: a crash, or a wrong sum where the sizes match); on a new process
    group, training goes on as DDP + the plain optimizer's."""
    model = Chain()
    _raise_apart(model, _sdp(model)[1], rank)
    try:
        _sdp(Chain())
        refusal = "accepted"
    except ValueError as error:
        refusal = str(error)
    model, reference = Chain(), Chain()
    zero, sdp = _sdp(model, group=dist.new_group([0, 1]))
    ddp, plain = DDP(reference), torch.optim.AdamW(reference.parameters(), **KW)
    for step in range(2):
        for opt, wrapper in ((zero, sdp), (plain, ddp)):
            opt.zero_grad()
            wrapper(_x(rank, step)).square().mean().backward()
            opt.step()
    _compare(model, reference, "on a new process group after a backward that raised apart")
    return refusal


def test_a_wrapper_on_a_group_whose_ranks_raised_apart_is_refused_and_a_new_group_trains() -> None:
    for refusal in run_on_ranks(_raised_apart_body, 2, timeout=60):
        assert "disagree (reductions and syncs started point to point on this group" in refusal, refusal
        assert "torch.distributed.new_group" in refusal, refusal


def _hybrid_after_apart_jobs_body(rank: int, world_size: int) -> str:
    """Ranks {0, 1} train on their shard group for 2 steps, ranks {2, 3} on theirs for 3 (nothing raises): a hybrid
    wrapper over those shard groups builds and trains, each group's messages compared over its own ranks only (a
    review of 703d374 found them compared over the replicate group, a refusal)."""
    groups = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3], [0, 2], [1, 3])]
    shard, replicas = groups[rank // 2], groups[2 + rank % 2]
    model = Chain()
    zero, sdp = _sdp(model, group=shard)
    for step in range(2 if rank < 2 else 3):
        zero.zero_grad()
        sdp(_x(rank, step)).square().mean().backward()
        zero.step()
    sdp.sync_finished()
    zero, sdp = _sdp(Chain(), group=shard, replicas=replicas)
    sdp(_x(rank, 0)).square().mean().backward()
    zero.step()
    return "trained"


def test_a_hybrid_wrapper_on_groups_that_trained_apart_builds() -> None:
    assert run_on_ranks(_hybrid_after_apart_jobs_body, 4, timeout=90) == ["trained"] * 4


def _hybrid_raised_apart_body(rank: int, world_size: int) -> str:
    """Shard group {0, 1}'s backward raised apart (rank 0 after a launch, rank 1 before any gradient); {2, 3} trained.
    A hybrid wrapper over those groups is refused on all four ranks: {2, 3} hear of {0, 1}'s refusal rather than wait
    for them in the replicate groups' agreements (review r-21b: a hang until the process group's timeout)."""
    groups = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3], [0, 2], [1, 3])]
    shard, replicas = groups[rank // 2], groups[2 + rank % 2]
    model = Chain()
    zero, sdp = _sdp(model, group=shard)
    if rank < 2:
        _raise_apart(model, sdp, rank)
    else:
        sdp(_x(rank, 1)).square().mean().backward()
        zero.step()
    try:
        _sdp(Chain(), group=shard, replicas=replicas)
    except ValueError as error:
        return str(error)
    return "accepted"


def test_a_hybrid_wrapper_after_one_shard_group_raised_apart_is_refused_on_every_rank() -> None:
    for refusal in run_on_ranks(_hybrid_raised_apart_body, 4, timeout=90):
        assert "disagree (reductions and syncs started point to point on this group" in refusal, refusal


def _failed_before_any_gradient_body(rank: int, world_size: int) -> None:
    """A backward that raises before any parameter's gradient arrived (in the loss's own backward) launched nothing:
    training goes on, as DDP + the plain optimizer's without that batch."""
    model, reference = Chain(), Chain()
    zero, sdp = _sdp(model)
    ddp, plain = DDP(reference), torch.optim.AdamW(reference.parameters(), **KW)
    out = sdp(_x(rank, 1))
    out.register_hook(_fail)
    with contextlib.suppress(_Fails):
        out.square().mean().backward()
    for step in range(2):
        for opt, wrapper in ((zero, sdp), (plain, ddp)):
            opt.zero_grad()
            wrapper(_x(rank, step)).square().mean().backward()
            opt.step()
    _compare(model, reference, "after a backward that raised before any gradient")


def test_a_backward_that_raised_before_any_gradient_leaves_training_as_ddp() -> None:
    run_on_ranks(_failed_before_any_gradient_body, 2, timeout=60)


class _FailsOnce:
    """A gradient hook that raises at the first gradient after it is armed."""

    armed = False

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.armed = False
            raise _Fails("the first gradient's hook fails")
        return grad


def _raised_after_settle_body(rank: int, world_size: int, set_to_none: bool) -> None:
    """A backward that raises in a gradient hook of the program's, after the store took its markers out of ``.grad``
    and before any gradient accumulated: ``.grad`` stays as torch leaves it (review r-18c: a clear to zeros then
    forgot every gradient, 0.035 off, and later backwards accumulated into markers)."""
    model, reference = Chain(), Chain()
    zero, sdp = _sdp(model)
    ddp, plain = DDP(reference), torch.optim.AdamW(reference.parameters(), **KW)
    once = _FailsOnce()
    for step in range(4):
        for opt, wrapper, net in ((zero, sdp, model), (plain, ddp, reference)):
            if step == 1:
                once.armed = True
                handles = [param.register_hook(once) for param in net.parameters()]
                with contextlib.suppress(_Fails):
                    wrapper(_x(rank, step)).square().mean().backward()
                for handle in handles:
                    handle.remove()
                opt.zero_grad(set_to_none=set_to_none)
                opt.step()  # straight after the clear: on zeros, or on nothing
            opt.zero_grad(set_to_none=set_to_none)
            wrapper(_x(rank, step)).square().mean().backward()
            opt.step()
        _compare(model, reference, f"step {step}, after a backward that raised in a gradient hook")


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_backward_that_raised_after_the_settle_leaves_grad_as_torch(set_to_none: bool) -> None:
    run_on_ranks(_raised_after_settle_body, 2, set_to_none, timeout=60)


def _failed_before_any_launch_body(rank: int, world_size: int, set_to_none: bool) -> list[str]:
    """One bucket: a backward that raises in the first layer, after the later layers' gradients went into it and
    before it was launched. The next forward refuses until ``zero_grad()``, which drops that gradient; then training
    is DDP + the plain optimizer's without that batch (their ``zero_grad`` alike)."""
    model, reference = Chain(), Chain()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, partition="even", **KW)
    sdp = ShardedDataParallel(model, zero)  # one bucket of 25 MiB: launched at the end of the backward only
    ddp, plain = DDP(reference), torch.optim.AdamW(reference.parameters(), **KW)
    for opt, wrapper in ((zero, sdp), (plain, ddp)):
        opt.zero_grad(set_to_none=set_to_none)
        wrapper(_x(rank, 0)).square().mean().backward()
        opt.step()
    handle = model.layers[0].register_full_backward_pre_hook(_fail)
    with contextlib.suppress(_Fails):
        sdp(_x(rank, 1)).square().mean().backward()
    handle.remove()
    refused = []
    for attempt in (lambda: sdp(_x(rank, 2)), zero.step, lambda: zero.clip_grad_norm_(1.0)):
        try:
            attempt()
            refused.append("accepted")
        except RuntimeError as error:
            refused.append(str(error))
    for step in range(2, 4):
        for opt, wrapper in ((zero, sdp), (plain, ddp)):
            opt.zero_grad(set_to_none=set_to_none)
            wrapper(_x(rank, step)).square().mean().backward()
            opt.step()
    _compare(model, reference, "after a backward that raised before launching")
    return refused


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_backward_that_raised_before_any_launch_is_dropped_by_zero_grad(set_to_none: bool) -> None:
    for outcomes in run_on_ranks(_failed_before_any_launch_body, 2, set_to_none, timeout=60):
        assert all("Call zero_grad()" in outcome for outcome in outcomes), outcomes


def _raised_then_dropped_body(rank: int, world_size: int, partition: str, where: str) -> None:
    """A backward that raises before launching anything (``layer``: in the first layer's backward, after the later
    layers' gradients went into the one bucket; ``hook``: in a gradient hook of the program's, before anything
    accumulated), then ``model.zero_grad()``, ``zero.zero_grad(set_to_none=False)`` and a backward without the branch:
    the branch has no gradient and is not stepped, as under torch (review r-19: stepped on zeros, 0.035 off, the
    clear could not see the program's None where the store had taken its markers out of ``.grad``)."""
    model, reference = Chain(), Chain()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, partition=partition, **KW)
    sdp = ShardedDataParallel(model, zero)  # one bucket of 25 MiB: launched at the end of the backward only
    ddp, plain = DDP(reference, find_unused_parameters=True), torch.optim.AdamW(reference.parameters(), **KW)
    once = _FailsOnce()
    for step in range(3):
        for opt, wrapper, net in ((zero, sdp, model), (plain, ddp, reference)):
            opt.zero_grad(set_to_none=False)
            if (
                step == 1 and opt is zero
            ):  # (DDP's reducer cannot go on after it; torch's .grad is None after the clear)
                once.armed = True
                handles = [model.layers[0].register_full_backward_pre_hook(_fail)] if where == "layer" else []
                handles += [param.register_hook(once) for param in model.parameters()] if where == "hook" else []
                with contextlib.suppress(_Fails):
                    sdp(_x(rank, 50)).square().mean().backward()
                for handle in handles:
                    handle.remove()
            if step == 1:
                net.zero_grad()
                opt.zero_grad(set_to_none=False)
            wrapper(_x(rank, step), use_branch=step != 1).square().mean().backward()
            opt.step()
        sdp.sync_finished()
        _compare(model, reference, f"{partition} {where}, step {step}")


@pytest.mark.parametrize("where", ["layer", "hook"])
@pytest.mark.parametrize("partition", ["even", "greedy"])
def test_a_raised_backward_then_grad_set_to_none_then_an_in_place_clear_leaves_no_gradient(
    partition: str, where: str
) -> None:
    run_on_ranks(_raised_then_dropped_body, 2, partition, where, timeout=60)


# ------------------------------------------------------------- two wrappers on one process group, one backward
def _hybrid_groups(rank: int) -> tuple[Any, Any]:
    """Shard pairs {0, 1}, {2, 3} and replicas {0, 2}, {1, 3}: this rank's (every rank makes every group)."""
    shards = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return shards[rank // 2], replicas[rank % 2]


def _gan_body(rank: int, world_size: int, own_groups: bool, hybrid: bool = False) -> str:
    """The generator's loss through the discriminator (one backward reaching both wrappers), the generator's branch
    on rank 0 only: refused on every rank on one group; with a group each, DDP + the plain optimizer's result."""
    if hybrid:  # each wrapper its own shard and replicate groups (a launch once waited there: a hang)
        (g_shards, g_replicas), (d_shards, d_replicas) = _hybrid_groups(rank), _hybrid_groups(rank)
    else:
        every = list(range(world_size))
        g_shards, d_shards = (dist.new_group(every), dist.new_group(every)) if own_groups else (None, None)
        g_replicas = d_replicas = None
    g, d, g_ref, d_ref = Chain(3, seed=1), Chain(2), Chain(3, seed=1), Chain(2)
    (zero_g, sdp_g), (zero_d, sdp_d) = _sdp(g, "greedy", g_shards, g_replicas), _sdp(d, "even", d_shards, d_replicas)
    ddp_g, ddp_d = DDP(g_ref, find_unused_parameters=True), DDP(d_ref, find_unused_parameters=True)
    plain_g, plain_d = torch.optim.AdamW(g_ref.parameters(), **KW), torch.optim.AdamW(d_ref.parameters(), **KW)
    for step in range(2):
        z, x = _x(rank, step), _x(rank, step + 50)
        for G, D, opt_g, opt_d in ((sdp_g, sdp_d, zero_g, zero_d), (ddp_g, ddp_d, plain_g, plain_d)):
            opt_g.zero_grad()
            opt_d.zero_grad()
            try:  # the generator's loss: gradients into both models
                D(G(z, rank == 0), False).mean().backward()
            except RuntimeError as error:  # one group: the older wrapper refuses its forward
                return str(error)
            opt_g.step()
            opt_d.zero_grad()
            (D(x, False).mean() - D(G(z, rank == 0).detach(), False).mean()).backward()
            opt_d.step()
        _compare(g, g_ref, f"generator step {step}")
        _compare(d, d_ref, f"discriminator step {step}")
    return "trained"


@pytest.mark.parametrize("own_groups", [False, True])
def test_two_wrappers_in_one_backward_need_a_process_group_each(own_groups: bool) -> None:
    for outcome in run_on_ranks(_gan_body, 2, own_groups, timeout=60):
        assert outcome == "trained" if own_groups else "a group of its own" in outcome, outcome


def test_two_hybrid_wrappers_in_one_backward_with_a_rank_dependent_branch_train_as_ddp() -> None:
    assert run_on_ranks(_gan_body, 4, True, True, timeout=90) == ["trained"] * 4


def _rewrap_body(rank: int, world_size: int) -> None:
    """The model wrapped again (a new optimizer, as after changing its settings) once the first wrapper is dropped:
    trains as DDP + AdamW built afresh at that point; the dropped wrapper's hooks once refused its backward."""
    model, reference = Chain(), Chain()
    ddp, plain = DDP(reference), torch.optim.AdamW(reference.parameters(), **KW)
    zero, sdp = _sdp(model)
    for step in range(4):
        if step == 2:
            del sdp
            zero, sdp = _sdp(model)
            plain = torch.optim.AdamW(reference.parameters(), **KW)
        for wrapper, optimizer in ((sdp, zero), (ddp, plain)):
            optimizer.zero_grad()
            wrapper(_x(rank, step)).square().mean().backward()
            optimizer.step()
        _compare(model, reference, f"step {step}")


def test_a_model_wrapped_again_after_dropping_its_wrapper_trains_as_ddp() -> None:
    run_on_ranks(_rewrap_body, 2, timeout=60)


# ------------------------------------------------------------------- what a step costs on the control plane
def _counts_body(rank: int, world_size: int, how: str) -> dict[str, int]:
    """Agreements (``agree_across_ranks``: one all-reduce on the control plane each) made in the backwards and in
    the steps of three steps of two micro-batches each."""
    model, reference = Chain(), Chain()
    if how.startswith("ddp"):
        ddp = DDP(model)
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **KW)
        wrapper: nn.Module = ddp
    else:
        zero, wrapper = _sdp(model, static_graph="static" in how)
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0) if how.endswith("scaler") else None
    counts: Counter[str] = Counter()
    phase = ["setup"]
    original = agreement.agree_across_ranks

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[phase[0]] += 1
        return original(*args, **kwargs)

    with mock.patch.object(agreement, "agree_across_ranks", counted):
        for step in range(3):
            zero.zero_grad()
            phase[0] = "backward"
            for micro in range(2):
                loss = wrapper(_x(rank, 10 * step + micro), use_branch="unused" not in how or rank == 0)
                (loss.square().mean() if scaler is None else scaler.scale(loss.square().mean())).backward()
            if how == "sdp_clip":  # the flags were agreed in the backwards: none here
                phase[0] = "clip"
                zero.clip_grad_norm_(1.0)
            phase[0] = "step"
            if scaler is None:
                zero.step()
            else:
                scaler.step(zero)
                scaler.update()
    del reference
    return dict(counts)


@pytest.mark.parametrize(
    ("how", "per_backward", "per_step", "first_step"),
    [
        ("ddp", 0, 1, 1),
        ("ddp_scaler", 0, 1, 1),
        ("sdp", 0, 1, 1),
        ("sdp_scaler", 0, 1, 2),
        ("sdp_unused", 0, 1, 1),
        ("sdp_clip", 0, 1, 1),
        ("sdp_static", 0, 1, 1),
        ("sdp_static_unused", 0, 1, 1),
        ("sdp_static_scaler", 0, 1, 2),
    ],
)
def test_agreements_none_per_backward_one_per_step(how: str, per_backward: int, per_step: int, first_step: int) -> None:
    """DDP + ZeRO-1: one agreement a step. SDP too: which parameters some rank used (so that ``.grad`` is None
    exactly where DDP's is) is summed at each backward's end as DDP's used map is (an all-reduce that cannot
    raise), not agreed. Under a GradScaler that sum carries whether an owned gradient holds an inf or nan too, once
    the first step has shown the scaler (under ``static_graph=True`` the backwards sum that flag alone): that first
    step agrees on the verdict before stepping, then around the local step."""
    for counts in run_on_ranks(_counts_body, 2, how, timeout=60):
        assert counts.get("backward", 0) == per_backward * 2 * 3, counts
        assert counts["step"] == first_step + per_step * 2, counts
        assert counts.get("clip", 0) == 0, counts


def _scaler_unknown_body(rank: int, world_size: int) -> None:
    """Rank 0's store never knows its backward's inf/nan verdict (as after a ``.grad`` set by hand), rank 1's does:
    rank 1 steps inside the one agreement, rank 0 after it, and both train as DDP + AdamW (it once never stepped)."""
    model, reference = Chain(), Chain()
    zero, sdp = _sdp(model)
    ddp, plain = DDP(reference), torch.optim.AdamW(reference.parameters(), **KW)
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
    store = zero.gradient_source
    assert store is not None
    if rank == 0:
        known = store.overflow_found
        store.overflow_found = lambda scaled: (known(scaled), None)[1]  # type: ignore[method-assign]
    for step in range(3):
        zero.zero_grad()
        scaler.scale(sdp(_x(rank, step)).square().mean()).backward()
        scaler.step(zero)
        scaler.update()
        plain.zero_grad()
        ddp(_x(rank, step)).square().mean().backward()
        plain.step()
        _compare(model, reference, f"step {step}")


def test_a_rank_unsure_of_the_summed_verdict_steps_after_the_others() -> None:
    run_on_ranks(_scaler_unknown_body, 2, timeout=60)


def _scaler_changed_body(rank: int, world_size: int, how: str) -> None:
    """After the third step's backward, ``.grad`` changed alike on every rank: ``hand_set``, an inf by hand in the
    first element of a parameter the backward did not reach (every rank skips and backs off); ``zeroed``, an inf the
    backward put there, then ``model.zero_grad(set_to_none=False)`` (every rank steps on zeros). As DDP + AdamW under
    their scaler: the backward's summed verdict is not reused once ``.grad`` changed (once, ranks raised or skipped)."""
    model, reference = Chain(), Chain()
    zero, sdp = _sdp(model)
    ddp, plain = DDP(reference, find_unused_parameters=True), torch.optim.AdamW(reference.parameters(), **KW)
    scalers = [torch.amp.GradScaler("cpu", init_scale=64.0) for _ in range(2)]
    inf = lambda grad: torch.zeros_like(grad).index_fill_(0, torch.tensor([0]), float("inf"))
    for step in range(4):
        for wrapper, optimizer, scaler in ((sdp, zero, scalers[0]), (ddp, plain, scalers[1])):
            weight = wrapper.module.branch.weight
            hook = weight.register_hook(inf) if step == 2 and how == "zeroed" else None
            optimizer.zero_grad()
            use_branch = step != 2 or how == "zeroed"
            scaler.scale(wrapper(_x(rank, step), use_branch=use_branch).square().mean()).backward()
            if step == 2 and how == "hand_set":
                weight.grad = inf(weight)
            elif hook is not None:
                hook.remove()
                wrapper.module.zero_grad(set_to_none=False)
            scaler.step(optimizer)
            scaler.update()
        skipped = step >= 2 and how == "hand_set"
        assert scalers[0].get_scale() == scalers[1].get_scale() == (32.0 if skipped else 64.0), step
        _compare(model, reference, f"step {step}")


@pytest.mark.parametrize("how", ["hand_set", "zeroed"])
def test_a_grad_changed_after_the_backward_is_checked_again_by_the_scaler(how: str) -> None:
    run_on_ranks(_scaler_changed_body, 2, how, timeout=60)


def _static_scaler_body(rank: int, world_size: int) -> None:
    """``static_graph=True`` under a GradScaler: an inf in one element of rank 1's gradient of the branch's weight at
    the third step (rank 0's is finite), held by one owner only. Every rank skips and backs off, as
    DDP(static_graph=True) + AdamW under their scaler (once, a verdict summed wrong raised on every rank instead)."""
    model, reference = Chain(), Chain()
    zero, sdp = _sdp(model, static_graph=True)
    ddp, plain = DDP(reference, static_graph=True), torch.optim.AdamW(reference.parameters(), **KW)
    scalers = [torch.amp.GradScaler("cpu", init_scale=64.0) for _ in range(2)]
    for step in range(4):
        for wrapper, optimizer, scaler in ((sdp, zero, scalers[0]), (ddp, plain, scalers[1])):
            weight = wrapper.module.branch.weight
            poisoned = step == 2 and rank == 1
            first_inf = lambda g: g.flatten().index_fill(0, torch.tensor([0]), float("inf")).view_as(g)
            hook = weight.register_hook(first_inf) if poisoned else None
            optimizer.zero_grad()
            scaler.scale(wrapper(_x(rank, step)).square().mean()).backward()
            if hook is not None:
                hook.remove()
            scaler.step(optimizer)
            scaler.update()
        assert scalers[0].get_scale() == scalers[1].get_scale() == (32.0 if step >= 2 else 64.0), step
        _compare(model, reference, f"step {step}")


def test_static_graph_under_a_scaler_skips_everywhere_on_one_ranks_inf() -> None:
    run_on_ranks(_static_scaler_body, 2, timeout=60)


def _static_scaler_refused_body(rank: int, world_size: int) -> None:
    """``static_graph=True`` under a GradScaler: rank 0's local part raises at the first scaled step, before it reads
    the verdict. Every rank raises; then both train on as DDP(static_graph=True) + AdamW under their scaler (review
    r-24b: whether a scaler steps, set in the local part, made rank 1 alone sum the next backward's flag: a hang)."""
    model, reference = Chain(), Chain()
    zero, sdp = _sdp(model, static_graph=True)
    ddp, plain = DDP(reference, static_graph=True), torch.optim.AdamW(reference.parameters(), **KW)
    store = zero.gradient_source
    assert store is not None
    for step in range(4):
        if step < 2:  # a scaler whose step raised cannot update: both sides start afresh after it
            scalers = [torch.amp.GradScaler("cpu", init_scale=64.0) for _ in range(2)]
        for wrapper, optimizer, scaler in ((sdp, zero, scalers[0]), (ddp, plain, scalers[1])):
            optimizer.zero_grad()
            scaler.scale(wrapper(_x(rank, step)).square().mean()).backward()
            if step > 0:
                scaler.step(optimizer)
                scaler.update()
            elif optimizer is zero:  # refused on every rank; the reference skips that step too
                failing = mock.patch.object(store, "check_finished", side_effect=RuntimeError("rank 0's local part"))
                with failing if rank == 0 else contextlib.nullcontext(), pytest.raises(Exception, match="local part"):
                    scaler.step(zero)
        _compare(model, reference, f"step {step}")


def test_static_graph_under_a_scaler_recovers_from_a_step_one_rank_refused() -> None:
    run_on_ranks(_static_scaler_refused_body, 2, timeout=60)


class _Half(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(8, dtype=torch.float16))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.w * c).float().sum() * 2


def _scaler_step_only_body(rank: int, world_size: int, how: str) -> list[Any]:
    """An inf only the step itself makes, on rank 1 (it owns elements 6 and 7): ``cast``, an fp32 store of fp16
    weights summing to 80000 over two backwards (inf once cast to fp16); ``unscaled``, a scale of 0.5 unscaling an
    fp16 60000 to 120000 (inf). The backward's summed verdict saw none: every rank must wait for the agreed one and skip
    (review r-20: rank 0 stepped on the sum, then every rank raised with the ranks' shards apart)."""
    model = _Half()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, partition="even", lr=0.1)
    sdp = ShardedDataParallel(model, zero, reduce_dtype=torch.float32 if how == "cast" else None)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0 if how == "cast" else 0.5, growth_interval=1000)
    seen = []
    for step in range(3):
        zero.zero_grad()
        c = torch.ones(8, dtype=torch.float16)
        c[6:] = (20000.0 if how == "cast" else 60000.0) if step == 1 else 1.0
        for _ in range(2 if how == "cast" else 1):
            scaler.scale(sdp(c)).backward()
        scaler.step(zero)
        scaler.update()
        seen.append((scaler.get_scale(), model.w.detach().float().tolist()))
    return seen


@pytest.mark.parametrize("how", ["cast", "unscaled"])
def test_an_inf_only_the_step_makes_skips_the_step_everywhere(how: str) -> None:
    ranks = run_on_ranks(_scaler_step_only_body, 2, how, timeout=60)
    assert ranks[0] == ranks[1], ranks
    (first, _), (second, skipped), (_, stepped) = ranks[0]
    assert second == first / 2 and skipped == ranks[0][0][1] and stepped != skipped, ranks[0]


def _static_body(rank: int, world_size: int, change: bool) -> None:
    """``static_graph=True`` trains as DDP + AdamW; a backward whose parameters differ from the first's (the branch
    unused by every rank at the third step) is refused at the step on every rank, naming the parameters."""
    model, reference = Chain(), Chain()
    zero, sdp = _sdp(model, static_graph=True)
    ddp = DDP(reference, find_unused_parameters=True)
    plain = torch.optim.AdamW(reference.parameters(), **KW)
    for step in range(4):
        use_branch = not (change and step == 2)
        zero.zero_grad()
        sdp(_x(rank, step), use_branch=use_branch).square().mean().backward()
        if not use_branch:
            with pytest.raises(ValueError, match=r"static_graph=True\): parameters \[\d"):
                zero.step()
            return
        zero.step()
        plain.zero_grad()
        ddp(_x(rank, step), use_branch=use_branch).square().mean().backward()
        plain.step()
        _compare(model, reference, f"step {step}")


@pytest.mark.parametrize("change", [False, True])
def test_static_graph_trains_as_ddp_and_refuses_a_changed_graph(change: bool) -> None:
    run_on_ranks(_static_body, 2, change, timeout=60)


def _static_step_first_body(rank: int, world_size: int) -> None:
    """``static_graph=True`` with a step before any backward (none, then on gradients set by hand, alike on every
    rank) trains as DDP + AdamW: the promise is the first backward's parameters, not the first step's."""
    model, reference = Chain(), Chain()
    zero, sdp = _sdp(model, static_graph=True)
    ddp = DDP(reference, find_unused_parameters=True)
    plain = torch.optim.AdamW(reference.parameters(), **KW)
    for opt, net in ((zero, model), (plain, reference)):
        opt.step()
        for param in net.parameters():
            param.grad = torch.full_like(param, 0.1)
        opt.step()
    _compare(model, reference, "hand-set step")
    for step in range(3):
        for opt, wrapper in ((zero, sdp), (plain, ddp)):
            opt.zero_grad()
            wrapper(_x(rank, step)).square().mean().backward()
            opt.step()
        _compare(model, reference, f"step {step}")


def test_static_graph_takes_its_promise_from_the_first_backward_not_a_step() -> None:
    run_on_ranks(_static_step_first_body, 2, timeout=60)


def _static_one_rank_body(rank: int, world_size: int) -> None:
    """``static_graph=True`` with the branch used on rank 0 only (even partition: rank 1 owns half of it without
    using it) and ``zero_grad()`` to None each step trains as DDP + AdamW. Rank 1 skipped its half from the second
    step on: the predicted backward let it step early, but its store no longer said it held that gradient."""
    model, reference = Chain(), Chain()
    zero, sdp = _sdp(model, static_graph=True)
    ddp = DDP(reference, find_unused_parameters=True)
    plain = torch.optim.AdamW(reference.parameters(), **KW)
    for step in range(3):
        for opt, wrapper in ((zero, sdp), (plain, ddp)):
            opt.zero_grad()
            wrapper(_x(rank, step), use_branch=rank == 0).square().mean().backward()
            opt.step()
        _compare(model, reference, f"step {step}")


def test_static_graph_steps_a_piece_its_owner_did_not_use() -> None:
    run_on_ranks(_static_one_rank_body, 2, timeout=60)


# ------------------------------------------- a clear between backwards, before the ranks agreed on what was used
def _clear_before_the_agreement_body(rank: int, world_size: int, how: str) -> None:
    """The branch is used on rank 0 only (even partition: rank 1 owns half of it without using it); between two
    backwards, no step between, the program clears through the inner module (to None or zeros). Rank 1 must see
    that clear too, though nothing told it yet that rank 0 used the branch: else the stale half of the first
    backward's sum would be stepped with the second's."""
    model, reference = Chain(), Chain()
    zero, sdp = _sdp(model)
    ddp = DDP(reference, find_unused_parameters=True)
    plain = torch.optim.AdamW(reference.parameters(), **KW)
    for step in range(2):
        for opt, wrapper, inner in ((zero, sdp, model), (plain, ddp, reference)):
            opt.zero_grad()
            wrapper(_x(rank, 10 * step), use_branch=rank == 0).square().mean().backward()
            if how == "module":
                inner.zero_grad()
            elif how == "module_zeros":
                inner.zero_grad(set_to_none=False)
            else:
                for p in inner.parameters():
                    p.grad = None
            wrapper(_x(rank, 10 * step + 1), use_branch=rank == 0).square().mean().backward()
            opt.step()
        sdp.sync_finished()
        _compare(model, reference, f"{how}, step {step}")


@pytest.mark.parametrize("how", ["module", "module_zeros", "param_none"])
def test_a_clear_between_backwards_reaches_owners_that_did_not_use_the_parameter(how: str) -> None:
    run_on_ranks(_clear_before_the_agreement_body, 2, how, timeout=60)


# ------------------------------------------------------------- .grad is None exactly where DDP's is
def _fill_none_body(rank: int, world_size: int, partition: str) -> list[list[int]]:
    """The branch no rank uses; the program gives every ``.grad`` that is None zeros (so that AdamW decays it), as
    some training loops do: each rank must see None where DDP's ranks do, or the owner skips the decay."""
    model, reference = Chain(), Chain()
    zero, sdp = _sdp(model, partition)
    ddp = DDP(reference, find_unused_parameters=True)
    plain = torch.optim.AdamW(reference.parameters(), **KW)
    seen = []
    for step in range(2):
        for opt, wrapper, inner in ((zero, sdp, model), (plain, ddp, reference)):
            opt.zero_grad()
            wrapper(_x(rank, step), use_branch=False).square().mean().backward()
            seen.append([i for i, p in enumerate(inner.parameters()) if p.grad is None])
            for p in inner.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            opt.step()
        sdp.sync_finished()
        _compare(model, reference, f"{partition}, step {step}")
    return seen


@pytest.mark.parametrize("partition", ["even", "greedy"])
def test_grad_is_none_where_no_rank_used_the_parameter_as_under_ddp(partition: str) -> None:
    for seen in run_on_ranks(_fill_none_body, 2, partition, timeout=60):
        assert seen[0] == seen[1] == seen[2] == seen[3] != [], seen
