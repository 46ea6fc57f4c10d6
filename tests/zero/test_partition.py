"""The partition plan is pure arithmetic: tested without a process group."""

from __future__ import annotations

import time

import pytest

from distoptim.zero.partition import UNOWNED, partition_parameters


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
    with pytest.raises(ValueError, match="2 element counts but 1 trainable"):
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
