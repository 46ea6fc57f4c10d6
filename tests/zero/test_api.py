"""ZeroRedundancyOptimizer's API: bad input on every rank, subgroups, add_param_group, zero_grad (Join: test_join)."""

from __future__ import annotations

import itertools
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from distoptim import ZeroRedundancyOptimizer, checkpoint
from distoptim.checkpoint import convert
from distoptim.functional import FunctionalOptimizer, FunctionalSGD
from tests._dist import run_on_ranks
from tests._reference import assert_same_tensors, averaged_gradients, flatten, make_params

SGD = torch.optim.SGD


def _expect(error: type[BaseException], pattern: str, build: Callable[[], Any]) -> None:
    with pytest.raises(error, match=pattern):
        build()


def _without_numpy() -> None:
    """From here on this process is like an install without numpy (torch does not need it): import and use fail."""

    def no_numpy(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("Numpy is not available (the test blocked it)")

    sys.modules["numpy"] = None  # type: ignore[assignment]
    torch.Tensor.numpy = no_numpy  # type: ignore[method-assign]  # torch imported numpy already: block its use too


def _errors_body(rank: int, world_size: int) -> None:
    _without_numpy()  # every agreement below (and the consolidation) must work without numpy
    weight = torch.zeros(3, requires_grad=True)
    sparse = torch.zeros(3, 3).to_sparse().requires_grad_()
    # The same bad input on every rank: every rank raises the local error.
    _expect(TypeError, "got a single tensor; wrap it in a list", lambda: ZeroRedundancyOptimizer(weight, SGD, lr=1))
    _expect(TypeError, "got int", lambda: ZeroRedundancyOptimizer(5, SGD, lr=1))
    _expect(
        TypeError,
        "mixes tensors and param-group dicts",
        lambda: ZeroRedundancyOptimizer([weight, {"params": [weight]}], SGD, lr=1),
    )
    _expect(ValueError, "empty parameter list", lambda: ZeroRedundancyOptimizer([], SGD, lr=1))
    _expect(ValueError, "has no 'params' key", lambda: ZeroRedundancyOptimizer([{"lr": 1}], SGD, lr=1))
    _expect(ValueError, "sparse parameter", lambda: ZeroRedundancyOptimizer([sparse], SGD, lr=1))
    # torch.optim steps a parameter listed twice twice per step (and warns it will become an error): refused here.
    twice = "param group 0 lists a parameter more than once"
    _expect(ValueError, twice, lambda: ZeroRedundancyOptimizer([weight, torch.zeros(2), weight], SGD, lr=1))
    _expect(
        ValueError,
        "Adafactor has none",
        lambda: ZeroRedundancyOptimizer([weight], torch.optim.Adafactor, overlap_with_ddp=True),
    )
    expected = "optimizer_class must be a torch.optim.Optimizer subclass such as torch.optim.AdamW, or a distoptim"
    _expect(TypeError, f"{expected}.*got str 'adamw'", lambda: ZeroRedundancyOptimizer([weight], "adamw", lr=1))
    _expect(
        TypeError,
        "got an instance of SGD: pass the class, with its hyperparameters as keyword arguments",
        lambda: ZeroRedundancyOptimizer([weight], SGD([weight], lr=1), lr=1),
    )
    _expect(TypeError, "generic FunctionalOptimizer", lambda: ZeroRedundancyOptimizer([weight], FunctionalOptimizer))
    _expect(ValueError, "Invalid learning rate", lambda: ZeroRedundancyOptimizer([weight], SGD, lr=-1))
    # Bad input on one rank only: that rank raises its error, the others say which rank failed; nobody hangs.
    if rank == 1:
        _expect(TypeError, "single tensor", lambda: ZeroRedundancyOptimizer(weight, SGD, lr=1))
    else:
        _expect(
            ValueError, "construction failed on rank 1: TypeError", lambda: ZeroRedundancyOptimizer([weight], SGD, lr=1)
        )
    # A hyperparameter the optimizer class rejects on one rank only: torch's own error there, the rank named elsewhere.
    if rank == 1:
        _expect(ValueError, "^Invalid learning rate: -0.001$", lambda: ZeroRedundancyOptimizer([weight], SGD, lr=-1e-3))
    else:
        _expect(
            ValueError,
            "construction failed on rank 1: ValueError: Invalid learning rate: -0.001",
            lambda: ZeroRedundancyOptimizer([weight], SGD, lr=1e-3),
        )
    # Parameters that differ across ranks: every rank raises, naming the difference.
    shape = (3,) if rank == 0 else (4,)
    _expect(
        ValueError,
        re.escape("disagree (param group 0, parameter 0"),
        lambda: ZeroRedundancyOptimizer([torch.zeros(shape, requires_grad=True)], SGD, lr=1),
    )
    dtype = torch.float32 if rank == 0 else torch.float64
    _expect(ValueError, "disagree", lambda: ZeroRedundancyOptimizer([torch.zeros(3, dtype=dtype)], SGD, lr=1))
    count = 1 if rank == 0 else 2
    _expect(
        ValueError,
        "has 1 vs 2 parameters|has 2 vs 1 parameters",
        lambda: ZeroRedundancyOptimizer([torch.zeros(3, requires_grad=True) for _ in range(count)], SGD, lr=1),
    )
    _expect(
        ValueError,
        "settings",
        lambda: ZeroRedundancyOptimizer([weight], SGD, parameters_as_bucket_view=rank == 0, lr=1),
    )
    # Valid hyperparameters that differ across ranks: every rank raises, naming the key and both values.
    lrs = ("0.001 vs 0.01", "0.01 vs 0.001")[rank]
    _expect(
        ValueError,
        re.escape(f"disagree (settings: 'lr' {lrs})"),
        lambda: ZeroRedundancyOptimizer([weight], SGD, lr=(1e-3, 1e-2)[rank]),
    )
    _expect(
        ValueError,
        re.escape(f"disagree (param group 0: 'lr' {lrs})"),
        lambda: ZeroRedundancyOptimizer([{"params": [weight], "lr": (1e-3, 1e-2)[rank]}], SGD, lr=1),
    )
    # What means the same on every rank agrees: ints and floats, lists and tuples, equal tensors, a functional class.
    adam = ZeroRedundancyOptimizer(
        [weight], torch.optim.Adam, lr=(1, 1.0)[rank], betas=((0.9, 0.99), [0.9, 0.99])[rank], eps=torch.tensor(1e-8)
    )
    assert isinstance(adam.local_optimizer, torch.optim.Adam)
    functional = ZeroRedundancyOptimizer([weight], FunctionalSGD, lr=1)
    assert isinstance(functional.local_optimizer, SGD)
    # add_param_group: a group torch.optim refuses on one rank only, then valid groups that differ.
    zero = ZeroRedundancyOptimizer([weight, torch.zeros(2)], SGD, lr=1)
    if rank == 1:
        _expect(
            ValueError, "^some parameters appear in more than one", lambda: zero.add_param_group({"params": weight})
        )
    else:
        _expect(
            ValueError,
            "add_param_group failed on rank 1: ValueError: some parameters appear in more than one parameter group",
            lambda: zero.add_param_group({"params": torch.zeros(3, requires_grad=True)}),
        )
    _expect(
        ValueError,
        re.escape(f"disagree (param group 1: 'lr' {lrs})"),
        lambda: zero.add_param_group({"params": torch.zeros(3, requires_grad=True), "lr": (1e-3, 1e-2)[rank]}),
    )
    extra = torch.zeros(3, requires_grad=True)
    twice = "param group 1 lists a parameter more than once"  # named by the index it would have had
    _expect(ValueError, twice, lambda: zero.add_param_group({"params": [extra, extra]}))
    _expect(ValueError, "param group 1 has no 'params' key", lambda: zero.add_param_group({"lr": 0.1}))
    assert len(zero.param_groups) == 1, "a refused group is added on no rank"
    # Consolidation moves objects between ranks, also without numpy.
    weight.grad = torch.ones(3)
    zero.step()
    zero.consolidate_state_dict(to=0)
    if rank == 0:
        assert zero.state_dict()["param_groups"][0]["params"] == [0, 1]
    weight.grad = None
    # Misuse after construction.
    _expect(ValueError, "'to' must be a rank of the group", lambda: zero.consolidate_state_dict(to=world_size))
    _expect(
        ValueError,
        "has 2 param groups but this optimizer has 1",
        lambda: zero.load_state_dict({"state": {}, "param_groups": [{"params": [0]}, {"params": [1]}]}),
    )
    _expect(
        ValueError,
        "has 1 parameters in the state dict but 2",
        lambda: zero.load_state_dict({"state": {}, "param_groups": [{"params": [0]}]}),
    )
    frozen = next(p for p in zero.param_groups[0]["params"] if not p.requires_grad)
    frozen.grad = torch.ones(2)
    _expect(RuntimeError, "requires_grad=False has a gradient", zero.step)


def test_bad_input_raises_clearly_on_every_rank() -> None:
    run_on_ranks(_errors_body, 2)


def test_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        ZeroRedundancyOptimizer([torch.zeros(1)], SGD, lr=1)


def _subgroup_body(rank: int, world_size: int) -> None:
    subgroup = dist.new_group([1, 2])
    if rank != 0:  # rank 0 is outside the subgroup: it only waits for the others at the end
        _train_in_subgroup(rank, subgroup)
    dist.barrier()


def _train_in_subgroup(rank: int, subgroup: dist.ProcessGroup) -> None:
    params, expected = make_params(), make_params()
    zero = ZeroRedundancyOptimizer(
        (p for p in flatten(params)), torch.optim.Adam, process_group=subgroup, parameters_as_bucket_view=True, lr=0.1
    )
    reference = torch.optim.Adam(flatten(expected), lr=0.1)
    for step in range(3):
        grads = averaged_gradients(flatten(params), rank, step, group=subgroup)
        for param, ref, grad in zip(flatten(params), flatten(expected), grads):
            param.grad, ref.grad = grad, None if grad is None else grad.clone()
        zero.step()
        reference.step()
    assert_same_tensors(flatten(params), flatten(expected), "subgroup")
    assert zero.world_size == 2 and zero.rank == rank - 1
    assert zero.global_rank == rank and zero.initialized  # torch's public attributes


def test_non_default_process_group() -> None:
    run_on_ranks(_subgroup_body, 3)


def _retry_body(rank: int, world_size: int) -> None:
    """A step whose settings differ between the ranks (lr on rank 1 only) raises on every rank after each stepped its
    shard: a retry is refused on every rank (it would step the shards twice, the parameters never synced), also after
    a re-placement, and so is a checkpoint; a resume from one taken before trains on as torch.optim.AdamW on the same
    gradients. A closure that raises before any update refuses nothing later (review r-21b)."""
    params = [torch.linspace(-1, 1, 7).requires_grad_(), torch.linspace(0, 2, 5).requires_grad_()]
    reference = [p.detach().clone().requires_grad_() for p in params]
    extra = torch.zeros(3)  # frozen at first; unfrozen later, to place the parameters again
    zero = ZeroRedundancyOptimizer([*params, extra], torch.optim.AdamW, lr=0.1)
    plain = torch.optim.AdamW(reference, lr=0.1)

    def step_both() -> None:
        for p, r in zip(params, reference):
            p.grad, r.grad = torch.full_like(p, 1.5), torch.full_like(r, 1.5)  # DDP's average, alike everywhere
        zero.step()
        plain.step()

    step_both()
    zero.consolidate_state_dict(to=0)
    box, kept = [zero.state_dict() if rank == 0 else None], [p.detach().clone() for p in params]
    dist.broadcast_object_list(box, src=0)
    _expect(ValueError, "the closure failed", lambda: zero.step(_failing_closure))  # before any update: no refusal
    zero.param_groups[0]["lr"] = 0.2 if rank == 1 else 0.1
    _expect(ValueError, "disagree", zero.step)
    zero.param_groups[0]["lr"] = 0.1
    extra.requires_grad_(True)
    zero.clip_grad_norm_(1.0)  # places the parameters again (a new local shard): the refusal stays
    apart = "the last step raised after this rank's local optimizer began to step its shard"
    _expect(RuntimeError, apart, zero.step)
    _expect(RuntimeError, apart, lambda: zero.consolidate_state_dict(to=0))  # no checkpoint of it either,
    _expect(RuntimeError, "has not been consolidated", zero.state_dict)  # nor the one from before the step
    zero.sharded_state_dict()  # the template a sharded resume loads into stays
    with torch.no_grad():
        for p, k in zip(params, kept):
            p.copy_(k)
    zero.load_state_dict(box[0])
    step_both()
    for p, r in zip(params, reference):
        torch.testing.assert_close(p.detach(), r.detach())


def _failing_closure() -> float:
    raise ValueError("the closure failed")


def test_a_step_retried_after_it_raised_is_refused_and_a_resume_trains_on() -> None:
    run_on_ranks(_retry_body, 2)


def _saved_apart_body(rank: int, world_size: int, root: str) -> None:
    """A sharded save after a step that raised once the shards were stepped (an emergency checkpoint) holds state
    apart from the model's parameters: every load of it is refused; one saved before still resumes."""
    params = [torch.linspace(-1, 1, 7).requires_grad_(), torch.linspace(0, 2, 5).requires_grad_()]
    zero = ZeroRedundancyOptimizer(params, torch.optim.AdamW, lr=0.1)
    for p in params:
        p.grad = torch.full_like(p, 1.5)
    zero.step()
    checkpoint.save({"optim": zero.sharded_state_dict()}, f"{root}/before")
    zero.param_groups[0]["lr"] = 0.2 if rank == 1 else 0.1
    _expect(ValueError, "disagree", zero.step)
    zero.param_groups[0]["lr"] = 0.1
    checkpoint.save({"optim": zero.sharded_state_dict()}, f"{root}/apart")
    fresh = ZeroRedundancyOptimizer([p.detach().clone().requires_grad_() for p in params], torch.optim.AdamW, lr=0.1)
    state = {"optim": fresh.sharded_state_dict()}
    checkpoint.load(state, f"{root}/apart")
    _expect(
        ValueError, "saved after a zero.step\\(\\) that raised", lambda: fresh.load_sharded_state_dict(state["optim"])
    )
    if rank == 0:
        _expect(ValueError, "saved after a zero.step", lambda: convert.dcp_to_torch_optim(f"{root}/apart"))
    state = {"optim": zero.sharded_state_dict()}  # the template of the resume
    checkpoint.load(state, f"{root}/before")
    zero.load_sharded_state_dict(state["optim"])
    zero.step()


def test_a_sharded_save_after_a_step_raised_midway_is_refused_at_load(tmp_path: Path) -> None:
    run_on_ranks(_saved_apart_body, 2, str(tmp_path))


def _raised_midway_body(rank: int, world_size: int) -> None:
    """torch's AdamW steps group by group: a sparse gradient in the second group raises after the first was updated.
    The retry is refused on every rank (it stepped the first group twice, 0.1 off AdamW, review r-21c). A keyword
    the step does not take raises before any update and refuses nothing later."""
    params = [torch.linspace(-1, 1, 6).add(i).requires_grad_() for i in range(4)]
    zero = ZeroRedundancyOptimizer([{"params": params[:2]}, {"params": params[2:]}], torch.optim.AdamW, lr=0.1)
    for p in params:
        p.grad = torch.full_like(p, 1.5)
    _expect(TypeError, "unexpected keyword argument", lambda: zero.step(not_a_step_argument=1))
    zero.step()
    assert zero.local_shard.unsynced is False
    for p in params[2:]:
        p.grad = p.grad.to_sparse()
    _expect(RuntimeError, "sparse", zero.step)
    assert zero.local_shard.unsynced, "the first group was updated before the second raised"
    for p in params:
        p.grad = torch.full_like(p, 1.5)
    _expect(RuntimeError, "began to step its shard", zero.step)
    ignoring = ZeroRedundancyOptimizer(params, _ClosureIgnoringSGD, lr=0.1)  # (review r-22: no mark was set)
    ignoring.param_groups[0]["lr"] = 0.2 if rank == 1 else 0.1
    _expect(ValueError, "disagree", lambda: ignoring.step(lambda: 0.0))
    _expect(RuntimeError, "began to step its shard", ignoring.step)


class _ClosureIgnoringSGD(torch.optim.SGD):
    """A third-party optimizer whose step never calls the closure it is given (ZeRO runs it first anyway)."""

    def step(self, closure: Any = None) -> Any:
        return super().step()


def test_a_local_step_that_raised_midway_is_not_retried() -> None:
    run_on_ranks(_raised_midway_body, 2)


def _add_param_group_body(rank: int, world_size: int) -> None:
    for bucket_view, partition in itertools.product((False, True), ("greedy", "even")):
        (first, second), (first_ref, second_ref) = make_params(), make_params()
        zero = ZeroRedundancyOptimizer(
            first, SGD, parameters_as_bucket_view=bucket_view, partition=partition, lr=0.1, momentum=0.9
        )
        before_fragments = zero.plan.fragments
        reference = SGD(first_ref, lr=0.1, momentum=0.9)
        before = zero.plan.owners
        for step in range(4):
            if step == 2:
                zero.add_param_group({"params": second, "lr": 0.05})
                reference.add_param_group({"params": second_ref, "lr": 0.05})
                assert zero.plan.owners[: len(before)] == before
                assert zero.plan.fragments[: len(before)] == before_fragments  # placed elements stay put
                assert len(zero.local_optimizer.param_groups) == 2
            params, expected = (
                flatten(zero.param_groups and [g["params"] for g in zero.param_groups]),
                flatten([g["params"] for g in reference.param_groups]),
            )
            grads = averaged_gradients(params, rank, step)
            for param, ref, grad in zip(params, expected, grads):
                param.grad, ref.grad = grad, None if grad is None else grad.clone()
            zero.step()
            reference.step()
            assert_same_tensors(params, expected, f"bucket_view={bucket_view} {partition} step {step}")
        zero.zero_grad()
        assert all(p.grad is None for p in params), "zero_grad clears every parameter, owned or not"
        if bucket_view:  # trainable parameters are views into the rebuilt flat buckets
            spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in zero.placer.sync.buffers]
            for param in (p for p in params if p.requires_grad):
                assert any(start <= param.data_ptr() < end for start, end in spans)


def test_add_param_group_and_zero_grad() -> None:
    run_on_ranks(_add_param_group_body, 2)


class _CountingSGD(torch.optim.SGD):
    """An optimizer that records something in its param groups while stepping (as some optimizers do)."""

    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            group["local_steps"] = group.get("local_steps", 0) + 1
        return super().step(closure)


def _hyperparameters_body(rank: int, world_size: int) -> None:
    params = [torch.ones(4, requires_grad=True), torch.ones(3, requires_grad=True)]
    zero = ZeroRedundancyOptimizer(params, _CountingSGD, lr=0.1)
    zero.param_groups[0]["lr"] = 0.5  # a change to the global view reaches the local optimizer before its step
    for param in params:
        param.grad = torch.ones_like(param)
    zero.step()
    assert zero.local_optimizer.param_groups[0]["lr"] == 0.5
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in params)
    assert zero.param_groups[0]["local_steps"] == 1  # a key the local optimizer added shows up globally


def test_hyperparameters_flow_both_ways() -> None:
    run_on_ranks(_hyperparameters_body, 2)


class _MyLBFGS(torch.optim.LBFGS):
    pass


def _coupled_body(rank: int, world_size: int) -> None:
    """LBFGS (and a subclass) steps all parameters as one vector: refused in every partition, at every world size
    (at 1 the result would be right, but a script must not change meaning when it scales out)."""
    for cls, partition in itertools.product((torch.optim.LBFGS, _MyLBFGS), ("greedy", "even")):
        params = [torch.zeros(3, requires_grad=True), torch.zeros(4, requires_grad=True)]
        with pytest.raises(ValueError, match=rf"{cls.__name__} couples every parameter in one step.*without Zero"):
            ZeroRedundancyOptimizer(params, cls, partition=partition, lr=1)


def test_optimizers_coupling_all_parameters_are_refused() -> None:
    run_on_ranks(_coupled_body, 1)
    run_on_ranks(_coupled_body, 2)


def _torch_error(build: Callable[[], Any]) -> str:
    """What torch.optim raises for ``build()``: the prefix our refusal of the same input must carry."""
    with pytest.raises(ValueError) as raised:
        build()
    return str(raised.value)


def _named_body(rank: int, world_size: int) -> None:
    """Named parameters as torch.optim takes them (flat, or in groups; add_param_group too): trained, and
    ``param_groups`` / ``state_dict()`` with ``param_names``, exactly as torch.optim.AdamW's over the same program;
    a load keeps or takes the names as torch's does; mixed named and unnamed raise torch's texts."""

    def nets() -> tuple[torch.nn.Module, torch.nn.Module]:
        torch.manual_seed(0)
        return torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)

    ours, theirs = nets(), nets()
    for flat in (True, False):
        first = list(ours[0].named_parameters()) if flat else [{"params": list(ours[0].named_parameters())}]
        zero = ZeroRedundancyOptimizer(first, torch.optim.AdamW, partition="even", lr=0.1)
        plain = torch.optim.AdamW(list(theirs[0].named_parameters()), lr=0.1)
        zero.add_param_group({"params": list(ours[1].named_parameters()), "lr": 0.05})
        plain.add_param_group({"params": list(theirs[1].named_parameters()), "lr": 0.05})
        for step in range(3):
            for optimizer, (a, b) in ((zero, ours), (plain, theirs)):
                optimizer.zero_grad()
                x = torch.ones(2, 3) * (step + 1)
                b(torch.tanh(a(x))).square().sum().backward()
                optimizer.step()
        assert_same_tensors(
            [*ours[0].parameters(), *ours[1].parameters()],
            [*theirs[0].parameters(), *theirs[1].parameters()],
            f"flat={flat}",
        )
        assert [g["param_names"] for g in zero.param_groups] == [["weight", "bias"]] * 2
        zero.consolidate_state_dict(to=0)
        if rank == 0:
            mine, want = zero.state_dict(), plain.state_dict()
            assert mine["param_groups"] == want["param_groups"], (mine["param_groups"], want["param_groups"])
            for index, entry in want["state"].items():
                assert mine["state"][index].keys() == entry.keys()
                assert all(torch.equal(mine["state"][index][k], v) for k, v in entry.items()), index
    renamed = plain.state_dict()
    renamed["param_groups"][1]["param_names"] = ["w", "b"]
    zero.load_state_dict(renamed)  # torch: the loaded names win
    assert zero.param_groups[1]["param_names"] == ["w", "b"]
    unnamed = plain.state_dict()
    for group in unnamed["param_groups"]:
        del group["param_names"]
    zero.load_state_dict(unnamed)  # torch: the optimizer's names stay
    assert zero.param_groups[1]["param_names"] == ["w", "b"] and zero.param_groups[0]["param_names"] == [
        "weight",
        "bias",
    ]
    weight, bias = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    mixed = [("weight", weight), bias]
    said = _torch_error(lambda: torch.optim.AdamW(mixed))
    _expect(
        ValueError,
        re.escape(said) + r" \(param group 0: 1 of its 2 parameters",
        lambda: ZeroRedundancyOptimizer(mixed, torch.optim.AdamW),
    )
    groups = [{"params": [("weight", weight)]}, {"params": [bias]}]
    said = _torch_error(lambda: torch.optim.AdamW(groups))
    _expect(ValueError, re.escape(said) + ": pass", lambda: ZeroRedundancyOptimizer(groups, torch.optim.AdamW))
    zero = ZeroRedundancyOptimizer([weight], torch.optim.AdamW)
    plain = torch.optim.AdamW([weight])
    said = _torch_error(lambda: plain.add_param_group({"params": [("bias", bias)]}))
    _expect(ValueError, re.escape(said), lambda: zero.add_param_group({"params": [("bias", bias)]}))
    assert len(zero.param_groups) == 1
    zero.add_param_group({"params": [bias]})


def test_named_parameters_as_torch_optim_takes_them() -> None:
    run_on_ranks(_named_body, 2)


def _torch_texts_body(rank: int, world_size: int) -> None:
    """Where torch's ZeroRedundancyOptimizer or torch.optim refuses the same input, our refusal starts with torch's
    text (log scrapers and ``pytest.raises(match=...)`` keyed on it keep working), our how-to-fix after it."""
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    weight, bias = torch.zeros(2, 2, requires_grad=True), torch.zeros(2, requires_grad=True)
    cases: list[tuple[Callable[[], Any], Callable[[], Any]]] = [
        (lambda: TorchZero(weight, SGD, lr=1), lambda: ZeroRedundancyOptimizer(weight, SGD, lr=1)),
        (lambda: TorchZero(3, SGD, lr=1), lambda: ZeroRedundancyOptimizer(3, SGD, lr=1)),
        (
            lambda: TorchZero({"params": [weight]}, SGD, lr=1),
            lambda: ZeroRedundancyOptimizer({"params": [weight]}, SGD, lr=1),
        ),
        (
            lambda: TorchZero([weight, {"params": [bias]}], SGD, lr=1),
            lambda: ZeroRedundancyOptimizer([weight, {"params": [bias]}], SGD, lr=1),
        ),
        (lambda: TorchZero([{"lr": 1}], SGD, lr=1), lambda: ZeroRedundancyOptimizer([{"lr": 1}], SGD, lr=1)),
        (lambda: TorchZero([], SGD, lr=1), lambda: ZeroRedundancyOptimizer([], SGD, lr=1)),
        (lambda: SGD([weight, "bias"], lr=1), lambda: ZeroRedundancyOptimizer([weight, "bias"], SGD, lr=1)),
        (
            lambda: TorchZero([weight], torch.optim.Adafactor, overlap_with_ddp=True),
            lambda: ZeroRedundancyOptimizer([weight], torch.optim.Adafactor, overlap_with_ddp=True),
        ),
        (
            lambda: torch.optim.Muon([bias]),
            lambda: ZeroRedundancyOptimizer(
                [{"params": [bias], "optimizer_class": torch.optim.Muon}], torch.optim.AdamW
            ),
        ),
    ]
    for number, (theirs, ours) in enumerate(cases):
        with pytest.raises((TypeError, ValueError)) as torch_raised:
            theirs()
        with pytest.raises(torch_raised.type) as raised:
            ours()
        said = str(torch_raised.value)
        assert str(raised.value).startswith(said), (number, said, str(raised.value))
        assert len(str(raised.value)) > len(said) + 20, (number, "and says how to fix it")


def test_refusals_start_with_torchs_text_for_the_same_input() -> None:
    run_on_ranks(_torch_texts_body, 2)
