"""The partition plan is pure arithmetic: tested without a process group."""

from __future__ import annotations

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
