"""What users and schedulers write outside the optimizer reaches the step: hyperparameters edited in
``zero.param_groups`` survive parameters getting new storage or being unfrozen before a step (the repartition that
follows must not copy the local optimizer's old settings back), and master copies notice weights written into the
model after the optimizer exists (``model.load_state_dict``). References: DDP + the plain optimizer + the same
scheduler, or the plain optimizer on averaged gradients, in the same test."""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import ExponentialLR, LambdaLR, LRScheduler

from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer, checkpoint
from distoptim.zero.shard import MASTER_KEY
from tests._dist import run_on_ranks
from tests._reference import MasterWeightsReference, averaged_gradients, flatten, make_params, set_gradients
from tests.zero._hooks import register

STEPS = 6
SCHEDULES: dict[str, Callable[[Any], LRScheduler]] = {
    "exponential": lambda optimizer: ExponentialLR(optimizer, gamma=0.5),
    "warmup": lambda optimizer: LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4)),
}


def _model(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def _new_storage(model: nn.Module, step: int, round_trip: bool = True) -> None:
    """Before steps 0 and 3 every parameter gets new storage (``param.data = ...``, as Accelerate's ``prepare``
    moving the model does), before step 2 (``round_trip``) ``model.to(...)`` there and back; the values stay as they
    are. No round trip under DDP: DDP's own reference diverges after one (a dtype change it does not support)."""
    if step in (0, 2, 3) and not (step == 2 and round_trip):
        for param in model.parameters():
            param.data = param.data.clone()
    if step == 2 and round_trip:
        model.to(torch.float64).to(torch.float32)


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _assert_close(ours: nn.Module, want: nn.Module, what: str) -> None:
    for index, (param, expected) in enumerate(zip(ours.parameters(), want.parameters())):
        label = f"{what} parameter {index}"
        torch.testing.assert_close(param, expected, rtol=1e-5, atol=1e-6, msg=lambda m, x=label: f"{x}: {m}")


def _ddp_body(rank: int, world_size: int) -> None:
    """ZeRO-1 (greedy/even x bucket views), reduce_to_owners_hook and both overlap hooks, against DDP + AdamW."""
    configs: list[tuple[str, bool, str, str]] = [
        (p, v, "all_reduce", "explicit") for p, v in itertools.product(("greedy", "even"), (False, True))
    ]
    configs += [("even", False, "to_owners", "explicit"), ("greedy", False, "all_reduce", "hook")]
    configs += [("even", False, "to_owners", "interleaved")]
    for (partition, bucket_view, reduction, stepping), schedule in itertools.product(configs, SCHEDULES):
        what = f"{partition} bucket_view={bucket_view} {reduction} {stepping} {schedule}"
        model, reference = _model(), _model()
        ddp, reference_ddp = DDP(model), DDP(reference)
        zero = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.AdamW, partition=partition, parameters_as_bucket_view=bucket_view,
            overlap_with_ddp=stepping != "explicit", lr=0.01,
        )  # fmt: skip
        register(ddp, zero, reduction, stepping)
        plain = torch.optim.AdamW(reference.parameters(), lr=0.01)
        scheduler, reference_scheduler = SCHEDULES[schedule](zero), SCHEDULES[schedule](plain)
        for step in range(STEPS):
            _new_storage(model, step, round_trip=False)
            zero.zero_grad()
            ddp(_batch(rank, step)).square().mean().backward()
            if stepping == "explicit":
                zero.step()
            plain.zero_grad()
            reference_ddp(_batch(rank, step)).square().mean().backward()
            plain.step()
            _assert_close(model, reference, f"{what} step {step}")
            scheduler.step()
            reference_scheduler.step()
            assert zero.param_groups[0]["lr"] == plain.param_groups[0]["lr"], what


def test_hyperparameters_survive_new_storage_under_ddp() -> None:
    run_on_ranks(_ddp_body, 2, timeout=300)


def _sharded_body(rank: int, world_size: int) -> None:
    """ShardedDataParallel (greedy and even, bucket views on and off) against DDP + AdamW."""
    for partition, bucket_view, schedule in itertools.product(("greedy", "even"), (False, True), SCHEDULES):
        what = f"sharded {partition} bucket_view={bucket_view} {schedule}"
        model, reference = _model(), _model()
        zero = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.AdamW, partition=partition, parameters_as_bucket_view=bucket_view, lr=0.01
        )
        sdp, reference_ddp = ShardedDataParallel(model, zero), DDP(reference)
        plain = torch.optim.AdamW(reference.parameters(), lr=0.01)
        scheduler, reference_scheduler = SCHEDULES[schedule](zero), SCHEDULES[schedule](plain)
        for step in range(STEPS):
            sdp.sync_finished()
            _new_storage(model, step)
            zero.zero_grad()
            sdp(_batch(rank, step)).square().mean().backward()
            zero.step()
            plain.zero_grad()
            reference_ddp(_batch(rank, step)).square().mean().backward()
            plain.step()
            sdp.sync_finished()
            _assert_close(model, reference, f"{what} step {step}")
            scheduler.step()
            reference_scheduler.step()


def test_hyperparameters_survive_new_storage_under_sharded_data_parallel() -> None:
    run_on_ranks(_sharded_body, 2, timeout=300)


def _unfreeze_body(rank: int, world_size: int) -> None:
    """A frozen parameter made trainable mid-schedule (its owner is placed then): the plain optimizer on the
    averaged gradients, same scheduler."""
    spec = [[((16, 8), torch.float32, True), ((8, 8), torch.float32, False)], [((4, 16), torch.float32, True)]]
    for partition, bucket_view, schedule in itertools.product(("greedy", "even"), (False, True), SCHEDULES):
        what = f"unfreeze {partition} bucket_view={bucket_view} {schedule}"
        ours, theirs = make_params(spec), make_params(spec)
        zero = ZeroRedundancyOptimizer(
            [{"params": ours[0]}, {"params": ours[1], "lr": 0.02}], torch.optim.AdamW, partition=partition,
            parameters_as_bucket_view=bucket_view, lr=0.01,
        )  # fmt: skip
        plain = torch.optim.AdamW([{"params": theirs[0]}, {"params": theirs[1], "lr": 0.02}], lr=0.01)
        scheduler, reference_scheduler = SCHEDULES[schedule](zero), SCHEDULES[schedule](plain)
        for step in range(STEPS):
            if step == 2:
                ours[0][1].requires_grad_(True)
                theirs[0][1].requires_grad_(True)
            grads = averaged_gradients(flatten(ours), rank, step)
            set_gradients(grads, flatten(ours), flatten(theirs))
            zero.step()
            plain.step()
            for index, (param, want) in enumerate(zip(flatten(ours), flatten(theirs))):
                torch.testing.assert_close(param, want, rtol=1e-6, atol=1e-7, msg=f"{what} step {step} [{index}]")
            scheduler.step()
            reference_scheduler.step()


def test_hyperparameters_survive_unfreezing() -> None:
    run_on_ranks(_unfreeze_body, 2, timeout=300)


BF16, F64 = torch.bfloat16, torch.float64


def _write_weights(model: nn.Module, step: int, load: Callable[[dict[str, torch.Tensor]], Any]) -> list[int]:
    """Weights written into the model after the optimizer exists: before step 2 ``load_state_dict`` of other
    weights (an ``nn.Module``'s ``copy_``), before step 4 one weight written through ``.data`` (as Hugging Face's
    ``_init_weights`` does: no ``_version`` bump) and one given new storage with new values. Returns the indices
    of the parameters written."""
    if step == 2:
        load({name: value.to(BF16) for name, value in _model(torch.float32, seed=1).state_dict().items()})
        return list(range(len(list(model.parameters()))))
    if step == 4:
        first, *_, last = model.parameters()
        first.data.mul_(0.5)
        last.data = torch.full_like(last.data, -0.25)
        return [0, len(list(model.parameters())) - 1]
    return []


def _load_prefixed(wrapped: nn.Module, state: dict[str, torch.Tensor]) -> Any:
    """``ShardedDataParallel.load_state_dict`` (keys prefixed ``module.``, as DDP's)."""
    return wrapped.load_state_dict({f"module.{k}": v for k, v in state.items()})


def _master_body(rank: int, world_size: int) -> None:
    """bf16 model, fp32 masters: ZeRO-1 (greedy/even x bucket views), reduce_to_owners_hook, the overlap hook and
    ShardedDataParallel, against DDP + AdamW over fp32 copies re-seeded from the written weights."""
    configs = [(p, v, "all_reduce", "explicit") for p, v in itertools.product(("greedy", "even"), (False, True))]
    configs += [("even", False, "to_owners", "explicit"), ("greedy", False, "all_reduce", "hook")]
    configs += [("even", True, "sharded", "explicit"), ("greedy", False, "sharded", "explicit")]
    for partition, bucket_view, reduction, stepping in configs:
        what = f"masters {partition} bucket_view={bucket_view} {reduction} {stepping}"
        model, reference = _model(BF16), _model(BF16)
        zero = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.AdamW, partition=partition, parameters_as_bucket_view=bucket_view,
            overlap_with_ddp=stepping != "explicit", master_dtype=torch.float32, lr=0.01,
        )  # fmt: skip
        if reduction == "sharded":
            wrapped: nn.Module = ShardedDataParallel(model, zero)
            load = functools.partial(_load_prefixed, wrapped)
        else:
            wrapped = DDP(model)
            register(wrapped, zero, reduction, stepping)
            load = model.load_state_dict
        reference_ddp = DDP(reference)
        params = list(reference.parameters())
        plain = MasterWeightsReference(params, [{"params": params}], torch.optim.AdamW, {"lr": 0.01}, master=True)
        for step in range(6):
            _write_weights(model, step, load)
            written = _write_weights(reference, step, reference.load_state_dict)
            with torch.no_grad():  # the reference's masters start again from the written weights
                for index in written:
                    plain.stepped[index].copy_(plain.params[index])
            zero.zero_grad()
            wrapped(_batch(rank, step).to(BF16)).float().square().mean().backward()
            if stepping == "explicit":
                zero.step()
            plain.optimizer.zero_grad()
            reference.zero_grad()
            reference_ddp(_batch(rank, step).to(BF16)).float().square().mean().backward()
            plain.step(clip=None)
            if reduction == "sharded":
                wrapped.sync_finished()  # type: ignore[operator]
            # bf16 gradients: SDP and reduce_to_owners sum them in another order than DDP's all-reduce
            exact = reduction == "all_reduce"
            for index, (param, want) in enumerate(zip(model.parameters(), reference.parameters())):
                label = f"{what} step {step} parameter {index}"
                torch.testing.assert_close(
                    param,
                    want,
                    rtol=0 if exact else 1.6e-2,
                    atol=0 if exact else 1e-3,
                    msg=lambda m, x=label: f"{x}: {m}",
                )


def test_master_weights_take_weights_written_into_the_model() -> None:
    run_on_ranks(_master_body, 2, timeout=300)


def _build_for_checkpoint(model: nn.Module, how: str) -> tuple[nn.Module, ZeroRedundancyOptimizer]:
    """Even partition (parameters cut across ranks), fp32 masters over a bf16 model: DDP + ZeRO-1, DDP with
    reduce_to_owners_hook (ZeRO-2), or ShardedDataParallel."""
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, partition="even", master_dtype=torch.float32, lr=0.01
    )
    if how == "sharded":
        return ShardedDataParallel(model, zero), zero
    ddp = DDP(model)
    register(ddp, zero, how, "explicit")
    return ddp, zero


def _resume(
    model: nn.Module, zero: ZeroRedundancyOptimizer, how: str, fmt: str, path: str, written: list[torch.Tensor]
) -> tuple[Any, Any]:
    """Save ``model`` and ``zero`` (DCP's sharded format, or torch.optim's consolidated on rank 0, whose master
    weights must be the ``written`` weights), then load them into a fresh model (other initial weights) and
    optimizer, as a restarted job does."""
    if fmt == "sharded":
        checkpoint.save({"model": model.state_dict(), "optim": zero.sharded_state_dict()}, path)
    else:
        zero.consolidate_state_dict(to=0)
        if dist.get_rank() == 0:
            optim = zero.state_dict()
            for index, want in enumerate(written):  # the masters saved are the weights written
                torch.testing.assert_close(optim["state"][index][MASTER_KEY], want.float(), rtol=0, atol=0)
            torch.save({"model": model.state_dict(), "optim": optim}, path)
    dist.barrier()
    fresh = _model(BF16, seed=3)
    wrapped, zero = _build_for_checkpoint(fresh, how)
    if fmt == "sharded":
        state = {"model": fresh.state_dict(), "optim": zero.sharded_state_dict()}
        checkpoint.load(state, path)
        fresh.load_state_dict(state["model"])
        zero.load_sharded_state_dict(state["optim"])
    else:
        state = torch.load(path, weights_only=False)
        fresh.load_state_dict(state["model"])
        zero.load_state_dict(state["optim"])
    return (fresh, wrapped), zero


def _checkpoint_after_new_storage_body(rank: int, world_size: int, root: str) -> None:
    """bf16 model, fp32 masters, even partition: after a step every parameter is given new storage with new values
    (``p.data = new``: a re-init, a graft of pretrained weights), then a checkpoint is saved and resumed into a fresh
    model and optimizer. Right after the load every rank's parameters equal the written weights, and the resumed run
    steps as DDP + AdamW over fp32 copies re-seeded from those weights, run without a checkpoint."""
    for how, fmt in itertools.product(("all_reduce", "to_owners", "sharded"), ("sharded", "consolidated")):
        what = f"new storage then a {fmt} checkpoint, {how}"
        model, reference = _model(BF16), _model(BF16)
        wrapped, zero = _build_for_checkpoint(model, how)
        reference_ddp = DDP(reference)
        params = list(reference.parameters())
        plain = MasterWeightsReference(params, [{"params": params}], torch.optim.AdamW, {"lr": 0.01}, master=True)
        for step in range(5):
            zero.zero_grad()
            wrapped(_batch(rank, step).to(BF16)).float().square().mean().backward()
            zero.step()
            plain.optimizer.zero_grad()
            reference.zero_grad()
            reference_ddp(_batch(rank, step).to(BF16)).float().square().mean().backward()
            plain.step(clip=None)
            if how == "sharded":
                wrapped.sync_finished()  # type: ignore[operator]
            if step == 1:
                for index, (param, want) in enumerate(zip(model.parameters(), reference.parameters())):
                    new = torch.randn(param.shape, generator=torch.Generator().manual_seed(index)).to(BF16)
                    param.data, want.data = new, new.clone()
                    with torch.no_grad():  # the reference's masters start again from the written weights
                        plain.stepped[index].copy_(want)
                (model, wrapped), zero = _resume(model, zero, how, fmt, os.path.join(root, f"{how}-{fmt}"), params)
                for index, (param, want) in enumerate(zip(model.parameters(), reference.parameters())):
                    label = f"{what}: parameter {index} right after the load"
                    torch.testing.assert_close(param, want, rtol=0, atol=0, msg=lambda m, x=label: f"{x}: {m}")
            if step > 1:  # bf16 gradients: SDP and reduce_to_owners sum them in another order than DDP's all-reduce
                exact = how == "all_reduce"
                for index, (param, want) in enumerate(zip(model.parameters(), reference.parameters())):
                    label = f"{what} step {step} parameter {index}"
                    torch.testing.assert_close(
                        param,
                        want,
                        rtol=0 if exact else 1.6e-2,
                        atol=0 if exact else 1e-3,
                        msg=lambda m, x=label: f"{x}: {m}",
                    )


def test_master_weights_given_new_storage_reach_a_checkpoint(tmp_path: Path) -> None:
    run_on_ranks(_checkpoint_after_new_storage_body, 2, str(tmp_path), timeout=300)


RETYPED = "changed dtype or device after the ZeroRedundancyOptimizer was built"


def _retype_body(rank: int, world_size: int) -> list[tuple[str, str]]:
    """``model.to(dtype)`` after the optimizer exists, on every rank or on rank 1 only, between a backward and the
    step (DDP + ZeRO-1, ZeRO-2, ShardedDataParallel) or before a checkpoint: each rank's error, or "ok"."""
    outcomes = []
    cases = [(how, "step", dtype, "all") for how in ("all_reduce", "to_owners", "sharded") for dtype in (F64, BF16)]
    cases += [("all_reduce", "step", F64, "rank 1"), ("to_owners", "sharded_state_dict", BF16, "rank 1")]
    cases += [("sharded", "consolidate_state_dict", F64, "all")]
    for how, where, dtype, who in cases:
        model = _model()
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, partition="even", lr=0.01)
        if how == "sharded":
            wrapped: nn.Module = ShardedDataParallel(model, zero)
        else:
            wrapped = DDP(model)
            register(wrapped, zero, how, "explicit")
        wrapped(_batch(rank, 0)).square().mean().backward()
        zero.step()
        zero.zero_grad()
        wrapped(_batch(rank, 1)).square().mean().backward()
        if who == "all" or rank == 1:
            model.to(dtype)
        try:
            if where == "step":
                zero.step()
            elif where == "sharded_state_dict":
                zero.sharded_state_dict()
            else:
                zero.consolidate_state_dict(to=0)
            outcomes.append((f"{how} {where} {dtype} {who}", "ok"))
        except ValueError as error:
            outcomes.append((f"{how} {where} {dtype} {who}", str(error)))
    return outcomes


def test_a_dtype_change_after_the_optimizer_was_built_is_refused_on_every_rank() -> None:
    """The optimizer's partition, master copies and state were made for the old dtype: every rank raises, saying
    what changed and what to do (convert the model first, or build a new optimizer and load a checkpoint)."""
    for rank, outcomes in enumerate(run_on_ranks(_retype_body, 2, timeout=300)):
        for what, outcome in outcomes:
            assert RETYPED in outcome, (rank, what, outcome)
            assert "Convert the model before building the optimizer" in outcome, (rank, what, outcome)
            if "rank 1" in what and rank == 0:
                assert "on rank 1" in outcome, (rank, what, outcome)
