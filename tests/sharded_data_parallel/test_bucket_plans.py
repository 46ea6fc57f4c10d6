"""Bucket plans (pure): each bucket's slots come in position order, which ``buckets.gaps`` walks once
to zero what no gradient filled."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from distoptim.sharded_data_parallel.buckets import plan_buckets
from distoptim.zero.partition import partition_parameters


@pytest.mark.parametrize("mode", ["greedy", "even"])
def test_slots_are_in_position_order_and_do_not_overlap(mode: str) -> None:
    rng = random.Random(0)
    for _ in range(200):
        numels = [rng.randint(1, 300) for _ in range(rng.randint(1, 12))]
        trainable = [rng.random() < 0.8 for _ in numels]
        world_size = rng.randint(1, 4)
        first = partition_parameters(numels[:-2] or numels, trainable[:-2] or trainable, world_size, mode=mode)
        cap: dict[object, int] = defaultdict(lambda: rng.randint(1, 400))
        buckets = plan_buckets(first, cap)
        grown = partition_parameters(numels, trainable, world_size, first, mode=mode)
        for bucket in plan_buckets(grown, cap, buckets):
            ends = [0] + [slot.position + slot.numel for slot in bucket.slots]
            starts = [slot.position for slot in bucket.slots]
            assert all(end <= start for end, start in zip(ends, starts)), bucket.slots
            assert ends[-1] <= bucket.numel, bucket
