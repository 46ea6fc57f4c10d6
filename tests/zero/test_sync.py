"""Parameter sync: every rank ends with every shard, in a few collectives, whatever the staging size."""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist

from distoptim.zero.buckets import BucketViewSync, StagedSync, build_layouts
from distoptim.zero.partition import partition_parameters
from tests._dist import run_on_ranks

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
    plan = partition_parameters([torch.Size(s).numel() for s, _ in SHAPES], [True] * len(SHAPES), world_size)
    expected = [
        torch.full(shape, float(owner + i), dtype=dtype)
        for i, ((shape, dtype), owner) in enumerate(zip(SHAPES, plan.owners))
    ]
    for make_sync in (
        lambda layouts: BucketViewSync(layouts, dist.group.WORLD),
        lambda layouts: StagedSync(layouts, dist.group.WORLD),
        lambda layouts: StagedSync(layouts, dist.group.WORLD, stage_bytes=40),  # forces many small rounds
        lambda layouts: StagedSync(layouts, dist.group.WORLD, direct_bytes=40),  # large ones broadcast in place
    ):
        params = _params_for(rank, plan.owners)
        by_rank = [[p for p, o in zip(params, plan.owners) if o == r] for r in range(world_size)]
        layouts = build_layouts(by_rank)
        assert len(layouts) == 2  # one per dtype
        sync = make_sync(layouts)
        data_ptrs = [{param.data_ptr()} for param in params]
        with mock.patch.object(dist, "broadcast", wraps=dist.broadcast) as broadcast:
            sync.sync_parameters()
        for param, want in zip(params, expected):
            assert torch.equal(param, want), (param, want)
        if isinstance(sync, StagedSync) and sync.direct:
            assert 0 < len(sync.direct) < len(params)
            assert all(param.data_ptr() in pointers for param, pointers in zip(params, data_ptrs))
        elif not isinstance(sync, StagedSync) or sync.rounds[0].numel > 10:
            assert broadcast.call_count <= world_size * len(layouts), broadcast.call_count


def test_every_rank_gets_every_shard() -> None:
    run_on_ranks(_sync_body, 3)


def _strided_body(rank: int, world_size: int) -> None:
    """Bucket views keep a dense parameter's strides: a channels_last conv weight and a transposed matrix."""
    conv = torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last)
    transposed = torch.randn(5, 3).t()
    owned = [conv + rank, transposed + rank]  # rank 0 owns the first, rank 1 the second
    strides = [p.stride() for p in owned]
    sync = BucketViewSync(build_layouts([owned[:1], owned[1:]]), dist.group.WORLD)
    assert [p.stride() for p in owned] == strides
    sync.sync_parameters()
    assert torch.equal(owned[0], conv) and torch.equal(owned[1], transposed + 1)
    sync.release()
    assert [p.stride() for p in owned] == strides


def test_bucket_views_keep_parameter_strides() -> None:
    run_on_ranks(_strided_body, 2)
