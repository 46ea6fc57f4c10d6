"""The store exchanges a raised backward's line-up goes through (``comm/out_of_band.py``): every rank gets every
rank's values, maxima over a shard group and its replicas are maxima over all ranks, and a long run of exchanges
keeps the store's key count bounded (two rounds' keys at most)."""

from __future__ import annotations

import torch.distributed as dist

from distoptim.comm.out_of_band import gather_through_store, max_through_store
from tests._dist import run_on_ranks


def _body(rank: int, world_size: int) -> tuple[list[list[int]], list[int], int, int]:
    shards = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    hybrid = [shards[rank // 2], replicas[rank % 2]]
    gathered = gather_through_store([rank, 10 * rank], list(range(world_size)), "test")
    maxima = max_through_store([rank, 3 - rank, 7], hybrid, "test-hybrid")
    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    before = store.num_keys()
    for round_ in range(50):
        assert max_through_store([round_ + rank], hybrid, "test-many") == [round_ + world_size - 1]
    dist.barrier()
    return gathered, maxima, before, store.num_keys()


def test_every_rank_gets_every_value_maxima_span_the_hybrid_groups_and_keys_stay_bounded() -> None:
    for gathered, maxima, before, after in run_on_ranks(_body, 4, timeout=90):
        assert gathered == [[r, 10 * r] for r in range(4)]
        assert maxima == [3, 3, 7]
        assert after - before <= 2 * 2 * 4, (before, after)  # two rounds' keys of two groups' exchanges, 4 ranks
