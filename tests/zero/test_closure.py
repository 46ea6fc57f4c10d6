"""``step(closure)``: the closure runs the backward, and the step uses the gradients it made, in every partition and
with master weights (torch.optim runs the closure first; Lightning steps this way). ZeRO runs the closure itself,
then calls the local optimizer's ``step`` without one, as torch's ZeroRedundancyOptimizer calls it where there is
none: a ``step(self)`` works."""

from __future__ import annotations

import itertools

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

from distoptim import ZeroRedundancyOptimizer
from tests._dist import run_on_ranks
from tests._reference import assert_same_tensors, averaged_gradients, flatten, make_params, set_gradients


def _body(rank: int, world_size: int) -> None:
    for partition, master in itertools.product(["greedy", "even"], [None, torch.float32]):
        ours, theirs = flatten(make_params()), flatten(make_params())
        zero = ZeroRedundancyOptimizer(ours, torch.optim.AdamW, partition=partition, master_dtype=master, lr=0.01)
        stepped = [p.detach().float().requires_grad_(p.requires_grad) if master else p for p in theirs]
        reference = torch.optim.AdamW([p for p in stepped if p.requires_grad], lr=0.01)
        for step in range(3):
            grads = averaged_gradients(ours, rank, step)

            def closure(grads: list[torch.Tensor | None] = grads, params: list[torch.Tensor] = ours) -> float:
                set_gradients(grads, params)
                return 1.5

            assert zero.step(closure) == 1.5
            set_gradients([None if g is None else g.to(s.dtype) for g, s in zip(grads, stepped)], stepped)
            reference.step()
            with torch.no_grad():
                for param, copy in zip(theirs, stepped):
                    if copy is not param:
                        param.copy_(copy)
            assert_same_tensors(ours, theirs, f"{partition} master={master} step {step}")


def test_step_with_a_closure_uses_the_gradients_it_makes() -> None:
    run_on_ranks(_body, 2)


class _NoClosureSGD(torch.optim.SGD):
    """An optimizer whose ``step`` takes no closure (some third-party optimizers are written so)."""

    def step(self) -> None:  # type: ignore[override]
        super().step()


def _no_closure_body(rank: int, world_size: int) -> None:
    modes = [("greedy", False), ("greedy", True), ("even", False), ("even", True)]
    for partition, view in modes:
        ours, theirs = flatten(make_params()), flatten(make_params())
        theirs = [p.detach().float().requires_grad_(p.requires_grad) for p in theirs]  # torch's refuses mixed dtypes
        ours = [p.detach().float().requires_grad_(p.requires_grad) for p in ours]
        kwargs = {"lr": 0.1, "momentum": 0.9}
        zero = ZeroRedundancyOptimizer(
            ours, _NoClosureSGD, parameters_as_bucket_view=view, partition=partition, **kwargs
        )
        reference = TorchZero([p for p in theirs if p.requires_grad], _NoClosureSGD, **kwargs)
        for step in range(3):
            set_gradients(averaged_gradients(ours, rank, step), ours, theirs)
            zero.step()
            reference.step()
            assert_same_tensors(ours, theirs, f"{partition} bucket_view={view} step {step}")


def test_a_local_step_without_a_closure_parameter_matches_torchs_zero() -> None:
    run_on_ranks(_no_closure_body, 2)


def _closure_writes_body(rank: int, world_size: int) -> None:
    """bf16 parameters with fp32 masters: a constraint the closure writes into a parameter (a clamp) is stepped
    from, exactly as the same write made before ``step()`` (review r-22b: the masters, seeded before the closure
    ran, overwrote it)."""
    ours, theirs = ([torch.linspace(-2, 2, 12, dtype=torch.bfloat16).requires_grad_()] for _ in range(2))
    options = {"partition": "even", "master_dtype": torch.float32, "lr": 0.01}
    zero, plain = (ZeroRedundancyOptimizer(p, torch.optim.AdamW, **options) for p in (ours, theirs))
    for step in range(3):
        grads = averaged_gradients(ours, rank, step)

        def closure(grads: list[torch.Tensor | None] = grads) -> float:
            with torch.no_grad():
                ours[0].clamp_(-1, 1)
            set_gradients(grads, ours)
            return 0.0

        zero.step(closure)
        with torch.no_grad():
            theirs[0].clamp_(-1, 1)
        set_gradients(grads, theirs)
        plain.step()
        assert_same_tensors(ours, theirs, f"step {step}")


def test_a_parameter_the_closure_writes_is_stepped_from_under_master_weights() -> None:
    run_on_ranks(_closure_writes_body, 2)
