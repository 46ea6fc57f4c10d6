"""ShardedDataParallel's parameter sync against the user's hooks and the user's own reads and writes of parameters
(issue 32, items 2 and 7): the wrapper's landing hook runs before every forward pre-hook of the user's, whenever and
however it was registered; writes through ``model.module`` right after ``step()`` are refused on every rank at the
next step (they would be overwritten on the ranks that do not own the piece), and reads after the forward see the
step's values. Each against DDP + plain AdamW on the same seeds and data, greedy and even, overlap on and off."""

from __future__ import annotations

import itertools
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parametrize

from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer
from tests._dist import run_on_ranks
from tests.sharded_data_parallel.test_hard_cases import _compare, _step_both, _x

KW = {"lr": 0.05, "weight_decay": 0.1}
LAYOUTS = [("greedy", False), ("even", True)]  # (partition, parameters_as_bucket_view): staged and in-place buckets


def _sdp(model: nn.Module, partition: str, bucket_view: bool, overlap: bool) -> Any:
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, partition=partition, parameters_as_bucket_view=bucket_view, **KW
    )
    return zero, ShardedDataParallel(model, zero, bucket_cap_mb=0.0001, overlap_param_sync=overlap)


# ------------------------------------------------------------------------- item 2: hooks in a stated order
def _shift(module: nn.Module, args: Any) -> None:
    """A user's forward pre-hook reading parameters: the weight its module's forward uses is base + delta."""
    module.w = module.base + module.delta


class Shifted(nn.Module):
    def __init__(self, hooked: bool) -> None:
        super().__init__()
        self.base = nn.Parameter(torch.randn(6, 6) * 0.3)
        self.delta = nn.Parameter(torch.randn(6, 6) * 0.3)
        if hooked:
            self.register_forward_pre_hook(_shift)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.__dict__.pop("w", None)  # set by this forward's hook, if any
        return F.linear(x, self.base if w is None else w)


class Doubled(nn.Module):
    """A parametrization: the layer's weight, read through a property, is 2 * original + 0.1."""

    def forward(self, original: torch.Tensor) -> torch.Tensor:
        return 2 * original + 0.1


class Block(nn.Module):
    """Reads its child's (parametrized) weight outside the child's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(x)) + F.linear(x, self.inner.weight)


class Hooked(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(6, 6)
        self.shifted = Shifted(hooked=how == "pre_hook")
        self.block = Block()
        if how == "parametrize_before":
            parametrize.register_parametrization(self.block.inner, "weight", Doubled())
        self.last = nn.Linear(6, 6)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            if how == "weight_norm":  # its pre-hook computes last.weight from weight_g and weight_v
                self.last = nn.utils.weight_norm(self.last)
            if how == "spectral_norm":  # its pre-hook computes last.weight from weight_orig (and its buffers)
                self.last = nn.utils.spectral_norm(self.last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.shifted(torch.tanh(self.first(x))))
        return self.last(self.block(x))


_GLOBAL: list[Any] = []  # the handle of a module-global forward pre-hook, while one is registered


def _global_shift(module: nn.Module, args: Any) -> None:
    if isinstance(module, Shifted):
        _shift(module, args)


def _global_scale(module: nn.Module, args: Any) -> Any:
    """On the root model: its input scaled by a sum over every parameter (a hook that reads them all)."""
    if isinstance(module, Hooked):
        return (args[0] * (1 + 0.01 * sum(float(p.detach().sum()) for p in module.parameters())),)
    return None


def _hook_after(model: Hooked, how: str, wrapper: nn.Module) -> None:
    """What the user registers after wrapping (the same on the reference)."""
    if how == "prepend_after":
        model.shifted.register_forward_pre_hook(_shift, prepend=True)
    if how == "on_wrapper":
        wrapper.register_forward_pre_hook(lambda module, args, shifted=model.shifted: _shift(shifted, args))
    if how == "parametrize_after":
        parametrize.register_parametrization(model.block.inner, "weight", Doubled())


def _hook_in_flight(model: Hooked, how: str) -> None:
    if how == "prepend_in_flight":
        model.shifted.register_forward_pre_hook(_shift, prepend=True)
    elif not _GLOBAL:  # one module-global hook serves both models
        hook = _global_scale if how == "global_root_in_flight" else _global_shift
        _GLOBAL.append(register_module_forward_pre_hook(hook))


def _hook_order_body(rank: int, world_size: int, configs: list[tuple[Any, ...]]) -> None:
    for (partition, bucket_view), overlap, how in configs:
        label = f"{how} {partition} overlap={overlap}"
        if how == "global":
            _GLOBAL.append(register_module_forward_pre_hook(_global_shift))
        try:
            model, reference = Hooked(how), Hooked(how)
            if how == "parametrize_after":  # the reference is parametrized alike (before DDP: its buckets)
                _hook_after(reference, how, reference)
            ddp = DDP(reference, find_unused_parameters=True)  # Shifted's delta: read by the hooks only
            plain = torch.optim.AdamW(reference.parameters(), **KW)
            zero, sdp = _sdp(model, partition, bucket_view, overlap)
            _hook_after(model, how, sdp)
            if how in ("prepend_after", "on_wrapper"):
                _hook_after(reference, how, ddp)
            for step in range(3):
                _step_both(zero, sdp, plain, ddp, _x(rank, step), f"{label} step {step}")
                if step == 0 and how.endswith("in_flight"):  # registered while step 0's sync is in flight
                    _hook_in_flight(model, how)
                    _hook_in_flight(reference, how)
            sdp.sync_finished()
            _compare(model, reference, label)
        finally:
            while _GLOBAL:
                _GLOBAL.pop().remove()


HOWS = [
    "on_wrapper",
    "pre_hook",
    "prepend_after",
    "prepend_in_flight",
    "global",
    "global_in_flight",
    "global_root_in_flight",
    "weight_norm",
    "spectral_norm",
    "parametrize_before",
    "parametrize_after",
]


@pytest.mark.parametrize("how", HOWS)
def test_user_pre_hooks_run_after_the_landing_hook(how: str) -> None:
    """A pre-hook registered before wrapping, one registered after it with ``prepend=True`` (before a step, or while
    its sync is in flight), a module-global one (the same), one on the wrapper,
    the old ``weight_norm`` (a pre-hook; one rank raised in the backward while the other waited) and
    ``spectral_norm``, parametrizations
    registered before and after wrapping (read through a property in the parent's forward): every forward's loss is
    DDP's, overlapped or not."""
    run_on_ranks(_hook_order_body, 2, list(itertools.product(LAYOUTS, [True, False], [how])), timeout=60)


# ---------------------------------------------- item 7a: writes through model.module right after step()
class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _clip(params: Any, how: str, c: float = 0.3) -> None:
    """WGAN's weight clipping, the two ways users write it."""
    for p in params:
        if how == "data":
            p.data.clamp_(-c, c)
        else:
            with torch.no_grad():
                p.clamp_(-c, c)


def _outside_write_body(rank: int, world_size: int, configs: list[tuple[Any, ...]]) -> None:
    for (partition, bucket_view), overlap, how, order in configs:
        label = f"{how} {order} {partition} overlap={overlap}"
        model, reference = Critic(), Critic()
        ddp, plain = DDP(reference), torch.optim.AdamW(reference.parameters(), **KW)
        zero, sdp = _sdp(model, partition, bucket_view, overlap)
        refused = overlap and order == "inner_at_once"
        for step in range(3):
            if refused and step == 1:  # the clipping after step 0 was overwritten on the ranks not owning a piece
                zero.zero_grad()
                sdp(_x(rank, step)).square().mean().backward()
                with pytest.raises((RuntimeError, ValueError), match=r"sync_finished\(\) before writing"):
                    zero.step()
                break
            _step_both(zero, sdp, plain, ddp, _x(rank, step), f"{label} step {step}")
            if order == "synced_first":
                sdp.sync_finished()  # what the message says to do
            elif order == "parameters_called":
                sdp.parameters()  # the call alone waits for the sync (the guide says so), not its first item
            _clip(sdp.parameters() if order == "through_wrapper" else sdp.module.parameters(), how)
            _clip(reference.parameters(), how)
        else:
            sdp.sync_finished()
            _compare(model, reference, label)


def test_writes_through_the_inner_module_after_step_are_refused_on_every_rank() -> None:
    """WGAN's clipping through ``model.module`` right after ``step()`` (``p.data.clamp_`` and ``p.clamp_`` under
    no_grad): with the sync in flight every rank raises at the next step, saying what to do; after
    ``sync_finished()`` or ``model.parameters()``, through ``model.parameters()``, or without overlap, the training
    is DDP's."""
    configs = list(
        itertools.product(
            LAYOUTS, [True, False], ["data", "no_grad"], ["inner_at_once", "synced_first", "through_wrapper"]
        )
    )
    configs += [(layout, True, "no_grad", "parameters_called") for layout in LAYOUTS]
    run_on_ranks(_outside_write_body, 2, configs, timeout=120)


def test_a_write_through_data_leaves_the_version_counter_alone() -> None:
    """Why the in-flight write watch compares values (the owners' checksums) and not version counters (issue 45
    item 4): WGAN's ``p.data.clamp_`` above leaves ``p._version`` as it was, so a version watch would let that write
    be lost on the non-owners, silently. If torch ever counts it, the checksums can go."""
    param = nn.Parameter(torch.ones(3))
    before = param._version
    param.data.clamp_(-0.5, 0.5)
    assert param._version == before and param.max() == 0.5


def _after_last_step_body(rank: int, world_size: int, configs: list[tuple[Any, ...]]) -> list[tuple[str, str]]:
    """A write right after the last step, then the end of a program: the local wait, a collective one, a step."""
    outcomes = []
    for (partition, bucket_view), end in configs:
        model = Critic()
        unfreeze = end == "closure_step_unfrozen"
        model.layers[2].requires_grad_(not unfreeze)  # frozen, then made trainable while the sync is in flight
        zero, sdp = _sdp(model, partition, bucket_view, True)
        zero.zero_grad()
        sdp(_x(rank, 0)).square().mean().backward()
        zero.step()
        model.layers[2].requires_grad_(True)  # the next step places again: SDP's buckets change
        if end == "sync_finished":  # local: raised by the ranks owning a written element
            _clip(sdp.module.parameters(), "data", c=0.05)  # changes elements every rank owns: each one sees it
        else:  # collective: every rank raises, though one element, owned by one rank alone, changed
            next(sdp.module.parameters()).data.view(-1)[0] += 1.0
        try:
            if end == "sync_finished":
                sdp.sync_finished()
            elif end.startswith("closure_step"):  # the closure's backward reduces: a rank raising before it would hang
                # (unfrozen: over the same buckets on every rank, placed again first on the ranks raising too)

                def closure(zero: Any = zero, sdp: Any = sdp) -> torch.Tensor:
                    zero.zero_grad()
                    loss = sdp(_x(rank, 1)).square().mean()
                    loss.backward()
                    return loss

                zero.step(closure)
            else:
                zero.consolidate_state_dict(0)
            outcomes.append((end, "ran"))
        except (RuntimeError, ValueError) as error:
            outcomes.append((end, str(error)))
    return outcomes


def test_a_write_after_the_last_step_is_refused_where_the_program_ends() -> None:
    """No step follows to raise it: ``sync_finished()`` (local) raises on the ranks that own written
    elements, ``consolidate_state_dict`` (what a checkpoint runs) on every rank; a step with a closure (whose
    backward reduces) on every rank, after the closure ran (it hung: the owners raised before it), also after a layer
    was unfrozen (it hung: the owners ran the closure over the old buckets, the others placed again first; fuzz
    seed 763022)."""
    ends = ["sync_finished", "consolidate", "closure_step", "closure_step_unfrozen"]
    configs = list(itertools.product(LAYOUTS, ends))
    for outcomes in run_on_ranks(_after_last_step_body, 2, configs, timeout=120):
        for end, outcome in outcomes:
            assert "sync_finished() before writing" in outcome, (end, outcome)


def _write_then_add_group_body(rank: int, world_size: int, configs: list[tuple[Any, ...]]) -> list[str]:
    """A write through ``model.module`` right after a step, then ``add_param_group`` (a frozen layer unfrozen)."""
    outcomes = []
    for partition, bucket_view in configs:
        model = Critic()
        model.extra = nn.Linear(6, 6).requires_grad_(False)  # held by the model, trained once added
        zero = ZeroRedundancyOptimizer(
            model.layers.parameters(), torch.optim.AdamW, partition=partition, parameters_as_bucket_view=bucket_view
        )
        sdp = ShardedDataParallel(model, zero, bucket_cap_mb=0.0001, overlap_param_sync=True)
        zero.zero_grad()
        sdp(_x(rank, 0)).square().mean().backward()
        zero.step()
        _clip(sdp.module.layers.parameters(), "data", c=0.05)  # changes elements every rank owns
        model.extra.requires_grad_(True)
        try:
            zero.add_param_group({"params": list(model.extra.parameters())})
            outcomes.append("ran")
        except (RuntimeError, ValueError) as error:
            outcomes.append(str(error))
    return outcomes


def test_a_write_in_flight_then_add_param_group_is_refused_on_every_rank() -> None:
    """``add_param_group`` lands the sync before placing the new group: it lost the write on the ranks not owning
    it, silently (the ranks then held different values, and the next step no longer saw it: the fuzzer, issue 42,
    seed 96130); it refuses on every rank now, as the next step would."""
    for outcomes in run_on_ranks(_write_then_add_group_body, 2, LAYOUTS, timeout=120):
        assert all("sync_finished() before writing" in outcome for outcome in outcomes), outcomes


def _new_storage_body(rank: int, world_size: int, configs: list[tuple[Any, ...]]) -> list[str]:
    outcomes = []
    for (partition, bucket_view), how in configs:
        model = Critic()
        zero, sdp = _sdp(model, partition, bucket_view, True)
        zero.zero_grad()
        sdp(_x(rank, 0)).square().mean().backward()
        zero.step()
        layer = sdp.module.layers[1]  # the sync of the step is in flight: new storage for one layer's parameters
        if how == "to":
            layer.to(torch.float64).to(torch.float32)
        else:
            layer.weight.data = layer.weight.data.clone()
        try:
            sdp(_x(rank, 1)).square().mean().backward()
            outcomes.append("ran")
        except RuntimeError as error:
            outcomes.append(str(error))
    return outcomes


def test_parameters_given_new_storage_while_their_sync_is_in_flight_are_refused_on_every_rank() -> None:
    """``module.to()`` or ``param.data = ...`` through ``model.module`` right after ``step()`` with the sync in
    flight: it would land in the old storage (the non-owners keeping the values before the step, undetected by
    the owners' checksums); every rank raises at the landing instead."""
    configs = list(itertools.product(LAYOUTS, ["to", "data"]))
    for outcomes in run_on_ranks(_new_storage_body, 2, configs, timeout=120):
        assert all("given new storage" in outcome for outcome in outcomes), outcomes


def _new_storage_at_the_old_address_body(rank: int, world_size: int) -> str:
    model = Critic()
    zero, sdp = _sdp(model, "greedy", False, True)
    zero.zero_grad()
    sdp(_x(rank, 0)).square().mean().backward()
    zero.step()
    for p in sdp.module.layers[1].parameters():  # new storage while the sync is in flight, on every rank
        if rank == 0:
            p.data = p.data.clone()
        else:  # where the allocator reused the freed block: new storage at the old address (fuzzer seed 60222)
            p.data = torch.from_numpy(p.data.numpy())
    try:
        sdp(_x(rank, 1))  # the forward only: a rank that does not raise reaches no collective
        return "ran"
    except RuntimeError as error:
        return str(error)


def test_new_storage_at_the_old_address_is_refused_on_every_rank() -> None:
    """The in-flight check compared data pointers only: a rank whose allocator gave the new storage the freed
    block's address went on while the others raised, and waited in the backward's reductions (the fuzzer's seed
    60222 hung in 3 runs of 7). It holds the launched storages and compares their identity now."""
    outcomes = run_on_ranks(_new_storage_at_the_old_address_body, 2, timeout=60)
    assert all("given new storage" in outcome for outcome in outcomes), outcomes


# ------------------------------------------ item 7b: reads after the forward of parameters it did not read
class Regularized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.side = nn.Linear(6, 6)  # run on odd steps only
        self.extra = nn.Module()  # holds a parameter and is never called
        self.extra.scale = nn.Parameter(torch.full((6,), 0.5))

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x + self.side(x) if step % 2 else x


def _regularized_loss(net: nn.Module, inner: Regularized, x: torch.Tensor, step: int) -> torch.Tensor:
    out = net(x, step)
    decay = sum(p.square().sum() for p in inner.parameters())  # every parameter, whether the forward ran it or not
    return (inner.extra.scale * out).square().mean() + 0.01 * decay


def _stale_read_body(rank: int, world_size: int, configs: list[tuple[Any, ...]]) -> None:
    for (partition, bucket_view), overlap in configs:
        label = f"{partition} overlap={overlap}"
        model, reference = Regularized(), Regularized()
        ddp, plain = DDP(reference), torch.optim.AdamW(reference.parameters(), **KW)
        zero, sdp = _sdp(model, partition, bucket_view, overlap)
        for step in range(4):
            zero.zero_grad()
            loss = _regularized_loss(sdp, model, _x(rank, step), step)
            loss.backward()
            zero.step()
            plain.zero_grad()
            want = _regularized_loss(ddp, reference, _x(rank, step), step)
            want.backward()
            plain.step()
            torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-7, msg=lambda m, x=f"{label} {step}": f"{x}: {m}")
        sdp.sync_finished()
        _compare(model, reference, label)


def test_reads_after_the_forward_see_the_step() -> None:
    """A weight-decay term over ``model.module.parameters()`` (a branch the forward did not run among them) and a
    parameter of a never-called holder read directly in the loss: the loss and the training are DDP's."""
    run_on_ranks(_stale_read_body, 2, list(itertools.product(LAYOUTS, [True, False])), timeout=120)


def _read_before_forward_body(rank: int, world_size: int, configs: list[tuple[Any, ...]]) -> None:
    for (partition, bucket_view), overlap in configs:
        label = f"{partition} overlap={overlap}"
        model, reference = Regularized(), Regularized()  # the reference: plain AdamW on the averaged gradients
        plain = torch.optim.AdamW(reference.parameters(), **KW)
        zero, sdp = _sdp(model, partition, bucket_view, overlap)
        for step in range(3):
            zero.zero_grad()
            decay = sum(p.square().sum() for p in model.parameters() if p is not model.extra.scale)
            loss = sdp(_x(rank, step), step).square().mean() + 0.01 * decay
            if overlap and step == 1:  # read before the forward, the sync in flight: every rank raises, none waits
                with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                    loss.backward()
                break
            loss.backward()
            zero.step()
            plain.zero_grad()
            decay = sum(p.square().sum() for p in reference.parameters() if p is not reference.extra.scale)
            (reference(_x(rank, step), step).square().mean() + 0.01 * decay).backward()
            for p in reference.parameters():  # extra.scale has none on any rank
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad.div_(world_size)
            plain.step()
        else:
            sdp.sync_finished()
            _compare(model, reference, label)


def test_a_read_before_the_forward_raises_on_every_rank() -> None:
    """A weight-decay term over ``model.module.parameters()`` computed before ``model(x)``, right after a step: the
    values before the step on the ranks not owning them. Autograd saved them, so the backward raises torch's "modified
    by an inplace operation" on every rank (it raised on the non-owners only, the owner waiting in a reduction);
    without overlap the training is DDP's."""
    run_on_ranks(_read_before_forward_body, 2, list(itertools.product(LAYOUTS, [True, False])), timeout=60)
