"""Consolidation, the torch.optim state-dict format, loading at other world sizes, and torch's own ZeRO."""

from __future__ import annotations

import copy
import pickle
import re
from collections import deque
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

from distoptim import ZeroRedundancyOptimizer
from distoptim.checkpoint import consolidated as checkpoint
from distoptim.checkpoint.consolidated import STAGING_BYTES
from distoptim.comm import collectives as comm
from distoptim.functional import FunctionalAdamW
from distoptim.zero.elementwise import is_elementwise
from tests._dist import cuda_world_size, run_on_ranks
from tests._reference import assert_same_tensors, averaged_gradients, flatten, make_params

KWARGS = {"lr": 0.01, "weight_decay": 0.01, "amsgrad": True}


def _groups(params: list[list[torch.Tensor]]) -> list[dict[str, Any]]:
    return [{"params": params[0]}, {"params": params[1], "lr": 0.005}]


def _train(optimizers: list[torch.optim.Optimizer], params: list[list[torch.Tensor]], rank: int, steps: range) -> None:
    """Step every optimizer (each over its own copy in ``params``) on the same averaged gradients."""
    for step in steps:
        grads = averaged_gradients(params[0], rank, step)
        for optimizer, copy_ in zip(optimizers, params):
            for param, grad in zip(copy_, grads):
                param.grad = None if grad is None else grad.clone()
            optimizer.step()


def _assert_same_state_dict(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual["param_groups"] == expected["param_groups"]
    assert sorted(actual["state"]) == sorted(expected["state"])
    for index, entry in expected["state"].items():
        assert sorted(actual["state"][index]) == sorted(entry), index
        assert_same_tensors([actual["state"][index][k] for k in entry], list(entry.values()), f"state[{index}]")


def _save_body(rank: int, world_size: int, to: int, staging_bytes: int, partition: str) -> dict[str, Any] | None:
    ours, plain = make_params(), make_params()
    zero = ZeroRedundancyOptimizer(_groups(ours), torch.optim.Adam, partition=partition, **KWARGS)
    reference = torch.optim.Adam(_groups(plain), **KWARGS)
    _train([zero, reference], [flatten(ours), flatten(plain)], rank, range(3))

    with pytest.raises(RuntimeError, match=rf"consolidate_state_dict\(to={rank}\)"):
        zero.state_dict()
    shard_bytes = _state_bytes(zero.state)
    with (
        mock.patch.object(checkpoint, "STAGING_BYTES", staging_bytes),
        mock.patch.object(dist, "recv", wraps=dist.recv) as recv,
        mock.patch.object(comm, "send_tensor", wraps=comm.send_tensor) as send_tensor,
        mock.patch.object(comm, "receive_tensor", wraps=comm.receive_tensor) as receive_tensor,
    ):
        zero.consolidate_state_dict(to=to)
    # Only the target receives anything. Shards travel in messages of at most staging_bytes, packed into one reused
    # staging buffer: never a second copy of the whole shard.
    sent = [call.args[0] for call in send_tensor.call_args_list]
    if rank != to:
        assert recv.call_count == 0, recv.call_count
        assert len(sent) == -(-shard_bytes // staging_bytes), (len(sent), shard_bytes)
        assert len({message.untyped_storage().data_ptr() for message in sent}) == 1
    received = [call.args[0] for call in receive_tensor.call_args_list]
    assert all(message.numel() <= staging_bytes for message in sent + received)
    if partition == "greedy":  # (split parameters' step counts travel once per fragment)
        assert sum(m.numel() for m in received) == (_state_bytes(reference.state) - shard_bytes) * (rank == to)
    result = None
    if rank != to:
        with pytest.raises(RuntimeError, match="holds no consolidated optimizer state"):
            zero.state_dict()
    else:
        saved = zero.state_dict()
        _assert_same_state_dict(saved, reference.state_dict())
        assert all(v.device.type == "cpu" for entry in saved["state"].values() for v in entry.values())
        # The consolidated dict is the plain torch.optim format: it loads into a plain optimizer.
        loaded = torch.optim.Adam(_groups(make_params()), **KWARGS)
        loaded.load_state_dict(copy.deepcopy(saved))
        _assert_same_state_dict(loaded.state_dict(), reference.state_dict())
        result = {"saved": saved, "params": [p.detach().clone() for p in flatten(plain)]}
        snapshot = copy.deepcopy(saved)
    # A step invalidates the consolidated state, which would otherwise be stale.
    _train([zero], [flatten(ours)], rank, range(3, 4))
    if rank == to:  # and a consolidated dict kept for saving is that moment's: the step did not reach into it
        _assert_same_state_dict(saved, snapshot)
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        zero.state_dict()
    return result


def _state_bytes(state: Any) -> int:
    return sum(v.numel() * v.element_size() for entry in state.values() for v in entry.values())


def _load_body(rank: int, world_size: int, saved_run: dict[str, Any], partition: str) -> None:
    saved, values = saved_run["saved"], saved_run["params"]
    pristine = copy.deepcopy(saved)
    ours, plain = make_params(), make_params()
    for param, other, value in zip(flatten(ours), flatten(plain), values):
        param.data.copy_(value)
        other.data.copy_(value)
    zero = ZeroRedundancyOptimizer(
        _groups(ours), torch.optim.Adam, parameters_as_bucket_view=True, partition=partition, **KWARGS
    )
    zero.load_state_dict(saved)
    assert zero.state is zero.local_optimizer.state
    reference = torch.optim.Adam(_groups(plain), **KWARGS)
    reference.load_state_dict(copy.deepcopy(saved))
    _train([zero, reference], [flatten(ours), flatten(plain)], rank, range(3, 6))
    assert_same_tensors(flatten(ours), flatten(plain), f"resumed at world size {world_size}, partition={partition}")
    _assert_same_state_dict(saved, pristine)  # loading kept its own copies: the caller's dict is untouched
    owned = {id(p) for g in zero.local_optimizer.param_groups for p in g["params"]}
    assert {id(p) for p in zero.local_optimizer.state} <= owned  # each rank keeps only its shard


# 100 bytes: Adam's 512-byte moments span several messages, and a message holds several tensors (4-byte steps).
# Partition modes change too: the consolidated dict is torch.optim's format whatever cut the state was in.
@pytest.mark.parametrize(
    ("save_world", "load_world", "staging_bytes", "saved_partition", "loaded_partition"),
    [
        (3, 2, 100, "greedy", "greedy"),
        (3, 2, STAGING_BYTES, "greedy", "even"),
        (2, 4, 100, "even", "even"),
        (4, 3, STAGING_BYTES, "even", "greedy"),
    ],
)
def test_save_consolidated_and_resume_at_another_world_size_and_partition(
    save_world: int, load_world: int, staging_bytes: int, saved_partition: str, loaded_partition: str
) -> None:
    results = run_on_ranks(_save_body, save_world, save_world - 1, staging_bytes, saved_partition)
    assert all(result is None for result in results[:-1])
    run_on_ranks(_load_body, load_world, results[save_world - 1], loaded_partition)


def _torch_zero_body(rank: int, world_size: int) -> None:
    ours, theirs = make_params(), make_params()
    zero = ZeroRedundancyOptimizer(_groups(ours), torch.optim.AdamW, **KWARGS)
    torch_zero = TorchZero(_groups(theirs)[0]["params"], torch.optim.AdamW, **KWARGS)
    torch_zero.add_param_group(_groups(theirs)[1])
    _train([zero, torch_zero], [flatten(ours), flatten(theirs)], rank, range(3))
    assert_same_tensors(flatten(ours), flatten(theirs), "ours vs torch's ZeroRedundancyOptimizer")

    zero.consolidate_state_dict(to=0)
    torch_zero.consolidate_state_dict(to=0)
    dicts = [zero.state_dict(), torch_zero.state_dict()] if rank == 0 else [None, None]
    dist.broadcast_object_list(dicts, src=0)
    ours_saved, theirs_saved = dicts
    _assert_same_state_dict(ours_saved, theirs_saved)
    # Cross-load both ways and keep training: still in lockstep.
    zero.load_state_dict(theirs_saved)
    torch_zero.load_state_dict(ours_saved)
    _train([zero, torch_zero], [flatten(ours), flatten(theirs)], rank, range(3, 6))
    assert_same_tensors(flatten(ours), flatten(theirs), "after cross-loading")


def test_parity_and_cross_loading_with_torch_zero() -> None:
    run_on_ranks(_torch_zero_body, 2)


def _device_placement_body(rank: int, world_size: int) -> None:
    """A capturable optimizer keeps ``step`` on the parameter's device after loading a dict saved on the CPU."""
    device = torch.device("cuda", rank)
    params = [p.to(device) for p in flatten(make_params())]
    saved = torch.optim.Adam([p.detach().cpu().requires_grad_(p.requires_grad) for p in params], lr=0.01)
    for param in (p for group in saved.param_groups for p in group["params"] if p.requires_grad):
        param.grad = torch.ones_like(param)
    saved.step()
    zero = ZeroRedundancyOptimizer(params, torch.optim.Adam, lr=0.01, capturable=True)
    zero.load_state_dict(saved.state_dict())
    for state in zero.local_optimizer.state.values():
        assert all(value.device == device for value in state.values()), state
    zero.consolidate_state_dict(to=0)  # shards travel over NCCL from their CUDA tensors
    if rank == 0:
        consolidated = zero.state_dict()["state"]
        assert len(consolidated) == len(saved.state_dict()["state"])
        assert all(v.device.type == "cpu" for entry in consolidated.values() for v in entry.values())


@pytest.mark.skipif(cuda_world_size() < 2, reason="needs 2 CUDA devices")
def test_state_goes_where_the_local_optimizer_needs_it_on_nccl() -> None:
    run_on_ranks(_device_placement_body, 2, backend="nccl")


class _Wire:
    """comm's point-to-point calls in memory, for one process: what is sent is queued for the receiving call."""

    def __init__(self) -> None:
        self.objects: deque[Any] = deque()
        self.messages: deque[torch.Tensor] = deque()
        self.sent: list[torch.Tensor] = []
        self.object_devices: list[torch.device | None] = []  # each side's device for the object: one backend

    def patched(self) -> Any:
        def send_object(obj: Any, to: int, group: Any, device: torch.device | None = None) -> None:
            self.object_devices.append(device)
            self.objects.append(pickle.loads(pickle.dumps(obj)))

        def receive_object(source: int, group: Any, device: torch.device | None = None) -> Any:
            self.object_devices.append(device)
            return self.objects.popleft()

        return mock.patch.multiple(
            comm,
            send_object=send_object,
            receive_object=receive_object,
            send_tensor=lambda tensor, to, group: (self.sent.append(tensor), self.messages.append(tensor.clone())),
            receive_tensor=lambda tensor, source, group: tensor.copy_(self.messages.popleft()),
        )


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(cuda_world_size() < 1, reason="needs a CUDA device"))],
)
def test_a_shard_travels_in_bounded_messages_through_one_staging_buffer(device: str) -> None:
    generator = torch.Generator().manual_seed(0)
    state = {  # every kind of state tensor, on the comm device as a GPU optimizer's would be (steps on the CPU)
        3: {"step": torch.tensor(2.0), "exp_avg": torch.randn(10, 7, generator=generator).to(device), "note": "as is"},
        0: {
            "transposed": torch.randn(5, 40, generator=generator).to(device).t(),
            "half": torch.randn(13, generator=generator).to(device, torch.bfloat16),
            "empty": torch.zeros(0, 4, device=device),
            "count": torch.arange(5, device=device),
            "mask": torch.rand(9, generator=generator).to(device) > 0.5,
            "complex": torch.randn(3, generator=generator, dtype=torch.complex64).to(device),
        },
    }
    wire, staging_bytes = _Wire(), 64
    with wire.patched():
        checkpoint.send_state(state, 1, None, torch.device(device), staging_bytes)  # type: ignore[arg-type]
        received = checkpoint.receive_state(0, None, torch.device(device))  # type: ignore[arg-type]
    tensors = [v for entry in state.values() for v in entry.values() if isinstance(v, torch.Tensor)]
    total = sum(t.numel() * t.element_size() for t in tensors)
    assert len(wire.sent) == -(-total // staging_bytes) and not wire.messages and not wire.objects
    # both ends name the comm device: on "cpu:gloo,cuda:nccl" the group's default would be gloo's CPU on one side
    assert wire.object_devices == [torch.device(device)] * 2
    assert all(message.numel() <= staging_bytes for message in wire.sent)
    assert len({message.untyped_storage().data_ptr() for message in wire.sent}) == 1  # one staging buffer, reused
    assert list(received) == list(state) and received[3]["note"] == "as is"
    for index, entry in state.items():
        assert list(received[index]) == list(entry)
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                got = received[index][key]
                assert got.device.type == "cpu" and got.dtype == value.dtype, (index, key)
                assert torch.equal(got, value.cpu()), (index, key)


def test_elementwise_optimizers_are_exact_classes() -> None:
    class MyAdam(torch.optim.Adam):
        pass

    assert all(is_elementwise(cls) for cls in (torch.optim.Adam, torch.optim.NAdam, torch.optim.SGD, FunctionalAdamW))
    assert not is_elementwise(MyAdam) and not is_elementwise(torch.optim.LBFGS)


def _load_checks_body(rank: int, world_size: int) -> None:
    ours, plain, other = make_params(), make_params(), make_params()
    zero = ZeroRedundancyOptimizer(_groups(ours), torch.optim.AdamW, **KWARGS)
    reference = torch.optim.AdamW(_groups(plain), **KWARGS)
    sgd = torch.optim.SGD(_groups(other), lr=0.1, momentum=0.9)
    _train([zero, reference, sgd], [flatten(ours), flatten(plain), flatten(other)], rank, range(2))
    good = reference.state_dict()

    # Checked at load, on every rank alike: a dict saved by another optimizer class ...
    with pytest.raises(ValueError, match=r"no 'amsgrad', 'betas', 'eps', which AdamW needs.*different optimizer class"):
        zero.load_state_dict(sgd.state_dict())
    # ... and a state tensor of another shape, on a parameter only the last rank owns (the others raise too).
    index = max(i for i, owner in enumerate(zero.plan.owners) if owner == world_size - 1)
    bad = copy.deepcopy(good)
    bad["state"][index]["exp_avg"] = bad["state"][index]["exp_avg"].unsqueeze(0)
    shapes = tuple(bad["state"][index]["exp_avg"].shape), tuple(flatten(ours)[index].shape)
    pattern = rf"state\[{index}\]\['exp_avg'\] .* shape {re.escape(str(shapes[0]))} but parameter {index} has shape "
    with pytest.raises(ValueError, match=pattern + re.escape(str(shapes[1]))):
        zero.load_state_dict(bad)
    # Refused dicts changed nothing: a good one loads and training stays in lockstep with the reference.
    zero.load_state_dict(good)
    _train([zero, reference], [flatten(ours), flatten(plain)], rank, range(2, 3))
    assert_same_tensors(flatten(ours), flatten(plain), "after refused loads")

    # The four state-dict hooks run as in torch.optim: what they get, what a returned dict replaces.
    calls: list[Any] = []
    zero.register_state_dict_pre_hook(lambda opt: calls.append(("save-pre", opt is zero)))
    zero.register_state_dict_post_hook(lambda opt, saved: {**saved, "extra": "from the post-hook"})
    zero.register_load_state_dict_pre_hook(lambda opt, saved: calls.append(("load-pre", saved.pop("extra", None))))
    zero.register_load_state_dict_pre_hook(
        lambda opt, saved: {**saved, "param_groups": [{**g, "lr": 0.123} for g in saved["param_groups"]]}
    )
    zero.register_load_state_dict_post_hook(
        lambda opt: calls.append(("load-post", opt.param_groups[1]["lr"], opt.local_optimizer.param_groups[1]["lr"]))
    )
    zero.consolidate_state_dict(to=0)
    saved = zero.state_dict() if rank == 0 else {**good, "extra": "from the post-hook"}
    assert saved["extra"] == "from the post-hook"
    zero.load_state_dict(saved)
    assert saved["extra"] == "from the post-hook"  # pre-hooks get a shallow copy: the caller's dict is untouched
    expected = [("load-pre", "from the post-hook"), ("load-post", 0.123, 0.123)]
    assert calls == ([("save-pre", True)] if rank == 0 else []) + expected, calls


def test_load_checks_the_whole_dict_on_every_rank_and_runs_state_dict_hooks() -> None:
    run_on_ranks(_load_checks_body, 2)
