"""What a steady-state iteration costs, counted rather than timed: the elements each mode hands to the collectives,
in both styles (gloo's point-to-point calls and NCCL's equal-chunk ones, run here on gloo), and the host reads of tensor
values that the hot path makes (on a GPU each one stalls the CPU until the device has drained its queue).

Elements are counted by wrapping ``torch.distributed``'s functions: a reduce or a broadcast hands over its tensor, a
reduce-scatter its whole input, an all-gather its whole output; the control plane's int64 agreements are left out.
A step of every mode that reduces to owners hands the gradient reduction at most 1.01x the gradient's elements and
the parameter sync at most 1.01x the parameters' (no padding to N times a share), at 2, 3 and 4 ranks. In the
point-to-point style (gloo's) an ``isend`` hands over its tensor (a reduction's by its tag, else the sync's): over
the N ranks, each sends every element it does not own once and every element it owns N-1 times, so each of the two
sums to N-1 times the elements, at most 1.01x that. Per rank, the overlap hooks' sync moves what the explicit step's
does, and under greedy shares no mode's rank moves more than 1.05x an all-reduce's bytes.

Host reads are counted two ways: the reasons ``distoptim._host.read`` records, and every ``item``/``tolist``/
``bool``/``float``/``int`` of a tensor called from distoptim's own code anywhere else (which must be none, but for
the control plane's CPU tensors in ``_agreement`` and ``_objects``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distoptim
from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer, _host
from distoptim.comm import collectives as comm
from distoptim.comm import p2p
from tests._dist import run_on_ranks
from tests.zero._hooks import register

SOURCE = Path(distoptim.__file__).parent
CONTROL_PLANE = {SOURCE / "comm/agreement.py", SOURCE / "comm/objects.py", SOURCE / "_host.py"}
# name -> which argument is handed over (torch 2.13 renamed the equal-chunk pair: both names, where they exist)
REDUCTIONS = {"reduce": 0, "reduce_scatter_tensor": 1, "reduce_scatter_single": 1, "all_reduce": 0}
SYNCS = {"broadcast": 0, "all_gather_into_tensor": 0, "all_gather_single": 0}


class _Net(nn.Module):
    """A channels_last convolution, fp32 and bf16 layers (a few thousand elements, so that the even partition's
    padding, at most N-1 elements a layout, stays under 1%)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
        self.body = nn.Linear(128, 48)
        self.head = nn.Linear(48, 24).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x.contiguous(memory_format=torch.channels_last))).flatten(1)
        return self.head(torch.tanh(self.body(h)).to(torch.bfloat16)).float()


def _batch(rank: int, iteration: int) -> torch.Tensor:
    return torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(100 * iteration + rank))


@contextlib.contextmanager
def _counting_elements(handed: Counter[str]) -> Iterator[None]:
    """Count the float elements handed to each kind of collective (``handed["reduction"]``, ``handed["sync"]``)."""

    def wrapper(name: str, kind: str, argument: int) -> Any:
        original = getattr(dist, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            tensor = args[argument]
            if tensor.is_floating_point():
                handed[kind] += tensor.numel()
            return original(*args, **kwargs)

        return mock.patch.object(dist, name, counted)

    def sent(*args: Any, **kwargs: Any) -> Any:
        tensor = args[0]
        if tensor.is_floating_point():
            handed["reduction" if kwargs["tag"] >= p2p.FIRST_REDUCTION_TAG else "sync"] += tensor.numel()
        return isend(*args, **kwargs)

    isend = dist.isend
    patches = [wrapper(name, "reduction", argument) for name, argument in REDUCTIONS.items() if hasattr(dist, name)]
    patches += [wrapper(name, "sync", argument) for name, argument in SYNCS.items() if hasattr(dist, name)]
    patches.append(mock.patch.object(dist, "isend", sent))
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


@contextlib.contextmanager
def _counting_host_reads(stray: list[str]) -> Iterator[None]:
    """Record every read of a tensor value called from distoptim's code outside the one door (``_host.read``) and
    the control plane."""
    methods = ["item", "tolist", "__bool__", "__float__", "__int__", "__index__"]
    originals = {name: getattr(torch.Tensor, name) for name in methods}

    def wrapped(name: str) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code.co_filename
            if Path(caller).is_relative_to(SOURCE) and Path(caller) not in CONTROL_PLANE:
                stray.append(f"{name} from {caller}:{sys._getframe(1).f_lineno}")
            return originals[name](self, *args, **kwargs)

        return read

    try:
        for name in methods:
            setattr(torch.Tensor, name, wrapped(name))
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _iteration(ddp: DDP, zero: Any, rank: int, iteration: int, stepping: str, scaler: Any = None) -> None:
    zero.zero_grad()
    loss = ddp(_batch(rank, iteration)).square().mean()
    (loss if scaler is None else scaler.scale(loss)).backward()
    if stepping == "explicit" and scaler is not None:
        scaler.step(zero)
        scaler.update()
    elif stepping == "explicit":
        zero.step()


def _bytes_body(rank: int, world_size: int) -> list[tuple[str, int, int, int]]:
    """For every mode that reduces to owners: (mode, reduction elements, sync elements, trainable elements)."""
    results = []
    for partition, bucket_view, overlap, style in itertools.product(
        ["greedy", "even"], [False, True], [False, True], list(comm.Collectives)
    ):
        os.environ[comm.ENVIRONMENT] = style.value
        model = _Net()
        zero = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.SGD, parameters_as_bucket_view=bucket_view, partition=partition, lr=0.1
        )
        sdp = ShardedDataParallel(model, zero, bucket_cap_mb=0.004, overlap_param_sync=overlap)
        _iteration(sdp, zero, rank, 0, "explicit")
        sdp.sync_finished()  # the first step's sync, which the next forward would otherwise finish in the count
        handed = Counter()
        with _counting_elements(handed):
            _iteration(sdp, zero, rank, 1, "explicit")
            sdp.sync_finished()
        mode = f"SDP {partition} bucket_view={bucket_view} overlap={overlap} {style.value} world={world_size}"
        results.append((mode, handed["reduction"], handed["sync"], sum(p.numel() for p in model.parameters())))
    os.environ.pop(comm.ENVIRONMENT)
    return results


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_mode_that_reduces_to_owners_hands_over_no_padding(world_size: int) -> None:
    ranks = run_on_ranks(_bytes_body, world_size, timeout=240)
    for by_rank in zip(*ranks):
        mode, _, _, elements = by_rank[0]
        reduced, synced = (sum(result[column] for result in by_rank) for column in (1, 2))
        if comm.Collectives.POINT_TO_POINT.value in mode.split():  # sums over the ranks: N-1 times the elements
            reduced, synced = reduced / (world_size - 1), synced / (world_size - 1)
        else:  # every rank hands over every element
            reduced, synced = reduced / world_size, synced / world_size
        assert elements <= reduced <= 1.01 * elements, f"{mode}: reduction {reduced} for {elements} elements"
        assert elements <= synced <= 1.01 * elements, f"{mode}: sync {synced} for {elements} elements"


class _Embedded(nn.Module):
    """A large embedding (57% of the elements) before a few small layers: the greedy partition gives its owner a
    shard far above 1/N, as it gives a language model's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(100, 32)
        self.body = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(tokens).mean(1))


@contextlib.contextmanager
def _counting_bytes(moved: Counter[str]) -> Iterator[None]:
    """Floating-point bytes this rank sends and receives point to point, by phase (``moved["reduction sent"]``,
    ``moved["sync received"]``, ...: a reduction's messages by their tags), in any thread; any other collective
    of floating-point data under ``moved["other"]``."""
    lock = threading.Lock()

    def counted(original: Any, direction: str) -> Any:
        def call(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if tensor.is_floating_point():
                phase = "reduction" if kwargs.get("tag", 0) >= p2p.FIRST_REDUCTION_TAG else "sync"
                with lock:
                    moved[f"{phase} {direction}"] += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)

        return call

    def other(original: Any) -> Any:
        def call(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                moved["other"] += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)

        return call

    patches = [
        mock.patch.object(dist, "isend", counted(dist.isend, "sent")),
        mock.patch.object(dist, "irecv", counted(dist.irecv, "received")),
    ]
    patches += [mock.patch.object(dist, name, other(getattr(dist, name))) for name in [*REDUCTIONS, *SYNCS]]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


def _greedy_bytes_body(rank: int, world_size: int) -> list[tuple[str, dict[str, int], int]]:
    """Per mode: (mode, the bytes this rank moved in a steady-state iteration, the gradient's bytes)."""
    os.environ[comm.ENVIRONMENT] = comm.Collectives.POINT_TO_POINT.value
    results = []
    for mode in ("sharded_data_parallel", "zero1"):
        model = _Embedded()
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, partition="greedy", lr=0.1)
        if mode == "sharded_data_parallel":
            net: Any = ShardedDataParallel(model, zero, bucket_cap_mb=0.004)
        else:
            net = DDP(model, bucket_cap_mb=0.004)
        moved: Counter[str] = Counter()
        for iteration in range(2):  # DDP rebuilds its buckets after the first
            with _counting_bytes(moved) if iteration == 1 else contextlib.nullcontext():
                zero.zero_grad()
                tokens = torch.randint(0, 100, (4, 5), generator=torch.Generator().manual_seed(10 * iteration + rank))
                net(tokens).square().mean().backward()
                zero.step()
                zero.sync_finished()
        results.append((mode, dict(moved), sum(p.numel() * p.element_size() for p in model.parameters())))
    os.environ.pop(comm.ENVIRONMENT)
    return results


@pytest.mark.parametrize("world_size", [3, 4])
def test_no_rank_moves_more_than_an_all_reduce_under_greedy_shares(world_size: int) -> None:
    """gloo's point-to-point style under the greedy partition, whose largest shard (the embedding's) is 57% of the
    elements: every rank sends and receives at most 1.05x an all-reduce's bytes in the reduction, in the sync and in
    the two together (directly, the embedding's owner would receive (N-1) x 57% of the gradient)."""
    ranks = run_on_ranks(_greedy_bytes_body, world_size, timeout=240)
    wrong = []
    for rank, results in enumerate(ranks):
        for mode, moved, nbytes in results:
            bound = 1.05 * 2 * (world_size - 1) / world_size * nbytes
            phases = ("sync",) if mode == "zero1" else ("reduction", "sync")
            assert moved.get("other", 0) == 0, f"{mode}: data moved outside the point-to-point calls: {moved}"
            assert sum(moved.get(f"{phase} received", 0) for phase in phases) > 0, f"{mode}: nothing counted"
            for direction in ("sent", "received"):
                step = sum(moved.get(f"{phase} {direction}", 0) for phase in phases)
                if step > bound:
                    wrong.append(f"rank {rank} {mode}: {direction} {step} B a step, 1.05x an all-reduce {bound:.0f} B")
    assert not wrong, "\n".join(wrong)


def _sync_per_rank_body(rank: int, world_size: int) -> list[tuple[str, tuple[int, int]]]:
    """Per (partition, stepping): the parameter sync's (sent, received) bytes on this rank in a steady-state step,
    point to point, with gradients all-reduced."""
    os.environ[comm.ENVIRONMENT] = comm.Collectives.POINT_TO_POINT.value
    results = []
    for partition, stepping in itertools.product(["greedy", "even"], ["explicit", "hook", "interleaved"]):
        model = _Net()
        ddp = DDP(model, bucket_cap_mb=0.004)
        zero = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.SGD, overlap_with_ddp=stepping != "explicit", partition=partition, lr=0.1
        )
        register(ddp, zero, "all_reduce", stepping)
        moved: Counter[str] = Counter()
        for iteration in range(2):  # DDP rebuilds its buckets after the first
            with _counting_bytes(moved) if iteration == 1 else contextlib.nullcontext():
                _iteration(ddp, zero, rank, iteration, stepping)
                zero.sync_finished()
        results.append((f"{partition} {stepping}", (moved["sync sent"], moved["sync received"])))
    os.environ.pop(comm.ENVIRONMENT)
    return results


@pytest.mark.parametrize("world_size", [3, 4])
def test_overlap_hooks_sync_no_more_than_an_explicit_step(world_size: int) -> None:
    """On every rank, the overlap hooks' parameter sync sends and receives what the explicit step's sync does (the
    interleaved hook syncs bucket by bucket: deciding the relay per bucket, a rank sent 1.02x that)."""
    wrong = []
    for rank, results in enumerate(run_on_ranks(_sync_per_rank_body, world_size, timeout=240)):
        by_mode = dict(results)
        for mode, moved in by_mode.items():
            explicit = by_mode[f"{mode.split()[0]} explicit"]
            assert min(explicit) > 0, f"{mode}: nothing counted"
            for direction, got, want in zip(("sent", "received"), moved, explicit):
                if got > 1.001 * want:
                    wrong.append(f"rank {rank} {mode}: {direction} {got} B, the explicit step's sync {want} B")
    assert not wrong, "\n".join(wrong)


# (reduction, stepping, DDP looks for unused parameters, GradScaler) -> host reads per steady-state iteration
EXPECTED_READS = {
    **{
        (reduction, stepping, False, False): {}
        for reduction in ("all_reduce",)
        for stepping in ("explicit", "hook", "interleaved")
    },
    ("all_reduce", "explicit", False, True): {"GradScaler's skip decision": 1},
    ("all_reduce", "explicit", True, False): {},
    # the overlap hooks step a parameter no rank used as a plain optimizer would (not at all): they must know which
    ("all_reduce", "hook", True, False): {"which parameters some rank used": 1},
    ("all_reduce", "interleaved", True, False): {"which parameters some rank used": "buckets"},
    # ShardedDataParallel: which parameters some rank used, an int32 all-reduce at the backward's end (as DDP with
    # find_unused_parameters=True reads its used map each backward); with the sync overlapped (the default), whether
    # a write while it was in flight changed an owned element (sharded_data_parallel/sync.py)
    ("sharded", "explicit", False, False): {
        "which parameters some rank used": 1,
        "writes to parameters while their sync was in flight": 1,
    },
    ("sharded", "explicit", False, True): {
        "GradScaler's skip decision": 1,
        "which parameters some rank used": 1,
        "writes to parameters while their sync was in flight": 1,
    },
    # static_graph=True: no used flags after the first backward; the inf/nan sum read by the step, not the backward
    ("sharded_static", "explicit", False, True): {
        "GradScaler's skip decision": 1,
        "the summed inf/nan verdict": 1,
        "writes to parameters while their sync was in flight": 1,
    },
}


def _reads_body(rank: int, world_size: int) -> list[tuple[str, dict[str, int], int, list[str]]]:
    results = []
    for (reduction, stepping, unused, scaled), partition, bucket_view in itertools.product(
        EXPECTED_READS, ["greedy", "even"], [False, True]
    ):
        model = _Net()
        zero = ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            parameters_as_bucket_view=bucket_view,
            overlap_with_ddp=stepping != "explicit",
            partition=partition,
            lr=0.01,
        )
        if reduction.startswith("sharded"):
            static = reduction == "sharded_static"
            ddp: Any = ShardedDataParallel(
                model, zero, bucket_cap_mb=0.004, overlap_param_sync=True, static_graph=static
            )
        else:
            ddp = DDP(model, bucket_cap_mb=0.004, find_unused_parameters=unused)
            register(ddp, zero, reduction, stepping)
        scaler = torch.amp.GradScaler("cpu") if scaled else None
        for iteration in range(2):  # the first iteration builds what later ones reuse
            _iteration(ddp, zero, rank, iteration, stepping, scaler)
        before, stray = Counter(_host.READS), []
        with _counting_host_reads(stray):
            _iteration(ddp, zero, rank, 2, stepping, scaler)
        reads = {why: count for why, count in (Counter(_host.READS) - before).items()}
        key = f"{reduction} {stepping} unused={unused} scaler={scaled} {partition} bucket_view={bucket_view}"
        buckets = len(ddp.reducer._get_zeros_like_grad_buckets()) if isinstance(ddp, DDP) else 0
        results.append((key, reads, buckets, stray))
    return results


def test_host_reads_per_iteration_in_every_mode() -> None:
    expected = list(itertools.product(EXPECTED_READS.values(), [0, 1], [0, 1]))
    for results in run_on_ranks(_reads_body, 2, timeout=240):
        for (key, reads, buckets, stray), (want, _, _) in zip(results, expected):
            want = {why: buckets if count == "buckets" else count for why, count in want.items()}
            assert reads == want, f"{key}: {reads} (expected {want})"
            assert not stray, f"{key}: host reads outside distoptim._host.read: {stray}"
