"""overlap_with_ddp: ZeRO stepped by DDP comm hooks equals DDP + the same optimizer stepping normally, from the first
backward (``step_from_first_backward=True``; torch's warm-up, the default, is tested in test_overlap_warmup.py)."""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import StepLR

from distoptim import ZeroRedundancyOptimizer
from distoptim.functional import FunctionalAdamW
from distoptim.hooks import allreduce_hook, hook_with_zero_step, hook_with_zero_step_interleaved
from tests._dist import cuda_world_size, run_on_ranks
from tests._reference import assert_same_tensors

OPTIMIZERS = [(torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}), (torch.optim.AdamW, {"lr": 0.01})]
HOOKS = [hook_with_zero_step, hook_with_zero_step_interleaved]
ITERATIONS = 10


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _groups(model: nn.Module, lr: float) -> list[dict[str, Any]]:
    params = list(model.parameters())
    return [{"params": params[:2]}, {"params": params[2:], "lr": lr / 2}]


def _batch(rank: int, iteration: int, device: torch.device | None = None) -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(1000 * iteration + rank)).to(device)


def _ddp(model: nn.Module, gradient_as_bucket_view: bool, static_graph: bool) -> DDP:
    # A tiny bucket cap: several buckets once DDP rebuilds them after the first iteration (one bucket before).
    return DDP(model, bucket_cap_mb=0.0005, gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph)


def _train(
    ddp: DDP, optimizer: Any, scheduler: StepLR, rank: int, iterations: range, step: bool, set_to_none: bool = True
) -> None:
    device = next(ddp.parameters()).device
    for iteration in iterations:
        optimizer.zero_grad(set_to_none=set_to_none)
        ddp(_batch(rank, iteration, device)).square().mean().backward()
        if step:
            optimizer.step()
        scheduler.step()


def _assert_close(model: nn.Module, reference: nn.Module, what: str) -> None:
    for index, (param, expected) in enumerate(zip(model.parameters(), reference.parameters())):
        torch.testing.assert_close(param, expected, rtol=1e-5, atol=1e-6, msg=lambda m, i=index: f"{what}[{i}]: {m}")


def _parity_body(rank: int, world_size: int, configs: list[tuple[Any, ...]], device_type: str = "cpu") -> None:
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    for hook, (optimizer_class, kwargs), gradient_as_bucket_view, static_graph, shard_buckets in configs:
        what = f"{hook.__name__} {optimizer_class.__name__} gav={gradient_as_bucket_view} static={static_graph}"
        model, reference = _model().to(device), _model().to(device)
        ddp = _ddp(model, gradient_as_bucket_view, static_graph)
        reference_ddp = _ddp(reference, gradient_as_bucket_view, static_graph)
        zero = ZeroRedundancyOptimizer(_groups(model, kwargs["lr"]), optimizer_class, overlap_with_ddp=True, **kwargs)
        hooked = hook(allreduce_hook, ddp, zero, shard_buckets=shard_buckets, step_from_first_backward=True)
        ddp.register_comm_hook(None, hooked)
        reference_optimizer = optimizer_class(_groups(reference, kwargs["lr"]), **kwargs)
        schedulers = StepLR(zero, step_size=3, gamma=0.5), StepLR(reference_optimizer, step_size=3, gamma=0.5)
        for iteration in range(ITERATIONS):
            _train(ddp, zero, schedulers[0], rank, range(iteration, iteration + 1), step=False)
            _train(reference_ddp, reference_optimizer, schedulers[1], rank, range(iteration, iteration + 1), True)
            _assert_close(model, reference, f"{what} iteration {iteration}")


CONFIGS = list(itertools.product(HOOKS, OPTIMIZERS, [False, True], [False, True], [False, True]))


def test_parity_world_size_2_every_combination() -> None:
    run_on_ranks(_parity_body, 2, CONFIGS, timeout=240)


def test_parity_world_size_3() -> None:
    covering = [c for i, c in enumerate(CONFIGS) if i % 4 in (0, 3)]  # each hook x optimizer, all flag values
    run_on_ranks(_parity_body, 3, covering, timeout=240)


@pytest.mark.skipif(cuda_world_size() < 2, reason="needs 2 CUDA devices")
def test_parity_on_nccl() -> None:
    covering = [c for i, c in enumerate(CONFIGS) if i % 4 in (0, 3)]
    run_on_ranks(_parity_body, 2, covering, "cuda", backend="nccl", timeout=240)


def _checkpoint_body(rank: int, world_size: int, saved: dict[str, Any] | None) -> dict[str, Any] | None:
    """Train with overlap, consolidate, and (given a checkpoint) resume from it: equal to plain DDP + AdamW."""
    model, reference = _model(), _model()
    ddp, reference_ddp = _ddp(model, False, False), _ddp(reference, False, False)
    zero = ZeroRedundancyOptimizer(model.parameters(), FunctionalAdamW, overlap_with_ddp=True, lr=0.01)
    ddp.register_comm_hook(
        None, hook_with_zero_step_interleaved(allreduce_hook, ddp, zero, step_from_first_backward=True)
    )
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    schedulers = StepLR(zero, step_size=100), StepLR(reference_optimizer, step_size=100)
    if saved is not None:
        with torch.no_grad():
            for param, other, value in zip(model.parameters(), reference.parameters(), saved["params"]):
                param.copy_(value)
                other.copy_(value)
        zero.load_state_dict(saved["optimizer"])
        reference_optimizer.load_state_dict(saved["optimizer"])
    first = 0 if saved is None else 4
    _train(ddp, zero, schedulers[0], rank, range(first, first + 4), step=False)
    _train(reference_ddp, reference_optimizer, schedulers[1], rank, range(first, first + 4), step=True)
    _assert_close(model, reference, "after resuming" if saved else "before saving")
    zero.consolidate_state_dict(to=0)
    if rank != 0:
        return None
    state = zero.state_dict()
    expected = reference_optimizer.state_dict()
    assert state["param_groups"] == expected["param_groups"]
    for index, entry in expected["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(state["state"][index][key], value, rtol=1e-5, atol=1e-6)
    return {"optimizer": state, "params": [p.detach().clone() for p in model.parameters()]}


def test_state_dict_after_training_and_resume_at_another_world_size() -> None:
    saved = run_on_ranks(_checkpoint_body, 3, None)[0]
    run_on_ranks(_checkpoint_body, 2, saved)


def _stale_consolidation_body(rank: int, world_size: int, hook: Any) -> None:
    """Steps the hook takes after consolidate_state_dict() make the consolidated state stale, as step()'s do."""
    model = _model()
    ddp = _ddp(model, False, False)
    zero = ZeroRedundancyOptimizer(model.parameters(), FunctionalAdamW, overlap_with_ddp=True, lr=0.01)
    ddp.register_comm_hook(None, hook(allreduce_hook, ddp, zero, step_from_first_backward=True))
    scheduler = StepLR(zero, step_size=100)
    _train(ddp, zero, scheduler, rank, range(2), step=False)
    zero.consolidate_state_dict(to=0)
    _train(ddp, zero, scheduler, rank, range(2, 4), step=False)
    if rank == 0:
        with pytest.raises(RuntimeError, match="consolidate after the last step"):
            zero.state_dict()
    zero.consolidate_state_dict(to=0)
    if rank == 0:
        assert all(float(entry["step"]) == 4 for entry in zero.state_dict()["state"].values())


@pytest.mark.parametrize("hook", HOOKS)
def test_a_hooks_step_makes_the_consolidated_state_stale(hook: Any) -> None:
    run_on_ranks(_stale_consolidation_body, 2, hook)


def _errors_body(rank: int, world_size: int) -> None:
    model = _model()
    ddp = DDP(model)
    plain = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="built with overlap_with_ddp=True"):
        hook_with_zero_step(allreduce_hook, ddp, plain)
    with pytest.raises(ValueError, match="Adafactor has none"):
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adafactor, overlap_with_ddp=True)

    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    with pytest.raises(RuntimeError, match="no overlap hook is registered"):
        zero.step()
    ddp(_batch(rank, 0)).sum().backward()  # no hook registered: nothing stepped the optimizer
    with pytest.raises(RuntimeError, match="no overlap hook is registered"):
        zero.step()
    with pytest.raises(RuntimeError, match="no optimizer step ran: register hook_with_zero_step"):
        zero.zero_grad()

    hooked = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    hook_with_zero_step(allreduce_hook, ddp, hooked)
    with pytest.raises(RuntimeError, match="has not stepped since the last step"):
        hooked.step()  # a hook exists, but no backward ran it
    with pytest.raises(ValueError, match="already registered"):
        hook_with_zero_step_interleaved(allreduce_hook, ddp, hooked)

    # A hook over parameters the other side does not have: a head ZeRO does not hold, a parameter DDP never reduces.
    for hook in HOOKS:
        without_head = ZeroRedundancyOptimizer(model[:3].parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
        with pytest.raises(ValueError, match=r"does not hold: '4\.weight', '4\.bias'.*wrap only the part"):
            hook(allreduce_hook, ddp, without_head)
        extra = nn.Parameter(torch.zeros(3, 2))
        with_extra = ZeroRedundancyOptimizer(
            [*model.parameters(), extra], torch.optim.SGD, overlap_with_ddp=True, lr=0.1
        )
        with pytest.raises(ValueError, match=r"not in the DDP model: param_groups\[0\]\['params'\]\[6\] \(3, 2\)"):
            hook(allreduce_hook, ddp, with_extra)
    dist.barrier()


def test_misuse_gives_clear_errors() -> None:
    run_on_ranks(_errors_body, 2)


def _join_body(rank: int, world_size: int, hook: Any) -> list[torch.Tensor]:
    """Uneven inputs under Join. A joined rank's DDP join hook runs our comm hook on zero buckets, so its shard
    is still stepped with the DDP average (joined ranks contributing zeros): every parameter follows it."""
    model, reference = _model(), _model()
    ddp = _ddp(model, False, False)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.05, momentum=0.9)
    ddp.register_comm_hook(None, hook(allreduce_hook, ddp, zero, step_from_first_backward=True))
    batches = [3 + 2 * r for r in range(world_size)]
    with Join([ddp, zero]):
        for iteration in range(batches[rank]):
            zero.zero_grad()
            ddp(_batch(rank, iteration)).square().mean().backward()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for iteration in range(max(batches)):
        reference_optimizer.zero_grad()
        for r in range(world_size):
            if iteration < batches[r]:
                reference(_batch(r, iteration)).square().mean().backward()
        for param in reference.parameters():
            param.grad = param.grad / world_size
        reference_optimizer.step()
    _assert_close(model, reference, f"{hook.__name__} under Join")
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("hook", HOOKS)
def test_uneven_inputs_under_join(hook: Any) -> None:
    results = run_on_ranks(_join_body, 3, hook)
    for other in results[1:]:
        for param, expected in zip(other, results[0]):
            assert torch.equal(param, expected)


def _frozen_after_ddp_body(rank: int, world_size: int, hook: Any, set_to_none: bool) -> None:
    """A parameter frozen after DDP was built keeps its slot in DDP's buckets: the others' gradients must not shift;
    frozen mid-training with its .grad kept (zeros), torch.optim keeps stepping it (AdamW's moments move it)."""
    model, reference = _model(), _model()
    ddp = DDP(model, find_unused_parameters=True)
    reference_ddp = DDP(reference, find_unused_parameters=True)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, overlap_with_ddp=True, lr=0.01)
    ddp.register_comm_hook(None, hook(allreduce_hook, ddp, zero, step_from_first_backward=True))
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    schedulers = StepLR(zero, step_size=100), StepLR(reference_optimizer, step_size=100)
    for iterations, freeze in ((range(2), False), (range(2, 5), True)):
        for frozen in (model[2].weight, reference[2].weight):
            frozen.requires_grad_(not freeze)
        _train(ddp, zero, schedulers[0], rank, iterations, step=False, set_to_none=set_to_none)
        _train(reference_ddp, reference_optimizer, schedulers[1], rank, iterations, True, set_to_none)
        _assert_close(model, reference, f"{hook.__name__} with a parameter frozen after DDP, {freeze=}")


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("hook", HOOKS)
def test_parameter_frozen_after_ddp_was_built(hook: Any, set_to_none: bool) -> None:
    run_on_ranks(_frozen_after_ddp_body, 2, hook, set_to_none)


def _frozen_with_grad_body(rank: int, world_size: int, hook: Any) -> None:
    """Frozen when ZeRO is built (no owner) but holding a .grad: torch.optim would step it; refused, as step() does."""
    model = _model()
    ddp = DDP(model, find_unused_parameters=True)
    model[2].weight.requires_grad_(False)
    model[2].weight.grad = torch.zeros_like(model[2].weight)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, overlap_with_ddp=True, weight_decay=0.5)
    ddp.register_comm_hook(None, hook(allreduce_hook, ddp, zero, step_from_first_backward=True))
    with pytest.raises(RuntimeError, match="requires_grad=False has a gradient"):
        ddp(_batch(rank, 0)).square().mean().backward()


@pytest.mark.parametrize("hook", HOOKS)
def test_unowned_frozen_parameter_with_a_grad_is_refused(hook: Any) -> None:
    run_on_ranks(_frozen_with_grad_body, 2, hook)


# ------------------------------------------------------------ layouts, unused and zero-sized parameters, bitwise
class _Strided(nn.Module):
    """Gradients DDP does not lay out row-major: a channels_last convolution and a transposed Linear weight (bucket
    views keep their strides), and a non-dense channels_last slice (DDP falls back to a row-major view for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.to(memory_format=torch.channels_last)
        sliced = torch.randn(2, 3, 3, 6).to(memory_format=torch.channels_last)[..., ::2]
        self.sliced = nn.Parameter(sliced)  # set after .to(): that would make it dense again
        self.fc = nn.Linear(24, 6)
        self.fc.weight = nn.Parameter(self.fc.weight.detach().t().contiguous().t())

    def forward(self, x: torch.Tensor, iteration: int, rank: int) -> torch.Tensor:
        image = x.repeat(1, 6).view(-1, 3, 4, 4).contiguous(memory_format=torch.channels_last)
        features = torch.cat([self.conv(image), nn.functional.conv2d(image, self.sliced)], dim=1)
        return self.fc(torch.tanh(features).flatten(1))


class _Branches(nn.Module):
    """Parameters without a gradient: a module never used; with ``dynamic``, one used on odd iterations only and
    one used on rank 0 only (locally unused on the others, globally used)."""

    def __init__(self, dynamic: bool) -> None:
        super().__init__()
        self.dynamic = dynamic
        self.trunk, self.never, self.odd, self.rank0 = (nn.Linear(8 if i == 0 else 16, 16) for i in range(4))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, iteration: int, rank: int) -> torch.Tensor:
        hidden = torch.tanh(self.trunk(x))
        if self.dynamic and iteration % 2 == 1:
            hidden = torch.tanh(self.odd(hidden))
        if self.dynamic and rank == 0:
            hidden = hidden + self.rank0(hidden)
        return self.head(hidden)


class _WithEmpty(nn.Module):
    """Zero-sized parameters first, in the middle (a Linear(0, n) placeholder) and last (a Linear(0, 0))."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Parameter(torch.empty(0))
        self.layer = nn.Linear(8, 16)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Initializing zero-element tensors is a no-op"
            self.placeholder = nn.Linear(0, 16)
            self.head = nn.Linear(16, 4)
            self.last = nn.Linear(0, 0)

    def forward(self, x: torch.Tensor, iteration: int, rank: int) -> torch.Tensor:
        nothing = x[:, :0]
        hidden = torch.tanh(self.layer(x) + self.placeholder(nothing))
        return self.head(hidden) + self.first.sum() + self.last(nothing).sum()


MODELS: dict[str, Callable[[], nn.Module]] = {
    "strided": _Strided,
    "unused-dynamic": lambda: _Branches(dynamic=True),
    "unused-static": lambda: _Branches(dynamic=False),
    "empty": _WithEmpty,
}
ADAMW_DECAY = (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1})
SGD_MOMENTUM = (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01})
# (model, DDP options, optimizer) for each hook and gradient_as_bucket_view
SPECIAL = [
    ("strided", {}, ADAMW_DECAY),
    ("strided", {"static_graph": True}, SGD_MOMENTUM),
    ("unused-dynamic", {"find_unused_parameters": True}, ADAMW_DECAY),
    ("unused-static", {"static_graph": True}, ADAMW_DECAY),
    ("unused-static", {"find_unused_parameters": True}, SGD_MOMENTUM),
    ("empty", {}, ADAMW_DECAY),
    ("empty", {"find_unused_parameters": True}, SGD_MOMENTUM),
]


def _special_parity_body(rank: int, world_size: int, configs: list[tuple[Any, ...]]) -> None:
    """Each model trained by each hook equals DDP + the plain optimizer, bit for bit: the same torch.optim kernel
    runs on the same gradients (at world size 2, DDP's x * (1/2) and the hook's x / 2 are the same numbers)."""
    for hook, (name, options, (optimizer_class, kwargs)), gradient_as_bucket_view in configs:
        what = f"{hook.__name__} {name} {options} {optimizer_class.__name__} gav={gradient_as_bucket_view}"
        torch.manual_seed(0)
        model = MODELS[name]()
        torch.manual_seed(0)
        reference = MODELS[name]()
        ddp, reference_ddp = (
            DDP(m, bucket_cap_mb=0.0005, gradient_as_bucket_view=gradient_as_bucket_view, **options)
            for m in (model, reference)
        )
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class, overlap_with_ddp=True, **kwargs)
        ddp.register_comm_hook(None, hook(allreduce_hook, ddp, zero, step_from_first_backward=True))
        reference_optimizer = optimizer_class(reference.parameters(), **kwargs)
        for iteration in range(4):
            for net, optimizer in ((ddp, zero), (reference_ddp, reference_optimizer)):
                optimizer.zero_grad()
                net(_batch(rank, iteration), iteration, rank).square().mean().backward()
            reference_optimizer.step()
            assert_same_tensors(list(model.parameters()), list(reference.parameters()), f"{what} it. {iteration}")


def test_strided_unused_and_zero_sized_parameters_match_ddp_bitwise() -> None:
    run_on_ranks(_special_parity_body, 2, list(itertools.product(HOOKS, SPECIAL, [False, True])), timeout=240)


# ------------------------------------------------------------------------ explicit step() and LR schedulers
def _forward_backward(zero: ZeroRedundancyOptimizer, ddp: DDP, rank: int, iteration: int) -> torch.Tensor:
    zero.zero_grad()
    loss = ddp(_batch(rank, iteration)).square().mean()
    loss.backward()
    return loss


def _explicit_step_body(rank: int, world_size: int) -> None:
    """A torch loop that still calls ``zero.step()`` (or ``step(closure)``) after backward equals the reference, and
    no scheduler warns that ``lr_scheduler.step()`` came before ``optimizer.step()``."""
    for hook, how in itertools.product(HOOKS, ["hook only", "step()", "step(closure)"]):
        model, reference = _model(), _model()
        ddp, reference_ddp = _ddp(model, False, False), _ddp(reference, False, False)
        zero = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.05, momentum=0.9
        )
        ddp.register_comm_hook(None, hook(allreduce_hook, ddp, zero, step_from_first_backward=True))
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            scheduler = StepLR(zero, step_size=2, gamma=0.5)
            for iteration in range(4):
                closure = functools.partial(_forward_backward, zero, ddp, rank, iteration)
                if how == "step(closure)":
                    assert zero.step(closure) is not None
                else:
                    closure()
                    if how == "step()":
                        assert zero.step() is None
                scheduler.step()
        _train(
            reference_ddp,
            reference_optimizer,
            StepLR(reference_optimizer, step_size=2, gamma=0.5),
            rank,
            range(4),
            True,
        )
        assert_same_tensors(list(model.parameters()), list(reference.parameters()), f"{hook.__name__} {how}")
        assert zero.param_groups[0]["lr"] == reference_optimizer.param_groups[0]["lr"] == 0.0125
        if how != "hook only":
            with pytest.raises(RuntimeError, match="has not stepped since the last step"):
                zero.step()  # the hook's last step was confirmed already


def test_explicit_step_after_backward_and_schedulers() -> None:
    run_on_ranks(_explicit_step_body, 2)


def _raising_hook_body(rank: int, world_size: int, interleaved: bool) -> str:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    ddp, params = DDP(model), list(model.parameters())
    zero = ZeroRedundancyOptimizer(
        [{"params": params[:2]}, {"params": params[2:]}], torch.optim.AdamW, overlap_with_ddp=True, lr=0.1
    )
    hook = hook_with_zero_step_interleaved if interleaved else hook_with_zero_step
    ddp.register_comm_hook(None, hook(allreduce_hook, ddp, zero, step_from_first_backward=True))
    ddp(torch.randn(4, 6)).square().mean().backward()
    assert not zero.local_shard.unsynced, "the hook's sync landed"
    zero.param_groups[1]["betas"] = (0.9,)  # on every rank: group 1's functional step raises after group 0's ran
    with pytest.raises(Exception, match="unpack"):
        ddp(torch.randn(4, 6)).square().mean().backward()
    zero.param_groups[1]["betas"] = (0.9, 0.999)
    with pytest.raises(RuntimeError, match="began to step its shard"):
        zero.consolidate_state_dict(to=0)
    return "refused"


def test_a_hook_step_that_raised_refuses_a_consolidation_on_every_rank() -> None:
    """Review r-22: the overlap hooks stepped the shard without the mark, so a consolidation (or a sharded save)
    after a hook step raised midway held state apart from the ranks' parameters."""
    assert run_on_ranks(_raising_hook_body, 2, False) == ["refused"] * 2
