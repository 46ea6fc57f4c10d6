"""ShardedDataParallel beyond plain training: no parameter read while its sync is in flight, gradient memory of 1/N
plus the buckets in flight, GradScaler, checkpoints that resume bit for bit, add_param_group and unfreezing,
torch.compile, hybrid sharding; each against DDP + the plain optimizer or an uninterrupted run."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.overrides import TorchFunctionMode

from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer, checkpoint
from distoptim.sharded_data_parallel.sync import BucketedSync
from tests._dist import run_on_ranks
from tests.sharded_data_parallel.test_hard_cases import _step_both
from tests.sharded_data_parallel.test_parity import KWARGS, Model, assert_matches, batch, groups


def _build(
    partition: str = "even", bucket_view: bool = True, overlap: bool = True, **sdp: Any
) -> tuple[Model, ZeroRedundancyOptimizer, ShardedDataParallel]:
    model = Model()
    zero = ZeroRedundancyOptimizer(
        groups(model), torch.optim.AdamW, partition=partition, parameters_as_bucket_view=bucket_view, **KWARGS
    )
    return model, zero, ShardedDataParallel(model, zero, bucket_cap_mb=0.001, overlap_param_sync=overlap, **sdp)


def _train(sdp: ShardedDataParallel, zero: ZeroRedundancyOptimizer, rank: int, steps: range) -> None:
    for step in steps:
        zero.zero_grad()
        sdp(*batch(rank, step, 0), step, rank).square().mean().backward()
        zero.step()


class _InFlightReads(TorchFunctionMode):
    """Records every torch function that reads a parameter whose bucket's sync is still in flight (its metadata,
    ``.dtype`` or ``.shape``, is not its values: attribute reads are let through)."""

    def __init__(self, sync: BucketedSync) -> None:
        super().__init__()
        self.sync, self.reads = sync, []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        reads_values = getattr(func, "__name__", "") != "__get__"
        for value in itertools.chain(args, (kwargs or {}).values()) if reads_values else ():
            unit = self.sync.unit_of.get(id(value))
            if unit is not None and self.sync.in_flight(unit):
                self.reads.append(f"{getattr(func, '__name__', func)} read a parameter of bucket {unit} in flight")
        return func(*args, **(kwargs or {}))


def _in_flight_body(rank: int, world_size: int) -> None:
    for partition, bucket_view in itertools.product(["greedy", "even"], [False, True]):
        model, zero, sdp = _build(partition, bucket_view)
        _train(sdp, zero, rank, range(1))
        sync = zero.placer.sync
        assert isinstance(sync, BucketedSync) and len(sync.units) > 3 and sync.in_flight(0)  # every bucket in flight
        first_landed: list[int] = []
        model.embed.register_forward_pre_hook(
            lambda module, args, s=sync, seen=first_landed: seen.append(sum(map(s.in_flight, range(len(s.units)))))
        )
        with _InFlightReads(sync) as mode:
            sdp(*batch(rank, 1, 0), 1, rank).square().mean().backward()
        assert not mode.reads, mode.reads
        assert first_landed[0] > 0, "the sync was over before the forward began: nothing overlapped"
        zero.step()  # everything else that reads parameters waits first: state_dict, consolidation, step
        last = len(sync.units) - 1
        assert sync.in_flight(last) and sdp.state_dict() and not sync.in_flight(last)
        zero.step()
        zero.consolidate_state_dict()
        assert not sync.in_flight(last)


def test_no_parameter_is_read_while_its_sync_is_in_flight() -> None:
    run_on_ranks(_in_flight_body, 2)


def _memory_body(rank: int, world_size: int) -> list[tuple[str, int, int, int]]:
    results = []
    for partition, reduce_dtype in itertools.product(["greedy", "even"], [None, torch.float32]):
        model, zero, sdp = _build(partition, reduce_dtype=reduce_dtype)
        gradients = sdp.gradients
        assert gradients is not None
        peak = [0]
        original = gradients._buffer

        def measured(
            bucket: int,
            gradient: torch.Tensor | None = None,
            original: Any = original,
            gradients: Any = gradients,
            peak: Any = peak,
        ) -> torch.Tensor:
            buffer = original(bucket, gradient)
            held = sum(b.numel() * b.element_size() for b in gradients._buffers.values())
            held += sum(b.numel() * b.element_size() for _, b, _ in gradients._in_flight)
            peak[0] = max(peak[0], held)
            return buffer

        gradients._buffer = measured  # type: ignore[method-assign]
        for step in range(2):  # every parameter used on every rank: the buckets fill in order
            zero.zero_grad()
            sdp(*batch(rank, step, 0), 1, 0).square().mean().backward()
            zero.step()
        sdp.sync_finished()  # the end of training: no rank destroys its group with a peer's sync still coming
        size = (reduce_dtype or torch.float32).itemsize
        full = sum(p.numel() * (size if p.dtype == torch.float32 or reduce_dtype else 2) for p in groups_of(zero))
        owned = sum(t.numel() * t.element_size() for t in gradients.owned if t is not None)
        # what .grad holds (the store's markers: one element of storage each)
        stray = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
        cap = max(b.numel for b in gradients.buckets) * size
        results.append((f"{partition} reduce_dtype={reduce_dtype}", owned + stray, full, cap, peak[0]))
    return results


def groups_of(zero: ZeroRedundancyOptimizer) -> list[torch.Tensor]:
    return [p for p in zero.global_params if p.requires_grad]


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_rank_holds_its_share_of_the_gradient_plus_two_buckets(world_size: int) -> None:
    """After the backward, the owned gradient only; during it, at most two buckets at once, when the buckets fill in
    order (a parameter this rank does not use holds back the launches after its bucket until the backward ends)."""
    for results in run_on_ranks(_memory_body, world_size):
        for what, held, full, cap, peak in results:
            assert held <= full / world_size + 2 * cap, f"{what}: {held} bytes held after the backward, of {full}"
            assert peak <= 2 * cap, f"{what}: {peak} bytes of buckets at once (cap {cap})"


def _wrapping_body(rank: int, world_size: int) -> None:
    """Wrapping re-cuts ZeRO's even partition into buckets: the parameters move within ZeRO's bucket-view buffers,
    not into a second copy of the model, and every rank then holds rank 0's values (the ranks start apart)."""
    model = Model()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(rank)
    zero = ZeroRedundancyOptimizer(groups(model), torch.optim.AdamW, partition="even", parameters_as_bucket_view=True)
    storages = {key: a.untyped_storage().data_ptr() for key, a in zero.placer.sync.allocations().items()}
    ShardedDataParallel(model, zero, bucket_cap_mb=0.001)
    assert {key: a.untyped_storage().data_ptr() for key, a in zero.placer.sync.allocations().items()} == storages
    assert all(param.untyped_storage().data_ptr() in storages.values() for param in groups_of(zero))
    for param, reference in zip(model.parameters(), Model().parameters()):
        assert torch.equal(param, reference), "every rank holds rank 0's values"


def test_wrapping_moves_the_parameters_in_place() -> None:
    run_on_ranks(_wrapping_body, 3)


def _scaler_body(rank: int, world_size: int) -> list[float]:
    """An inf on rank 0 in an element rank 1 owns: every rank skips that step and keeps the same scale."""
    model, zero, sdp = _build("even")
    reference = Model()
    ddp, plain = DDP(reference, find_unused_parameters=True), torch.optim.AdamW(groups(reference), **KWARGS)
    scaler, by_hand_scale = torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=1), 64.0
    target = model.body.weight
    at = next(f.offset for f in zero.fragments_of(target) if f.rank == 1)
    scales = []
    for step in range(3):
        poison = step == 1 and rank == 0
        handle = (
            target.register_hook(
                lambda g, at=at: g.flatten().index_fill(0, torch.tensor([at]), float("inf")).view_as(g)
            )
            if poison
            else None
        )
        zero.zero_grad()
        scaler.scale(sdp(*batch(rank, step, 0), step, rank).square().mean()).backward()
        zero.clip_grad_norm_(1.0, grad_scale=scaler.get_scale())
        scaler.step(zero)
        scaler.update()
        if handle is not None:
            handle.remove()
        plain.zero_grad()
        (ddp(*batch(rank, step, 0), step, rank).square().mean() * by_hand_scale).backward()
        grads = [p.grad for p in reference.parameters() if p.grad is not None]
        torch._foreach_div_(grads, by_hand_scale)
        if step != 1:
            norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
            )
            torch._foreach_mul_(grads, torch.clamp(1.0 / (norm + 1e-6), max=1.0))
            plain.step()
        by_hand_scale = by_hand_scale / 2 if step == 1 else by_hand_scale * 2
        scales.append(scaler.get_scale())
        assert scaler.get_scale() == by_hand_scale, (step, scaler.get_scale(), by_hand_scale)
        sdp.sync_finished()
        assert_matches(model, reference, f"step {step}", align=False)
    zero.zero_grad()
    scaler.scale(sdp(*batch(rank, 5, 0), 5, rank).square().mean()).backward()
    with pytest.raises(RuntimeError, match=r"drive a GradScaler with scaler\.step\(zero\) \(without scaler\.unscale_"):
        scaler.unscale_(zero)  # .grad holds the store's markers: refused where it is called
    return scales


def test_grad_scaler_skips_the_same_steps_on_every_rank() -> None:
    scales = run_on_ranks(_scaler_body, 2)
    assert scales[0] == scales[1]


def _checkpoint_body(rank: int, world_size: int, directory: str, kind: str, partition: str) -> None:
    model, zero, sdp = _build(partition)
    _train(sdp, zero, rank, range(2))
    if kind == "sharded":
        checkpoint.save({"model": sdp.state_dict(), "optim": zero.sharded_state_dict()}, directory)
    else:
        zero.consolidate_state_dict(to=0)
        saved = [sdp.state_dict(), zero.state_dict() if rank == 0 else None]
        torch.save(saved, Path(directory) / f"rank{rank}.pt")
    _train(sdp, zero, rank, range(2, 4))
    sdp.sync_finished()
    uninterrupted = [p.detach().clone() for p in model.parameters()]

    model, zero, sdp = _build(partition)
    if kind == "sharded":
        state = {"model": sdp.state_dict(), "optim": zero.sharded_state_dict()}
        checkpoint.load(state, directory)
        sdp.load_state_dict(state["model"])
        zero.load_sharded_state_dict(state["optim"])
    else:
        dist.barrier()
        model_state, _ = torch.load(Path(directory) / f"rank{rank}.pt", weights_only=False)
        _, optim_state = torch.load(Path(directory) / "rank0.pt", weights_only=False)
        sdp.load_state_dict(model_state)
        zero.load_state_dict(optim_state)
    _train(sdp, zero, rank, range(2, 4))
    sdp.sync_finished()
    for index, (ours, want) in enumerate(zip(model.parameters(), uninterrupted)):
        assert torch.equal(ours, want), f"{kind} {partition}: parameter {index} differs after the resume"


@pytest.mark.parametrize(
    ("kind", "partition"), [("sharded", "even"), ("consolidated", "greedy"), ("sharded", "greedy")]
)
def test_checkpoints_resume_bit_for_bit(tmp_path: Path, kind: str, partition: str) -> None:
    run_on_ranks(_checkpoint_body, 2, str(tmp_path), kind, partition, timeout=120)


def _growth_body(rank: int, world_size: int, way: str) -> None:
    """A layer left out at first: added with add_param_group, or unfrozen, after two steps (DDP is built before the
    reference layer is frozen: it leaves out for good what is frozen when it is built)."""
    model, reference = Model(), Model()
    ddp = DDP(reference, find_unused_parameters=True)
    for net in (model, reference):
        net.rank0.requires_grad_(False)
    late = list(model.rank0.parameters())
    zero = ZeroRedundancyOptimizer(groups(model), torch.optim.AdamW, partition="even", **KWARGS)
    if way == "unfreeze":
        zero.add_param_group({"params": late})  # held from the start, frozen
    sdp = ShardedDataParallel(model, zero, bucket_cap_mb=0.001)
    plain = torch.optim.AdamW(groups(reference), **KWARGS)
    for step in range(5):
        if step == 2:
            for net in (model, reference):
                net.rank0.requires_grad_(True)
            if way == "add_param_group":
                zero.add_param_group({"params": late})
            plain.add_param_group({"params": list(reference.rank0.parameters())})
        zero.zero_grad()
        sdp(*batch(rank, step, 0), step, rank).square().mean().backward()
        zero.step()
        plain.zero_grad()
        ddp(*batch(rank, step, 0), step, rank).square().mean().backward()
        plain.step()
        sdp.sync_finished()
        assert_matches(model, reference, f"{way} step {step}")


@pytest.mark.parametrize("way", ["add_param_group", "unfreeze"])
def test_a_layer_joining_training_later_matches_ddp(way: str) -> None:
    run_on_ranks(_growth_body, 2, way)


def _compile_body(rank: int, world_size: int) -> None:
    model = Model()
    zero = ZeroRedundancyOptimizer(groups(model), torch.optim.AdamW, partition="even", **KWARGS)
    sdp = ShardedDataParallel(torch.compile(model, backend="aot_eager"), zero, bucket_cap_mb=0.001)
    reference = Model()
    ddp, plain = DDP(reference, find_unused_parameters=True), torch.optim.AdamW(groups(reference), **KWARGS)
    for step in range(3):
        zero.zero_grad()
        sdp(*batch(rank, step, 0), step, rank).square().mean().backward()
        zero.step()
        plain.zero_grad()
        ddp(*batch(rank, step, 0), step, rank).square().mean().backward()
        plain.step()
        sdp.sync_finished()
        assert_matches(model, reference, f"compiled step {step}")


def test_a_compiled_module_trains_as_eager_ddp() -> None:
    run_on_ranks(_compile_body, 2, timeout=240)


def _hybrid_body(rank: int, world_size: int) -> None:
    """Shard groups {0, 1} and {2, 3}, replicated; in fp32: a bf16 weight's first AdamW update is +-lr by its
    gradient's sign, which four ranks' bf16 sums added in another order may flip where the gradient is near zero."""
    shards = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    model, reference = Model().float(), Model().float()  # fp32: see the docstring
    zero = ZeroRedundancyOptimizer(
        groups(model),
        torch.optim.AdamW,
        process_group=shards[rank // 2],
        replicate_group=replicas[rank % 2],
        partition="even",
        **KWARGS,
    )
    sdp = ShardedDataParallel(model, zero, bucket_cap_mb=0.001)
    ddp, plain = DDP(reference, find_unused_parameters=True), torch.optim.AdamW(groups(reference), **KWARGS)
    for step in range(3):
        zero.zero_grad()
        sdp(*batch(rank, step, 0), step, rank).square().mean().backward()
        zero.step()
        plain.zero_grad()
        ddp(*batch(rank, step, 0), step, rank).square().mean().backward()
        plain.step()
        sdp.sync_finished()
        for (name, ours), want in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(ours, want, rtol=1e-5, atol=2e-6, msg=f"hybrid step {step} {name}")
        with torch.no_grad():
            for ours, want in zip(model.parameters(), reference.parameters()):
                want.copy_(ours)


def test_hybrid_sharding_matches_ddp_on_every_rank() -> None:
    run_on_ranks(_hybrid_body, 4, timeout=120)


def _model_zero_grad_body(rank: int, world_size: int) -> None:
    """Clearing through the model (as the Hugging Face Trainer does) clears the owned gradient too: else the next
    backward would add to the last step's."""
    model, zero, sdp = _build("even")
    reference = Model()
    ddp, plain = DDP(reference, find_unused_parameters=True), torch.optim.AdamW(groups(reference), **KWARGS)
    for step in range(3):
        sdp.zero_grad()
        sdp(*batch(rank, step, 0), step, rank).square().mean().backward()
        zero.step()
        sdp.to("cpu")  # a conversion while the sync is in flight sees synced values (on the CPU already: a no-op)
        plain.zero_grad()
        ddp(*batch(rank, step, 0), step, rank).square().mean().backward()
        plain.step()
        assert_matches(model, reference, f"step {step}")


def test_zero_grad_through_the_model_clears_the_owned_gradient() -> None:
    run_on_ranks(_model_zero_grad_body, 2)


def _added_first_body(rank: int, world_size: int, partition: str) -> None:
    """A layer added with add_param_group that the forward runs first gets its forward pre-hook: its parameters'
    sync lands before it reads them. Each forward's loss against DDP's (no sync_finished() between steps: the
    parameter sync is still in flight when the next forward begins)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(6, 6) for _ in range(3)))
    reference = torch.nn.Sequential(*(torch.nn.Linear(6, 6) for _ in range(3)))
    reference.load_state_dict(model.state_dict())
    ddp = DDP(reference, find_unused_parameters=True)
    for net in (model, reference):
        net[0].requires_grad_(False)
    zero = ZeroRedundancyOptimizer(list(model[1:].parameters()), torch.optim.AdamW, partition=partition, **KWARGS)
    sdp = ShardedDataParallel(model, zero, bucket_cap_mb=0.0001)
    plain = torch.optim.AdamW(reference[1:].parameters(), **KWARGS)
    for step in range(4):
        if step == 1:
            for net in (model, reference):
                net[0].requires_grad_(True)
            zero.add_param_group({"params": list(model[0].parameters())})
            plain.add_param_group({"params": list(reference[0].parameters())})
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        _step_both(zero, sdp, plain, ddp, x, f"step {step}")


@pytest.mark.parametrize("partition", ["greedy", "even"])
def test_a_layer_added_later_lands_its_parameters_before_its_forward(partition: str) -> None:
    run_on_ranks(_added_first_body, 2, partition)


class _Tail(torch.nn.Module):
    """Six layers; rank 0 runs them all, the others the first two."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers, self.used = torch.nn.Sequential(*(torch.nn.Linear(6, 6) for _ in range(6))), 6 if rank == 0 else 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[: self.used]:
            x = torch.tanh(layer(x))
        return x


def _tail_body(rank: int, world_size: int, partition: str) -> None:
    """Layers at the end of the model that only rank 0 runs: its forward pre-hooks land their buckets and so launch
    the sync's later buckets, which the other rank launches only when it finishes the sync; that must happen before
    the backward's first collective, or the ranks issue collectives in different orders (a hang)."""
    model, reference = _Tail(rank), _Tail(rank)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, partition=partition, **KWARGS)
    sdp = ShardedDataParallel(model, zero, bucket_cap_mb=0.0001)
    inputs = [torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank)) for step in range(3)]
    for x in inputs:  # SDP alone: no other collective between its own
        zero.zero_grad()
        sdp(x).square().mean().backward()
        zero.step()
    sdp.sync_finished()
    ddp, plain = DDP(reference, find_unused_parameters=True), torch.optim.AdamW(reference.parameters(), **KWARGS)
    for x in inputs:
        plain.zero_grad()
        ddp(x).square().mean().backward()
        plain.step()
    for (name, ours), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{partition} {n}: {m}")


@pytest.mark.parametrize("partition", ["greedy", "even"])
def test_layers_only_one_rank_runs_at_the_end_of_the_forward(partition: str) -> None:
    run_on_ranks(_tail_body, 2, partition, timeout=60)
