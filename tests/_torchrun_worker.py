"""Run by tests/test_torchrun.py as each torchrun worker: examples/zero_torchrun.py first (with this script's
arguments), then a report of the node groups that distoptim forms from torchrun's environment.

The report is one ``GROUPS {json}`` line per rank: the rank, the node torchrun placed it on (``GROUP_RANK``), the
ranks in HierarchicalModelAverager's subgroup of LOCAL_WORLD_SIZE ranks and in the post-local-SGD hook's per-node
subgroup (which reads LOCAL_WORLD_SIZE itself), and the value of a parameter after each of five
``average_parameters`` calls. The test compares them with what it computes by hand. The groups are formed on a
store of their own (``DISTOPTIM_TEST_STORE_PORT``), since the example has already used and destroyed torchrun's.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # first thing, before imports that take seconds: the test kills leftover workers by
    # these files (torchrun starts each in a session of its own, out of reach of the agents' process groups)
    with open(os.path.join(os.environ["DISTOPTIM_TEST_PID_DIR"], f"worker-{os.getpid()}.pid"), "w") as pid_file:
        pid_file.write(str(os.getpid()))

import json
import runpy
import sys
from datetime import timedelta
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "zero_torchrun.py"
PERIODS = {2: "local", 4: "world"}  # period -> level: averaging within the node every 2 steps, globally every 4
WARMUP = 1
CALLS = 5  # steps 0 and 1: warm-up, 2: within the node, 3: none, 4: global


def initial_value(rank: int) -> list[float]:
    """The parameter's value on ``rank`` before any averaging: node means and the global mean all differ."""
    return [float(rank), float(rank * rank), 2.0**rank]


def _report_groups() -> dict[str, object]:
    import torch.distributed as dist

    from distoptim.averagers import HierarchicalModelAverager
    from distoptim.hooks import PostLocalSGDState

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world_size = int(os.environ["LOCAL_WORLD_SIZE"])
    store = dist.TCPStore(
        "127.0.0.1", int(os.environ["DISTOPTIM_TEST_STORE_PORT"]), world_size, is_master=rank == 0,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    try:
        sizes = {period: local_world_size if level == "local" else world_size for period, level in PERIODS.items()}
        averager = HierarchicalModelAverager(sizes, warmup_steps=WARMUP)
        hook_group = PostLocalSGDState(None, None, start_localSGD_iter=0).local_subgroup()
        param = torch.nn.Parameter(torch.tensor(initial_value(rank)))
        param.grad = torch.zeros_like(param)  # averagers skip parameters without a gradient
        values = []
        for _ in range(CALLS):
            averager.average_parameters([param])
            values.append(param.detach().tolist())
        return {
            "rank": rank,
            "node": int(os.environ["GROUP_RANK"]),
            "local_rank": int(os.environ["LOCAL_RANK"]),
            "local_world_size": local_world_size,
            "averager_groups": {
                level: dist.get_process_group_ranks(averager.period_process_group_dict[period])
                for period, level in PERIODS.items()
            },
            "hook_group": dist.get_process_group_ranks(hook_group),
            "values": values,
        }
    finally:
        dist.destroy_process_group()


def main() -> None:
    sys.argv = [str(EXAMPLE), *sys.argv[1:]]
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    sys.stdout.write(f"GROUPS {json.dumps(_report_groups())}\n")  # one write (workers run unbuffered: python -u)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
