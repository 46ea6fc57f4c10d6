"""What one multi-rank test costs in the harness (tests/_dist.py): fork, group set-up, one all_reduce, tear-down.

.venv/bin/python benchmarks/spawn_cost.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests._dist import run_on_ranks
from tests.test_harness import _all_reduce_rank


def main() -> None:
    start = time.perf_counter()
    run_on_ranks(_all_reduce_rank, 2)
    print(f"first spawn (starts the forkserver, imports torch once): {time.perf_counter() - start:.2f} s")
    for world_size in (2, 4):
        times = []
        for _ in range(7):
            start = time.perf_counter()
            run_on_ranks(_all_reduce_rank, world_size)
            times.append(time.perf_counter() - start)
        print(f"{world_size} ranks: median {statistics.median(times):.3f} s per spawned test body")


if __name__ == "__main__":
    main()
