"""The multi-rank harness itself: results, tracebacks, hangs and clean-up."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests._dist import RankFailure, run_on_ranks


def _all_reduce_rank(rank: int, world_size: int) -> float:
    tensor = torch.tensor([float(rank)])
    dist.all_reduce(tensor)
    assert dist.get_world_size() == world_size
    return float(tensor.item())


def _raise_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()


def _hang_on_rank_one(rank: int, world_size: int, pid_file: str) -> None:
    with open(f"{pid_file}.{rank}", "w") as handle:
        handle.write(str(os.getpid()))
    if rank == 1:
        time.sleep(3600)


def _exit_hard(rank: int, world_size: int) -> None:
    os._exit(3)


def test_results_come_back_by_rank() -> None:
    assert run_on_ranks(_all_reduce_rank, 3) == [3.0, 3.0, 3.0]


def test_failing_rank_reports_its_traceback() -> None:
    with pytest.raises(RankFailure, match=r"(?s)rank 1 of 2 failed.*_raise_on_rank_one.*ValueError: boom on purpose"):
        run_on_ranks(_raise_on_rank_one, 2, timeout=30)


def test_hung_rank_fails_within_timeout_and_leaves_no_process(tmp_path) -> None:
    pid_file = str(tmp_path / "pid")
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"(?s)did not finish within 3 s.*rank 1.*_hang_on_rank_one"):
        run_on_ranks(_hang_on_rank_one, 2, pid_file, timeout=3)
    assert time.monotonic() - start < 20
    for rank in range(2):
        pid = int((tmp_path / f"pid.{rank}").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_rank_dying_without_report_fails() -> None:
    with pytest.raises(RankFailure, match=r"exited \(code 3\) without reporting"):
        run_on_ranks(_exit_hard, 2, backend=None, timeout=30)


def _crash(rank: int, world_size: int) -> None:
    import ctypes

    ctypes.string_at(0)  # a segmentation fault, as a crash inside a torch kernel would be


def test_a_crashing_rank_reports_where_it_crashed() -> None:
    with pytest.raises(RankFailure, match=r"(?s)exited \(code -11\).*stacks when it crashed.*Segmentation.*_crash"):
        run_on_ranks(_crash, 2, backend=None, timeout=30)
