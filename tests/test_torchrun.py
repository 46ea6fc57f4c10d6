"""Two torchrun agents on 127.0.0.1 as two "nodes" of 2 workers each (c10d rendezvous), running
examples/zero_torchrun.py: all 4 ranks train the same parameters, equal to one process training on the 4 ranks'
batches, and write one sharded checkpoint; distoptim's per-node groups match the nodes torchrun formed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch

from distoptim.demo.launch import free_port
from tests._examples import ROOT, check_zero_torchrun, environment
from tests._torchrun_worker import CALLS, initial_value

NODES, PER_NODE, STEPS = 2, 2, 3
WORLD_SIZE = NODES * PER_NODE
TIMEOUT = 120.0


def _launch_two_nodes(tmp_path: Path, checkpoint: Path) -> list[str]:
    """Start both agents, wait for both (killing everything on a failure or past ``TIMEOUT``); their outputs."""
    rendezvous, store = free_port(), free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}", f"--nproc-per-node={PER_NODE}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{rendezvous}", f"--rdzv-id=distoptim-{uuid.uuid4().hex}",
        "--local-addr=127.0.0.1", "--max-restarts=0", "--monitor-interval=0.2",
        str(ROOT / "tests" / "_torchrun_worker.py"), "--steps", str(STEPS), "--checkpoint-dir", str(checkpoint),
    ]  # fmt: skip
    env = environment(DISTOPTIM_TEST_PID_DIR=str(tmp_path), DISTOPTIM_TEST_STORE_PORT=str(store))
    logs = [tmp_path / f"agent{node}.log" for node in range(NODES)]
    agents: list[subprocess.Popen[bytes]] = []
    try:
        for log in logs:
            with open(log, "wb") as out:
                agents.append(
                    subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
                )
        deadline = time.monotonic() + TIMEOUT
        while any(agent.poll() is None for agent in agents) and time.monotonic() < deadline:
            if any(agent.poll() not in (None, 0) for agent in agents):
                break  # one node failed: the other would wait for it until its timeouts
            time.sleep(0.2)
        outputs = [log.read_text() for log in logs]
        codes = [agent.poll() for agent in agents]
        report = "\n".join(f"--- agent {n} (exit {c}) ---\n{o}" for n, (c, o) in enumerate(zip(codes, outputs)))
        assert codes == [0] * NODES, f"torchrun failed or hung (None: still running after {TIMEOUT:g} s):\n{report}"
        return outputs
    finally:
        _kill(agents, tmp_path)


def _kill(agents: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    """Stop the agents and every worker, whatever state they are in.

    Workers run in sessions of their own (torchrun starts them so), out of reach of ``killpg`` on the agents: they
    are found as the agents' children (``/proc``) and by the pid files they write first thing. The agents get a
    SIGTERM first (on which torchrun stops its workers), then everything left a SIGKILL.
    """
    workers = {pid for agent in agents for pid in _children(agent.pid)}
    for agent in agents:
        with contextlib.suppress(ProcessLookupError):
            agent.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        for agent in agents:
            agent.wait(timeout=5)
    workers |= {int(path.read_text()) for path in tmp_path.glob("worker-*.pid") if path.read_text().isdigit()}
    for agent in agents:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for agent in agents:
        agent.wait(timeout=10)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` now (from /proc; empty where there is none)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:  # field 4, after "(command)"
                found.append(int(stat.parent.name))
    return found


def test_two_nodes_of_two_workers(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint"
    output = "\n".join(_launch_two_nodes(tmp_path, checkpoint))
    check_zero_torchrun(output, checkpoint, WORLD_SIZE, STEPS)

    reports = {r["rank"]: r for r in (json.loads(line[7:]) for line in output.splitlines() if line[:7] == "GROUPS ")}
    assert sorted(reports) == list(range(WORLD_SIZE)), output
    nodes = {rank: report["node"] for rank, report in reports.items()}
    assert sorted(nodes.values()) == [n for n in range(NODES) for _ in range(PER_NODE)], nodes  # 2 nodes of 2
    world = list(range(WORLD_SIZE))
    for rank, report in reports.items():
        same_node = [other for other in world if nodes[other] == nodes[rank]]
        assert report["local_world_size"] == PER_NODE
        assert report["averager_groups"] == {"local": same_node, "world": world}, (rank, report, nodes)
        assert report["hook_group"] == same_node, (rank, report, nodes)
        start = torch.tensor(initial_value(rank))
        node_mean = torch.stack([torch.tensor(initial_value(other)) for other in same_node]).mean(0)
        world_mean = torch.stack([torch.tensor(initial_value(other)) for other in world]).mean(0)
        # warm-up (steps 0 and 1), within the node (2), nothing (3), across nodes (4)
        expected = [start, start, node_mean, node_mean, world_mean]
        assert len(report["values"]) == CALLS
        for step, (value, want) in enumerate(zip(report["values"], expected)):
            message = lambda m, r=rank, s=step: f"rank {r}, average_parameters at step {s}: {m}"
            torch.testing.assert_close(torch.tensor(value), want, msg=message)
