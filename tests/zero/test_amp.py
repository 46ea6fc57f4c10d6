"""Loss scaling: ``torch.amp.GradScaler`` drives ZeRO (fp32 model, or fp16 model with fp32 master weights) with the
usual loop, with gradients all-reduced or reduced to their owners; an inf on one rank skips the step on every rank
and the scales stay equal; the result equals a reference that does the same by hand on DDP's averaged gradients."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer
from distoptim.comm.collectives import all_gather_objects
from distoptim.hooks import hook_with_zero_step, reduce_to_owners_hook
from tests._dist import run_on_ranks
from tests.zero._hooks import register

ITERATIONS = 4
INF_AT = 1  # the iteration at which rank 1 alone produces an inf
KWARGS = {"lr": 0.01, "weight_decay": 0.1}


class _Net(nn.Sequential):
    """Three layers, and with ``unused`` two more that no rank ever uses: one before them, one after (DDP lays the
    parameters into its buckets in reverse, so one of them sits at the start of a bucket, wherever it is)."""

    def __init__(self, dtype: torch.dtype, unused: bool = False) -> None:
        torch.manual_seed(0)
        layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)]
        super().__init__(*([nn.Linear(3, 3)] if unused else []), *layers, *([nn.Linear(3, 3)] if unused else []))
        self.skipped = {0, len(self) - 1} if unused else set()
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self):
            x = x if index in self.skipped else layer(x)
        return x


def _net(dtype: torch.dtype, unused: bool = False) -> nn.Module:
    return _Net(dtype, unused)


def _ddp(model: nn.Module, ddp_mode: str) -> DDP:
    return DDP(
        model,
        bucket_cap_mb=0.0005,
        find_unused_parameters=ddp_mode == "find_unused",
        static_graph=ddp_mode == "static_graph",
    )


def _loss(ddp: DDP, rank: int, iteration: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(100 * iteration + rank)).to(dtype)
    return ddp(x).float().square().mean()


def _poison(at: int) -> Any:
    def poison(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[at] = float("inf")
        return grad

    return poison


class _ByHand:
    """The reference: DDP's averaged gradients, upcast to fp32, checked for inf/nan, unscaled, clipped, and AdamW on
    fp32 copies of the parameters (the parameters themselves when they are fp32)."""

    def __init__(self, model: nn.Module) -> None:
        self.params = list(model.parameters())
        self.stepped = [p.detach().float().requires_grad_() if p.dtype != torch.float32 else p for p in self.params]
        self.optimizer = torch.optim.AdamW(self.stepped, **KWARGS)
        self.scale, self.growth = 1024.0, 0

    def step(self, clip: float | None) -> None:
        grads = [None if p.grad is None else p.grad.float() * torch.tensor(1 / self.scale) for p in self.params]
        finite = all(bool(g.isfinite().all()) for g in grads if g is not None)
        if finite:
            if clip is not None:
                present = [g for g in grads if g is not None]
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in present]))
                coefficient = torch.clamp(clip / (norm + 1e-6), max=1.0)
                grads = [None if g is None else g * coefficient for g in grads]
            for stepped, grad in zip(self.stepped, grads):
                stepped.grad = grad
            self.optimizer.step()
            with torch.no_grad():
                for param, stepped in zip(self.params, self.stepped):
                    if stepped is not param:
                        param.copy_(stepped)
        self.scale = self.scale * 2 if finite and self.growth + 1 == 2 else self.scale if finite else self.scale / 2
        self.growth = 0 if not finite or self.growth + 1 == 2 else self.growth + 1


def _body(rank: int, world_size: int, ddp_mode: str) -> None:
    configs = itertools.product(["greedy", "even"], ["all_reduce", "to_owners"], [torch.float32, torch.float16])
    for (partition, reduction, dtype), clip in itertools.product(configs, [None, 0.05]):
        what = f"{partition} {reduction} {dtype} clip={clip} {ddp_mode}"
        unused = ddp_mode != "all_used"
        model, reference = _net(dtype, unused), _net(dtype, unused)
        ddp, reference_ddp = _ddp(model, ddp_mode), _ddp(reference, ddp_mode)
        master = torch.float32 if dtype != torch.float32 else None
        zero = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.AdamW, partition=partition, master_dtype=master, **KWARGS
        )
        register(ddp, zero, reduction, "explicit")
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
        by_hand = _ByHand(reference)
        # an element of a parameter some rank uses, which rank 1 owns
        params = list(model.parameters())
        used = {id(p) for index, layer in enumerate(model) if index not in model.skipped for p in layer.parameters()}
        target, at = next(
            (i, fragment.offset)
            for i, p in enumerate(params)
            if id(p) in used
            for fragment in zero.fragments_of(p)
            if fragment.rank == 1
        )
        for iteration in range(ITERATIONS):
            # at INF_AT rank 0's gradient of a parameter that rank 1 owns gets one inf: only its owner sums it
            poisoned = (
                [list(m.parameters())[target] for m in (model, reference)] if (iteration, rank) == (INF_AT, 0) else []
            )
            handles = [param.register_hook(_poison(at)) for param in poisoned]
            zero.zero_grad()
            scaler.scale(_loss(ddp, rank, iteration, dtype)).backward()
            if clip is not None and dtype == torch.float32:
                scaler.unscale_(zero)  # torch's way: unscale, then clip the unscaled gradient
                zero.clip_grad_norm_(clip)
            elif clip is not None:
                zero.clip_grad_norm_(clip, grad_scale=scaler.get_scale())  # fp16 gradients: unscale_ refuses them
            scaler.step(zero)
            scaler.update()

            reference.zero_grad()
            (_loss(reference_ddp, rank, iteration, dtype) * by_hand.scale).backward()
            by_hand.step(clip)
            for handle in handles:
                handle.remove()
            scales = all_gather_objects(scaler.get_scale(), dist.group.WORLD)
            assert scales == [by_hand.scale] * world_size, f"{what} iteration {iteration}: scales {scales}"
            # Bitwise where the arithmetic is the same; reduced to owners, the ranks' shares add in another order
            # than its all-reduce (an ulp; a few in fp16); the fp16 clip scales fp16 gradients, the reference fp32.
            exact = clip is None and reduction == "all_reduce"
            rtol, atol = (0.0, 0.0) if exact else (1e-5, 1e-6) if dtype == torch.float32 else (5e-3, 1e-4)
            for ours, theirs in zip(model.parameters(), reference.parameters()):
                message = f"{what} iteration {iteration}"
                torch.testing.assert_close(ours, theirs, rtol=rtol, atol=atol, msg=lambda m, w=message: f"{w}: {m}")
        assert scaler.get_scale() < 1024.0 * 2, f"{what}: the inf at iteration {INF_AT} must have backed off"


@pytest.mark.parametrize("ddp_mode", ["all_used", "find_unused", "static_graph"])
def test_grad_scaler_skips_everywhere_and_matches_doing_it_by_hand(ddp_mode: str) -> None:
    """Also where DDP leaves a parameter no rank used without ``.grad`` (find_unused_parameters), and in a static
    graph's first iteration (every bucket handed over as DDP's bucket 0, none as the last)."""
    run_on_ranks(_body, 3, ddp_mode, timeout=240)


def _overlap_body(rank: int, world_size: int) -> None:
    model = _net(torch.float32)
    ddp = DDP(model)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, overlap_with_ddp=True, lr=0.01)
    ddp.register_comm_hook(zero, hook_with_zero_step(reduce_to_owners_hook, ddp, zero))
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(_loss(ddp, rank, 0, torch.float32)).backward()
    with pytest.raises(RuntimeError, match="cannot drive a ZeroRedundancyOptimizer with overlap_with_ddp=True"):
        scaler.step(zero)


def test_grad_scaler_with_overlap_is_refused_clearly() -> None:
    run_on_ranks(_overlap_body, 2)


def _differing_body(rank: int, world_size: int) -> None:
    """Under DDP each rank reads the whole (alike) gradient and steps inside the step's one agreement; a ``.grad`` made
    to differ by hand (an inf on rank 1 only) then raises on every rank, naming the cause, instead of being agreed."""
    model = _net(torch.float32)
    ddp = DDP(model)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(_loss(ddp, rank, 0, torch.float32)).backward()
    if rank == 1:
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    with pytest.raises(RuntimeError, match=r"the ranks' \.grad differ under torch\.amp\.GradScaler"):
        scaler.step(zero)


def test_grad_scaler_refuses_grads_that_differ_between_ranks_on_every_rank() -> None:
    run_on_ranks(_differing_body, 2)


def _mixed_body(rank: int, world_size: int, wrapper: str) -> None:
    """Rank 0 steps through its GradScaler, rank 1 without one (an inf in the gradient): both raise (before, rank 1
    stepped its shard on the inf and the sync spread it: a non-finite parameter on every rank, no error)."""
    model = _net(torch.float32)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01)
    ddp: nn.Module = ShardedDataParallel(model, zero) if wrapper == "sdp" else DDP(model)
    handles = [param.register_hook(_poison(0)) for param in model.parameters()]
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(_loss(ddp, rank, 0, torch.float32)).backward()
    for handle in handles:
        handle.remove()
    with pytest.raises(RuntimeError, match=r"some ranks stepped with scaler\.step\(zero\) and others with zero"):
        scaler.step(zero) if rank == 0 else zero.step()


@pytest.mark.parametrize("wrapper", ["ddp", "sdp"])
def test_grad_scaler_on_some_ranks_only_raises_on_every_rank(wrapper: str) -> None:
    run_on_ranks(_mixed_body, 2, wrapper)


def _accumulate_body(rank: int, world_size: int, wrapper: str) -> None:
    """``scaler.step(zero)`` then a backward with no ``zero_grad`` between: torch's ``scaler.step(optimizer)`` leaves
    every ``.grad`` unscaled, so the next backward accumulates onto unscaled gradients. ZeRO unscaled only what this
    rank steps (its owned fragments, or their fp32 master copies), leaving every other ``.grad`` (under
    ShardedDataParallel: the owned gradient behind a master copy) times the scale: the next step then averaged
    65536 g1 + g2 (fuzzer seed 681176, 4 ranks)."""
    for dtype, partition in itertools.product([torch.float32, torch.bfloat16], ["greedy", "even"]):
        what = f"{wrapper} {dtype} {partition}"
        model, reference = _net(dtype), _net(dtype)
        master = torch.float32 if dtype != torch.float32 else None
        # Adam, compared bitwise, under DDP; under ShardedDataParallel SGD: its bf16 sums round otherwise, which flips
        # Adam's first update (lr times the sign) wherever an element's gradient is near zero
        kind = torch.optim.Adam if wrapper == "ddp" else torch.optim.SGD
        zero = ZeroRedundancyOptimizer(model.parameters(), kind, partition=partition, master_dtype=master, lr=0.01)
        if wrapper == "sdp":
            ddp: nn.Module = ShardedDataParallel(model, zero, bucket_cap_mb=0.0001)
        else:
            ddp = _ddp(model, "all_used")
        reference_ddp = _ddp(reference, "all_used")
        params = list(reference.parameters())
        stepped = [p.detach().float().requires_grad_() if master else p for p in params]
        optimizer = kind(stepped, lr=0.01)
        scalers = [torch.amp.GradScaler("cpu") for _ in range(2)]

        def reference_step(
            scaler: Any = None, params: Any = params, stepped: Any = stepped, optimizer: Any = optimizer
        ) -> None:
            for param, copy in zip(params, stepped):
                if copy is not param:
                    copy.grad = param.grad.float()
            scaler.step(optimizer) if scaler is not None else optimizer.step()
            with torch.no_grad():
                for param, copy in zip(params, stepped):
                    if copy is not param:
                        param.copy_(copy)
                        param.grad.copy_(copy.grad)  # what the scaler left in .grad, as over the model itself

        scalers[0].scale(_loss(ddp, rank, 0, dtype)).backward()
        scalers[0].step(zero)
        scalers[0].update()
        scalers[1].scale(_loss(reference_ddp, rank, 0, dtype)).backward()
        reference_step(scalers[1])
        scalers[1].update()
        for index, (ours, theirs) in enumerate(zip(model.parameters(), params)):
            if wrapper == "ddp":  # ShardedDataParallel's .grad holds no values
                assert torch.equal(ours.grad, theirs.grad), f"{what}: .grad of parameter {index} after scaler.step"
        _loss(ddp, rank, 1, dtype).backward()  # accumulates: no zero_grad
        zero.step()
        _loss(reference_ddp, rank, 1, dtype).backward()
        reference_step()
        # bitwise under DDP; ShardedDataParallel sums in another order (an fp32 ulp, a bf16 one)
        rtol, atol = (0.0, 0.0) if wrapper == "ddp" else (1e-5, 1e-6) if master is None else (0.0, 4e-3)
        for index, (ours, theirs) in enumerate(zip(model.parameters(), params)):
            message = f"{what}: parameter {index} after the accumulated step"
            torch.testing.assert_close(ours, theirs, rtol=rtol, atol=atol, msg=lambda m, w=message: f"{w}: {m}")


@pytest.mark.parametrize("wrapper", ["ddp", "sdp"])
def test_grad_scaler_leaves_every_grad_unscaled_as_torch_does(wrapper: str) -> None:
    run_on_ranks(_accumulate_body, 4, wrapper, timeout=240)
