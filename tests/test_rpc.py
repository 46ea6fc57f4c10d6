"""DistributedOptimizer on three RPC workers: worker0 trains, worker1 and worker2 own the two stages of the model.

Every check compares with the same model trained in worker0 by the ``torch.optim`` optimizer itself. Each test spawns
the workers once and runs a whole scenario in worker0 (the owners only serve RPCs), to keep spawning cheap.
"""

from __future__ import annotations

import io
import os
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import Tensor, nn

from distoptim import DistributedOptimizer
from distoptim.functional import FunctionalAdam
from distoptim.utils import register_functional_optim
from tests._dist import run_on_ranks

WORLD_SIZE = 3
STAGES = [(4, 3), (3, 2)]  # (in, out) of the stage on worker1, worker2
SIDE_USE = [(True, False), (False, False), (True, False)]  # per step: does each stage add its `side` parameter?


# ----------------------------------------------------------------------------------------------------- the model


class _Stage(nn.Module):
    """tanh(linear(x) + side): ``side`` gets a gradient only in steps that use it (stage 2's never does)."""

    def __init__(self, seed: int, d_in: int, d_out: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.linear = nn.Linear(d_in, d_out)
        self.side = nn.Parameter(torch.randn(d_out))

    def forward(self, x: Tensor, use_side: bool) -> Tensor:
        y = self.linear(x)
        return torch.tanh(y + self.side if use_side else y)


def _param_rrefs(stage: rpc.RRef[_Stage]) -> list[rpc.RRef[Tensor]]:
    return [rpc.RRef(param) for param in stage.local_value().parameters()]


def _forward(stage: rpc.RRef[_Stage], x: Tensor, use_side: bool) -> Tensor:
    return stage.local_value()(x, use_side)  # type: ignore[no-any-return]


def _values(stage: rpc.RRef[_Stage]) -> list[Tensor]:
    return [param.detach().clone() for param in stage.local_value().parameters()]


class _Model:
    """The two-stage model twice: split over worker1 and worker2, and whole in this process (the reference)."""

    def __init__(self, seed: int = 0) -> None:
        self.stages = [rpc.remote(f"worker{i + 1}", _Stage, args=(seed + i, *dims)) for i, dims in enumerate(STAGES)]
        self.local = [_Stage(seed + i, *dims) for i, dims in enumerate(STAGES)]
        self.param_rrefs = [
            rref for stage in self.stages for rref in rpc.rpc_sync(stage.owner(), _param_rrefs, (stage,))
        ]
        # An output scale owned by worker0, the trainer itself (param 6), and its counterpart in the reference.
        self.scale, self.local_scale = nn.Parameter(torch.tensor(1.5)), nn.Parameter(torch.tensor(1.5))
        self.param_rrefs.append(rpc.RRef(self.scale))

    def local_params(self) -> list[Tensor]:
        return [*(param for stage in self.local for param in stage.parameters()), self.local_scale]

    def remote_values(self) -> list[Tensor]:
        values = [value for stage in self.stages for value in rpc.rpc_sync(stage.owner(), _values, (stage,))]
        return [*values, self.scale.detach().clone()]

    def remote_loss(self, x: Tensor, y: Tensor, use: tuple[bool, ...]) -> Tensor:
        for stage, use_side in zip(self.stages, use, strict=False):  # a shorter `use` stops after fewer stages
            x = rpc.rpc_sync(stage.owner(), _forward, (stage, x, use_side))
        return _loss(x * self.scale, y)

    def local_loss(self, x: Tensor, y: Tensor, use: tuple[bool, ...]) -> Tensor:
        for stage, use_side in zip(self.local, use, strict=False):
            x = stage(x, use_side)
        return _loss(x * self.local_scale, y)

    def check_equal(self, what: str) -> list[Tensor]:
        """Assert that the split model equals the reference; return its parameters' values."""
        values = self.remote_values()
        for index, (remote, local) in enumerate(zip(values, self.local_params(), strict=True)):
            torch.testing.assert_close(remote, local.detach(), msg=lambda m, i=index: f"{what}, param {i}: {m}")
        return values


def _loss(output: Tensor, target: Tensor) -> Tensor:
    return ((output[:, : target.shape[1]] - target) ** 2).mean()  # the output of stage 1 alone has 3 columns


def _batches(count: int, seed: int = 123) -> list[tuple[Tensor, Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 4, generator=generator), torch.randn(5, 2, generator=generator)) for _ in range(count)]


def _distributed_step(
    model: _Model, optimizer: DistributedOptimizer, x: Tensor, y: Tensor, use: tuple[bool, ...]
) -> None:
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [model.remote_loss(x, y, use)])
        optimizer.step(context_id)


def _local_step(model: _Model, optimizer: torch.optim.Optimizer, x: Tensor, y: Tensor, use: tuple[bool, ...]) -> None:
    optimizer.zero_grad(set_to_none=True)
    model.local_loss(x, y, use).backward()
    optimizer.step()


# ------------------------------------------------------------------------------------------ running on the workers


def _on_workers(rank: int, world_size: int, scenario: Callable[[], None]) -> None:
    """Join the RPC group, run ``scenario`` in worker0 (the others serve RPCs), leave together."""
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
        num_worker_threads=8,
        rpc_timeout=30,
        _transports=["uv"],
    )
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size, rpc_backend_options=options)
    warnings.filterwarnings("error", category=DeprecationWarning)
    warnings.filterwarnings("error", category=FutureWarning)
    try:
        if rank == 0:
            scenario()
    finally:
        rpc.shutdown()


class _RegisteredOnly:
    """No optimizer at all: the owners can build it only through the class registered for it (on import, in every
    worker), as with torch's ``register_functional_optim``."""


register_functional_optim(_RegisteredOnly, FunctionalAdam)


PARITY_CASES: list[tuple[type, type[torch.optim.Optimizer], dict[str, Any]]] = [
    (torch.optim.SGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    (torch.optim.SGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.5, "nesterov": True, "maximize": True}),
    (torch.optim.Adam, torch.optim.Adam, {"lr": 0.05, "amsgrad": True}),
    (torch.optim.AdamW, torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
    (torch.optim.Adagrad, torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01}),
    (torch.optim.Adadelta, torch.optim.Adadelta, {"lr": 1.0, "rho": 0.8}),
    (torch.optim.Adamax, torch.optim.Adamax, {"lr": 0.05}),
    (torch.optim.RMSprop, torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
    (torch.optim.Rprop, torch.optim.Rprop, {"lr": 0.01}),
    (FunctionalAdam, torch.optim.Adam, {"lr": 0.05}),  # a functional class may be named directly
    (_RegisteredOnly, torch.optim.Adam, {"lr": 0.05}),  # a key registered with distoptim.utils
    (torch.optim.NAdam, torch.optim.NAdam, {"lr": 0.05}),  # no functional counterpart: the torch.optim fallback
    (torch.optim.ASGD, torch.optim.ASGD, {"lr": 0.05, "t0": 1.0}),  # likewise
]


def _parity_scenario() -> None:
    batches = _batches(len(SIDE_USE))
    for optimizer_class, reference_class, kwargs in PARITY_CASES:
        case = f"{optimizer_class.__name__}({kwargs})"
        model = _Model()
        distributed = DistributedOptimizer(optimizer_class, model.param_rrefs, **kwargs)
        reference = reference_class(model.local_params(), **kwargs)
        # torch's public attributes: one RRef per owner, and whether the owners run a functional optimizer
        owners = {rref.owner_name() for rref in model.param_rrefs}
        assert sorted(r.owner_name() for r in distributed.remote_optimizers) == sorted(owners)
        assert distributed.is_functional_optim == (reference_class not in (torch.optim.NAdam, torch.optim.ASGD))
        start = model.remote_values()
        before = start
        for step, ((x, y), use) in enumerate(zip(batches, SIDE_USE, strict=True)):
            _distributed_step(model, distributed, x, y, use)
            _local_step(model, reference, x, y, use)
            after = model.check_equal(f"{case} step {step}")
            # Stage 1's side (param 0) has no gradient in step 1: untouched, though it had one in step 0.
            if not use[0]:
                assert torch.equal(after[0], before[0]), f"{case} step {step}: stale gradient re-applied"
            assert torch.equal(after[3], start[3]), f"{case}: a parameter that never had a gradient moved"
            before = after


def test_every_optimizer_matches_local_training() -> None:
    run_on_ranks(_on_workers, WORLD_SIZE, _parity_scenario, backend=None, timeout=60)


# ------------------------------------------------------------------ contexts, errors and concurrent trainers


class _StepFailed(Exception):
    """Raised on an owner by _FailingSGD; the caller must get this very type back."""


class _FailingSGD(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:
        raise _StepFailed("step exploded on purpose")


class _OverlapDetectingSGD(torch.optim.SGD):
    """SGD whose step is slow enough for concurrent steps to overlap, and fails if two do."""

    _lock = threading.Lock()
    _active = 0

    def step(self, closure: Any = None) -> Any:
        cls = _OverlapDetectingSGD
        with cls._lock:
            cls._active += 1
            overlapped = cls._active > 1
        try:
            if overlapped:
                raise AssertionError("two steps ran at once on one owner")
            time.sleep(0.05)
            return super().step(closure)
        finally:
            with cls._lock:
                cls._active -= 1


def _contexts_scenario() -> None:
    batches = _batches(3)
    full, stage1_only = (True, False), (True,)

    # An owner that took no part in a context (stage 2 here) is left alone; so are its optimizer states.
    for optimizer_class in (torch.optim.Adam, torch.optim.NAdam):
        model = _Model()
        distributed = DistributedOptimizer(optimizer_class, model.param_rrefs, lr=0.05)
        reference = optimizer_class(model.local_params(), lr=0.05)
        before = model.remote_values()
        for step, ((x, y), use) in enumerate(zip(batches, (full, stage1_only, full), strict=True)):
            _distributed_step(model, distributed, x, y, use)
            _local_step(model, reference, x, y, use)
            after = model.check_equal(f"{optimizer_class.__name__} step {step}")
            if use is stage1_only:  # params 3-5: stage 2's
                assert all(torch.equal(a, b) for a, b in zip(after[3:6], before[3:6], strict=True))
            before = after

    # Bad input, found by the caller.
    model = _Model()
    optimizer = DistributedOptimizer(torch.optim.SGD, model.param_rrefs, lr=0.1)
    with pytest.raises(RuntimeError, match=r"unknown distributed autograd context id 987654321"):
        optimizer.step(987654321)
    with dist_autograd.context() as ended:
        pass
    with pytest.raises(RuntimeError, match=rf"unknown distributed autograd context id {ended}\b"):
        optimizer.step(ended)
    with pytest.raises(TypeError, match="context_id must be an int"):
        optimizer.step("0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty params_rref"):
        DistributedOptimizer(torch.optim.SGD, [], lr=0.1)
    with pytest.raises(TypeError, match="must hold RRefs"):
        DistributedOptimizer(torch.optim.SGD, model.local_params(), lr=0.1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="neither a torch.optim.Optimizer"):
        DistributedOptimizer(dict, model.param_rrefs)
    with pytest.raises(TypeError, match="LBFGS.step needs a closure"):
        DistributedOptimizer(torch.optim.LBFGS, model.param_rrefs)

    # Errors raised on an owner come back with their type and message; the remote traceback is the cause.
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'bogus'"):
        DistributedOptimizer(torch.optim.Adam, model.param_rrefs, bogus=1.0)  # functional constructor
    with pytest.raises(ValueError, match=r"^Invalid learning rate: -1.0$"):
        DistributedOptimizer(torch.optim.NAdam, model.param_rrefs, lr=-1.0)  # torch.optim constructor
    failing = DistributedOptimizer(_FailingSGD, model.param_rrefs, lr=0.1)
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [model.remote_loss(*batches[0], full)])
        with pytest.raises(_StepFailed, match=r"^step exploded on purpose$") as caught:
            failing.step(context_id)
    assert "on RPC worker worker" in str(caught.value.__cause__)
    assert 'raise _StepFailed("step exploded on purpose")' in str(caught.value.__cause__)

    # Steps of several trainers (threads here, each with its own DistributedOptimizer) are serialized per owner.
    start = model.remote_values()
    barrier = threading.Barrier(3)
    errors: list[BaseException] = []

    def trainer(seed: int) -> None:
        try:
            optimizer = DistributedOptimizer(_OverlapDetectingSGD, model.param_rrefs, lr=0.01)
            barrier.wait()
            for x, y in _batches(2, seed=seed):
                _distributed_step(model, optimizer, x, y, full)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=trainer, args=(seed,)) for seed in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors, errors
    assert not any(torch.equal(a, b) for a, b in zip(model.remote_values()[1:3], start[1:3], strict=True))


def test_contexts_errors_and_concurrent_trainers() -> None:
    run_on_ranks(_on_workers, WORLD_SIZE, _contexts_scenario, backend=None, timeout=60)


# ------------------------------------------------------------------------------- state dict and hyperparameters


def _assert_same_state(actual: dict[str, Any], expected: dict[str, Any], name: str) -> None:
    assert actual["state"].keys() == expected["state"].keys(), name
    for index, state in expected["state"].items():
        assert actual["state"][index].keys() == state.keys(), name
        for key, value in state.items():
            torch.testing.assert_close(actual["state"][index][key], value, msg=lambda m, k=key: f"{name} {k}: {m}")
    assert actual["param_groups"][0]["params"] == expected["param_groups"][0]["params"], name


def _state_scenario() -> None:
    batches = _batches(6)
    uses = [SIDE_USE[step % len(SIDE_USE)] for step in range(len(batches))]
    for optimizer_class in (torch.optim.Adam, torch.optim.NAdam):
        name = optimizer_class.__name__
        model = _Model()
        distributed = DistributedOptimizer(optimizer_class, model.param_rrefs, lr=0.05, weight_decay=0.01)
        reference = optimizer_class(model.local_params(), lr=0.05, weight_decay=0.01)
        for (x, y), use in zip(batches[:3], uses[:3], strict=True):
            _distributed_step(model, distributed, x, y, use)
            _local_step(model, reference, x, y, use)

        saved = distributed.state_dict()
        _assert_same_state(saved, reference.state_dict(), name)  # torch.optim's format, numbered as params_rref
        assert 3 not in saved["state"], name  # stage 2's side never had a gradient
        from_torch = DistributedOptimizer(optimizer_class, model.param_rrefs)
        from_torch.load_state_dict(reference.state_dict())  # torch.optim's own state dict loads as well
        _assert_same_state(from_torch.state_dict(), saved, f"{name} loaded from torch.optim")
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        buffer.seek(0)
        checkpoint = torch.load(buffer)

        del distributed
        resumed = DistributedOptimizer(optimizer_class, model.param_rrefs, lr=1.0)  # hyperparameters come from the load
        resumed.load_state_dict(checkpoint)
        assert resumed.param_groups[0]["lr"] == 0.05 and resumed.param_groups[0]["weight_decay"] == 0.01
        for step, ((x, y), use) in enumerate(zip(batches[3:], uses[3:], strict=True), start=3):
            _distributed_step(model, resumed, x, y, use)
            _local_step(model, reference, x, y, use)
            model.check_equal(f"{name} resumed, step {step}")

    # A learning-rate scheduler drives it like a torch.optim optimizer; a manual change reaches the owners too.
    for optimizer_class in (torch.optim.Adam, torch.optim.NAdam):
        name = optimizer_class.__name__
        model = _Model()
        distributed = DistributedOptimizer(optimizer_class, model.param_rrefs, lr=0.1)
        reference = optimizer_class(model.local_params(), lr=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
            schedulers = [
                torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) for opt in (distributed, reference)
            ]
            for step, ((x, y), use) in enumerate(zip(batches, uses, strict=True)):
                if step == 4:
                    for group in (distributed.param_groups[0], reference.param_groups[0]):
                        group["lr"], group["betas"] = 0.2, (0.5, 0.9)
                        group["extra"] = {"weights": torch.tensor([1.0, 2.0])}  # compared by value, not ==
                _distributed_step(model, distributed, x, y, use)
                _local_step(model, reference, x, y, use)
                model.check_equal(f"{name} with changing hyperparameters, step {step}")
                if step < 4:
                    for scheduler in schedulers:
                        scheduler.step()
        assert distributed.state_dict()["param_groups"][0]["lr"] == reference.param_groups[0]["lr"] == 0.2

    # An optimizer that keeps running values in its own group (schedule-free's k, Prodigy's d): the owners' values
    # evolve as the local optimizer's, not reset to the caller's copy at every step.
    model = _Model()
    distributed = DistributedOptimizer(_SelfDecayingSGD, model.param_rrefs, lr=0.5)
    reference = _SelfDecayingSGD(model.local_params(), lr=0.5)
    for step, ((x, y), use) in enumerate(zip(batches, uses, strict=True)):
        _distributed_step(model, distributed, x, y, use)
        _local_step(model, reference, x, y, use)
        model.check_equal(f"self-decaying SGD, step {step}")


class _SelfDecayingSGD(torch.optim.SGD):
    """SGD whose step halves its own group's lr (its schedule lives in the param group)."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = super().step(closure)
        for group in self.param_groups:
            group["lr"] *= 0.5
        return loss


def test_state_dict_round_trip_and_hyperparameter_changes() -> None:
    run_on_ranks(_on_workers, WORLD_SIZE, _state_scenario, backend=None, timeout=60)
