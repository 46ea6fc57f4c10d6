"""The partition plan is pure arithmetic: tested without a process group."""

from __future__ import annotations

import itertools
import random
import time

import pytest

from distoptim.zero.partition import SPLIT, UNOWNED, PartitionPlan, partition_parameters


def test_sorted_greedy_largest_first_ties_to_lowest_rank() -> None:
    plan = partition_parameters([10, 40, 30, 20, 5], [True] * 5, world_size=2)
    # 40 -> r0, 30 -> r1, 20 -> r1 (30 < 40), 10 -> r0 (40 < 50), 5 -> r0 (50 = 50, tie to lowest)
    assert plan.owners == (0, 0, 1, 1, 0)
    assert plan.loads() == [55, 50]


def test_frozen_parameters_are_unowned_and_do_not_count() -> None:
    plan = partition_parameters([100, 10, 10], [False, True, True], world_size=2)
    assert plan.owners == (UNOWNED, 0, 1)
    assert plan.loads() == [10, 10]


def test_more_ranks_than_parameters_leaves_ranks_empty() -> None:
    plan = partition_parameters([3, 2], [True, True], world_size=4)
    assert plan.owners == (0, 1)
    assert plan.params_of(3) == []


def test_previous_assignments_stay_put() -> None:
    first = partition_parameters([10, 10], [True, True], world_size=2)
    grown = partition_parameters([10, 10, 50, 1], [True] * 4, world_size=2, previous=first)
    assert grown.owners[:2] == first.owners
    assert grown.owners[2:] == (0, 1)


def test_world_size_one_owns_everything() -> None:
    assert partition_parameters([1, 2, 3], [True] * 3, world_size=1).owners == (0, 0, 0)


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        partition_parameters([1], [True], world_size=0)
    with pytest.raises(ValueError, match="2 element counts, 1 trainable flags"):
        partition_parameters([1, 2], [True], world_size=1)
    first = partition_parameters([1, 2], [True, True], world_size=2)
    with pytest.raises(ValueError, match="prefix"):
        partition_parameters([5, 2, 3], [True] * 3, world_size=2, previous=first)


def test_a_frozen_parameter_made_trainable_is_placed_and_owners_stay() -> None:
    first = partition_parameters([10, 40, 30], [True, False, True], world_size=2)
    assert first.owners == (1, UNOWNED, 0)
    # parameter 1 unfrozen, parameter 0 frozen: 0 keeps its owner (and its state), 1 goes to the least loaded rank
    again = partition_parameters([10, 40, 30], [False, True, True], world_size=2, previous=first)
    assert again.owners == (1, 1, 0)


def test_plans_thousands_of_parameters_over_a_thousand_ranks_quickly() -> None:
    numels = [(i * 7919) % 100_003 + 1 for i in range(10_000)]
    start = time.perf_counter()
    plan = partition_parameters(numels, [True] * len(numels), world_size=1024)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"planning took {elapsed:.3f} s"
    loads = plan.loads()
    # sorted greedy: no rank exceeds the least loaded by more than the largest parameter
    assert max(loads) - min(loads) <= max(numels)
    assert sorted(set(plan.owners)) == list(range(1024))


# ------------------------------------------------------------------------------------------ even partition


def _gpt2_124m_numels() -> list[int]:
    """GPT-2 small's parameter shapes (124M elements, lm_head tied to the embedding)."""
    d, vocab, context, layers = 768, 50257, 1024, 12
    block = [d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d]
    return [vocab * d, context * d, *block * layers, d, d]


def _assert_fragments_tile(plan: PartitionPlan) -> None:
    """Every placed parameter's elements are owned exactly once, each fragment inside its rank's range."""
    for index, pieces in enumerate(plan.fragments):
        covered = sorted((f.offset, f.offset + f.length) for f in pieces)
        if plan.owners[index] == UNOWNED:
            assert covered == [] or plan.numels[index] == 0
            continue
        assert covered[0][0] == 0 and covered[-1][1] == plan.numels[index]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(covered)), f"parameter {index}: gaps or overlaps"
        layout = next(layout for layout in plan.layouts if index in layout.params)
        for fragment in pieces:
            assert any(
                s <= fragment.position and fragment.position + fragment.length <= e
                for s, e in layout.ranges(fragment.rank)
            )


def test_even_partition_of_gpt2_shapes_is_within_one_percent_of_ideal() -> None:
    numels = _gpt2_124m_numels()
    assert sum(numels) == 124_439_808
    for world_size in (2, 8, 64, 1024):
        even = partition_parameters(numels, [True] * len(numels), world_size, mode="even")
        ideal = sum(numels) / world_size
        shards = [sum(e - s for s, e in even.layouts[0].ranges(rank)) for rank in range(world_size)]
        assert max(shards) / ideal <= 1.01 and max(even.loads()) / ideal <= 1.01
        assert sum(even.loads()) == sum(numels)
        _assert_fragments_tile(even)
    greedy = partition_parameters(numels, [True] * len(numels), 64)
    assert max(greedy.loads()) / (sum(numels) / 64) > 19  # the embedding alone: why even exists


def test_a_parameter_straddles_three_ranks_and_the_last_is_padded() -> None:
    plan = partition_parameters([2, 9, 1], [True] * 3, world_size=4, mode="even")
    # 12 elements, chunk 3: ranks own [0,3) [3,6) [6,9) [9,12)
    assert plan.layouts[0].bounds == ((0, 3, 6, 9, 12),)
    assert [(f.rank, f.offset, f.length) for f in plan.fragments[1]] == [(0, 0, 1), (1, 1, 3), (2, 4, 3), (3, 7, 2)]
    assert plan.owners == (0, SPLIT, 3)
    padded = partition_parameters([5, 1], [True, True], world_size=4, mode="even")  # 6 elements, chunk 2, 8 padded
    assert padded.layouts[0].numel == 8 and padded.loads() == [2, 2, 2, 0]
    _assert_fragments_tile(plan)
    _assert_fragments_tile(padded)


def test_even_partition_more_ranks_than_elements_frozen_zero_sized_and_layout_keys() -> None:
    plan = partition_parameters(
        [3, 0, 4, 6, 2], [True, True, False, True, True], world_size=8, mode="even", keys=["a", "a", "a", "b", "b"]
    )
    assert [layout.key for layout in plan.layouts] == ["a", "b"]
    assert plan.fragments[1] == () and plan.owners[1] == UNOWNED  # zero-sized: owns nothing
    assert plan.fragments[2] == () and plan.owners[2] == UNOWNED  # frozen
    assert plan.layouts[0].bounds == (tuple(range(9)),)  # chunk 1 for 3 elements at 8 ranks: 5 pad
    assert plan.loads() == [2, 2, 2, 1, 1, 1, 1, 1]
    _assert_fragments_tile(plan)


def test_even_plan_grows_by_a_region_and_keeps_what_it_placed() -> None:
    first = partition_parameters([6, 10], [True, False], world_size=2, mode="even")
    grown = partition_parameters([6, 10, 4], [True, True, True], world_size=2, previous=first, mode="even")
    assert grown.fragments[0] == first.fragments[0]
    assert grown.layouts[0].bounds == ((0, 3, 6), (6, 13, 20))  # the new region cut evenly by itself
    assert grown.loads() == [10, 10]
    _assert_fragments_tile(grown)
    with pytest.raises(ValueError, match="prefix"):
        partition_parameters([6, 10], [True, True], world_size=2, previous=first)  # mode differs


def test_even_plans_grown_many_times_keep_whole_tensors_whole() -> None:
    """Growths (add_param_group, unfreezing) of even plans mixing whole-tensor parameters (Muon's, Adafactor's) with
    cut ones: every layout has one position per parameter, each whole parameter stays one fragment on one rank, and
    the fragments tile. A growth of whole parameters only once left an empty region whose position shifted every
    later parameter's, so a matrix added after it was cut across ranks (an Adafactor group added, then stepped)."""
    generator = random.Random(1)
    for _ in range(300):
        world_size = generator.randint(2, 5)
        numels: list[int] = []
        whole: list[bool] = []
        plan = None
        for _growth in range(generator.randint(1, 4)):
            count = generator.randint(1, 5)
            all_whole = generator.random() < 0.4
            numels += [generator.choice([0, 1, 3, 16, 64]) for _ in range(count)]
            whole += [all_whole or generator.random() < 0.5 for _ in range(count)]
            plan = partition_parameters(
                numels, [True] * len(numels), world_size, plan, mode="even", whole=whole, costs=numels
            )
            for layout in plan.layouts:
                assert len(layout.positions) == len(layout.params)
            for index, pieces in enumerate(plan.fragments):
                if whole[index] and numels[index]:
                    assert len(pieces) == 1 and pieces[0].length == numels[index], (index, pieces)
            _assert_fragments_tile(plan)


def test_random_plans_tile_their_parameters() -> None:
    generator = random.Random(0)
    for _ in range(200):
        count = generator.randint(1, 12)
        numels = [generator.choice([0, 1, 2, 5, 17, 64]) for _ in range(count)]
        trainable = [generator.random() < 0.8 for _ in range(count)]
        world_size = generator.randint(1, 9)
        for mode in ("greedy", "even"):
            plan = partition_parameters(numels, trainable, world_size, mode=mode, keys=[n % 2 for n in numels])
            _assert_fragments_tile(plan)
            assert sum(plan.loads()) == sum(n for n, t in zip(numels, trainable) if t)


def test_even_regions_of_a_bucket_size_each_split_evenly() -> None:
    """With region_numel every region holds whole parameters (cut walking from the last one) of at most that many
    elements, or one larger parameter, and is cut into equal shares by itself; the plan still tiles every parameter."""
    numels = [5, 3, 8, 20, 2, 2, 6]
    plan = partition_parameters(numels, [True] * 7, 3, mode="even", region_numel={0: 10})
    (layout,) = plan.layouts
    regions = [bounds[-1] - bounds[0] for bounds in layout.bounds]
    assert [len(set(b - a for a, b in itertools.pairwise(bounds))) for bounds in layout.bounds] == [1] * len(regions)
    assert layout.params == (0, 1, 2, 3, 4, 5, 6)
    assert [bounds[0] for bounds in layout.bounds] == [0, 9, 18, 39]  # [5, 3] [8] [20] [2, 2, 6], padded to 3s
    for index, numel in enumerate(numels):
        pieces = plan.fragments[index]
        assert sum(f.length for f in pieces) == numel and pieces[0].offset == 0
    grown = partition_parameters([*numels, 4, 9], [True] * 9, 3, previous=plan, mode="even", region_numel={0: 10})
    assert grown.fragments[:7] == plan.fragments and [b[0] for b in grown.layouts[0].bounds][-2:] == [51, 57]


def test_lists_of_different_lengths_are_refused_naming_each_count() -> None:
    with pytest.raises(ValueError, match="2 element counts, 2 trainable flags.* and 1 alignments"):
        partition_parameters([4, 4], [True, True], world_size=2, mode="even", align=[1])
