"""Parameter sync: every rank ends with every shard, in a few collectives of either style, whatever the staging size."""

from __future__ import annotations

import itertools
from dataclasses import replace
from unittest import mock

import torch
import torch.distributed as dist

from distoptim.comm import collectives as comm
from distoptim.zero.buckets import BucketViewSync, StagedSync
from distoptim.zero.layouts import layouts_from_plan, piece_view
from distoptim.zero.partition import partition_parameters
from tests._dist import run_on_ranks

P2P = comm.Collectives.POINT_TO_POINT

SHAPES = [
    ((0,), torch.float32),  # zero-sized parameters (first, middle, last) have nothing to sync
    ((7, 5), torch.float32),
    ((3,), torch.bfloat16),
    ((11,), torch.float32),
    ((2, 2), torch.bfloat16),
    ((9,), torch.float32),
    ((0, 5), torch.bfloat16),
    ((1,), torch.float32),
    ((0,), torch.float32),
]


def _params_for(rank: int, owners: tuple[int, ...]) -> list[torch.Tensor]:
    """Rank ``rank``'s view before sync: its owned parameters hold ``owner + index``, the rest hold -1."""
    return [
        torch.full(shape, float(owner + i) if owner == rank else -1.0, dtype=dtype)
        for i, ((shape, dtype), owner) in enumerate(zip(SHAPES, owners))
    ]


def _sync_body(rank: int, world_size: int) -> None:
    numels = [torch.Size(s).numel() for s, _ in SHAPES]
    plan = partition_parameters(numels, [True] * len(SHAPES), world_size, keys=[dtype for _, dtype in SHAPES])
    expected = [
        torch.full(shape, float(owner + i), dtype=dtype)
        for i, ((shape, dtype), owner) in enumerate(zip(SHAPES, plan.owners))
    ]
    for make_sync, style in itertools.product(
        (
            lambda layouts, style: BucketViewSync(layouts, dist.group.WORLD, style),
            lambda layouts, style: StagedSync(layouts, dist.group.WORLD, style),
            lambda layouts, style: StagedSync(layouts, dist.group.WORLD, style, stage_bytes=40),  # many small rounds
            lambda layouts, style: StagedSync(layouts, dist.group.WORLD, style, direct_bytes=40),  # large in place
        ),
        comm.Collectives,
    ):
        params = _params_for(rank, plan.owners)
        layouts = layouts_from_plan(plan.layouts, plan.fragments, params)
        assert len(layouts) == 2  # one per dtype
        sync = make_sync(layouts, style)
        data_ptrs = [{param.data_ptr()} for param in params]
        with (
            mock.patch.object(dist, "broadcast", wraps=dist.broadcast) as broadcast,
            mock.patch.object(dist, "isend", wraps=dist.isend) as isend,
        ):
            sync.sync_parameters()
        for param, want in zip(params, expected):
            assert torch.equal(param, want), (param, want)
        if isinstance(sync, StagedSync) and sync.direct:
            assert 0 < len(sync.direct) < len(params)
            assert all(param.data_ptr() in pointers for param, pointers in zip(params, data_ptrs))
        elif not isinstance(sync, StagedSync) or sync.rounds[0].numel > 10:  # one message per owner and layout
            if style is comm.Collectives.POINT_TO_POINT:  # a call whose shares are unequal goes through aggregators
                # (comm/relay.py): at 3 ranks it adds at most N-1 messages a rank (its surplus to the aggregators, or
                # what it aggregates on to the one other rank)
                if isinstance(sync, StagedSync):
                    calls = [[(src, end - start) for src, start, end in sync._work(r).slices] for r in sync.rounds]
                else:
                    calls = [list(enumerate(b - a for a, b in itertools.pairwise(lay.bounds[0]))) for lay in layouts]
                relayed = sum(comm.relayed(_shares(call, world_size)) for call in calls)
                assert broadcast.call_count == 0
                assert isend.call_count <= (world_size - 1) * (len(layouts) + relayed), (isend.call_count, relayed)
            else:
                assert isend.call_count == 0 and broadcast.call_count <= world_size * len(layouts)


def _shares(call: list[tuple[int, int]], world_size: int) -> list[int]:
    """Each rank's elements in one call's (owner, elements) slices."""
    shares = [0] * world_size
    for owner, elements in call:
        shares[owner] += elements
    return shares


def test_every_rank_gets_every_shard() -> None:
    run_on_ranks(_sync_body, 3)


def _strided_body(rank: int, world_size: int) -> None:
    """Bucket views keep a dense parameter's strides: a channels_last conv weight and a transposed matrix."""
    conv = torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last)
    transposed = torch.randn(5, 3).t()
    owned = [conv + rank, transposed + rank]  # rank 0 owns the first, rank 1 the second
    strides = [p.stride() for p in owned]
    plan = partition_parameters([p.numel() for p in owned], [True, True], world_size)
    assert plan.owners == (0, 1)
    sync = BucketViewSync(layouts_from_plan(plan.layouts, plan.fragments, owned), dist.group.WORLD, P2P)
    assert [p.stride() for p in owned] == strides
    sync.sync_parameters()
    assert torch.equal(owned[0], conv) and torch.equal(owned[1], transposed + 1)


def test_bucket_views_keep_parameter_strides() -> None:
    run_on_ranks(_strided_body, 2)


def _even_body(rank: int, world_size: int) -> None:
    """Even partition: parameters straddle ranks; each rank fills its pieces, every sync gives every rank it all."""
    generator = torch.Generator().manual_seed(0)
    expected = [
        torch.randn(5, 3, 2, 2, generator=generator).to(memory_format=torch.channels_last),
        torch.randn(0, 3, generator=generator),
        torch.randn(3, 7, generator=generator).t(),  # transposed: dense, not contiguous
        torch.randn(13, generator=generator).bfloat16(),
        torch.randn(1, generator=generator),
    ]
    keys = [(t.device, t.dtype) for t in expected]
    plan = partition_parameters(
        [t.numel() for t in expected], [True] * len(expected), world_size, mode="even", keys=keys
    )
    assert any(len({f.rank for f in pieces}) > 1 for pieces in plan.fragments), "some parameter must straddle"
    for make_sync, style in itertools.product(
        (
            lambda layouts, style: BucketViewSync(layouts, dist.group.WORLD, style),
            lambda layouts, style: StagedSync(layouts, dist.group.WORLD, style),
            lambda layouts, style: StagedSync(layouts, dist.group.WORLD, style, stage_bytes=24, direct_bytes=40),
        ),
        comm.Collectives,
    ):
        params = [torch.full_like(t, -1.0) for t in expected]
        layouts = layouts_from_plan(plan.layouts, plan.fragments, params)
        sync = make_sync(layouts, style)
        for layout in layouts:
            for piece in layout.pieces:
                if piece.rank == rank:
                    piece_view(piece).copy_(piece_view(replace(piece, param=expected[_index(params, piece.param)])))
        sync.sync_parameters()
        for index, (param, want) in enumerate(zip(params, expected)):
            assert param.stride() == want.stride(), f"parameter {index} lost its strides"
            assert torch.equal(param, want), f"parameter {index} after {type(sync).__name__}"


def _index(params: list[torch.Tensor], param: torch.Tensor) -> int:
    return next(i for i, p in enumerate(params) if p is param)


def test_even_partition_sync_gives_every_rank_every_element() -> None:
    run_on_ranks(_even_body, 3)


def _recut_body(rank: int, world_size: int) -> None:
    """Re-cutting an even layout into padded regions (``ShardedDataParallel``'s buckets) moves the parameters within
    their buffer: same allocation, same values and strides, zero padding, and the sync still right; a parameter the
    new cut leaves out (frozen meanwhile) gets its own storage back, its values kept."""
    generator = torch.Generator().manual_seed(1)
    expected = [
        torch.randn(61, generator=generator),
        torch.randn(3, generator=generator),  # frozen before the re-cut: the later parameters move back
        torch.randn(3, 5, 2, 2, generator=generator).to(memory_format=torch.channels_last),
        torch.randn(4, 5, generator=generator).t(),
        torch.randn(2, generator=generator),
        torch.randn(2_500_003, generator=generator),  # moves forward (padding) through chunks, overlapping itself
        torch.randn(5, generator=generator),
    ]
    strides = [t.stride() for t in expected]
    numels = [t.numel() for t in expected]
    keys = [(t.device, t.dtype) for t in expected]
    params = [t.clone(memory_format=torch.preserve_format) for t in expected]
    plan = partition_parameters(numels, [True] * len(params), world_size, mode="even", keys=keys)
    first = BucketViewSync(layouts_from_plan(plan.layouts, plan.fragments, params), dist.group.WORLD, P2P)
    allocation = first.allocations()[keys[0]]
    trainable = [True, False, True, True, True, True, True]
    recut = partition_parameters(numels, trainable, world_size, mode="even", keys=keys, region_numel={keys[0]: 30})
    assert len(recut.layouts[0].bounds) > 2, "the cut must make several padded regions"
    before = [p.storage_offset() for p in params]
    second = BucketViewSync(
        layouts_from_plan(recut.layouts, recut.fragments, params), dist.group.WORLD, P2P, move_within=first
    )
    assert second.allocations()[keys[0]] is allocation, "moved in place, not copied into a second buffer"
    moves = {p.storage_offset() - offset for p, offset in zip(params, before) if p is not params[1]}
    assert min(moves) < 0 < max(moves), "some parameters must move back (the frozen one left), some forward (padding)"
    for param, want, stride in zip(params, expected, strides):
        assert torch.equal(param, want) and param.stride() == stride
    assert params[1].untyped_storage().data_ptr() != allocation.untyped_storage().data_ptr()
    buffer = second.buffers[0]
    covered = torch.zeros(buffer.numel(), dtype=torch.bool)
    for index in recut.layouts[0].params:
        offset = params[index].storage_offset()
        covered[offset : offset + numels[index]] = True
    assert torch.count_nonzero(buffer[~covered]) == 0, "the padding is zero"
    for index in recut.layouts[0].params:  # each rank garbles what it does not own; the sync restores it
        for fragment in recut.fragments[index]:
            if fragment.rank != rank:
                buffer[fragment.position : fragment.position + fragment.length] = -1.0
    second.sync_parameters()
    for index in recut.layouts[0].params:
        assert torch.equal(params[index], expected[index]), index


def test_recutting_moves_parameters_in_place() -> None:
    run_on_ranks(_recut_body, 3)
