"""What users and schedulers write outside the optimizer reaches the step: hyperparameters edited in
``zero.param_groups`` survive parameters getting new storage or being unfrozen before a step (the repartition that
follows must not copy the local optimizer's old settings back), and master copies notice weights written into the
model after the optimizer exists (``model.load_state_dict``). References: DDP + the plain optimizer + the same
scheduler, or the plain optimizer on averaged gradients, in the same test."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import ExponentialLR, LambdaLR, LRScheduler

from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer
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


BF16 = torch.bfloat16


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
