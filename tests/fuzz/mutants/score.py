"""Running the fuzzer against mutants: each in a process of its own whose ``PYTHONPATH`` starts with the mutated
copy (so the spawned ranks import it too), stopping at the first catching seed; a seed counts only where the clean
copy does not fail it too (the fuzzer's own open failures are not catches)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.fuzz.__main__ import FAILURES
from tests.fuzz.mutants.catalog import Mutant
from tests.fuzz.mutants.runner import COPY_ENV
from tests.fuzz.program import Program

TIMEOUT = 900.0  # seconds one runner may take (160 programs take about two minutes on two quiet cores)


@dataclass
class Score:
    mutant: str
    caught: bool
    verdict: str = ""  # the catching verdict (mismatch, crash, ...)
    seed: int | None = None  # the first catching seed
    programs: int = 0  # how many ran
    seconds: float = 0.0
    detail: str = ""
    excused: list[int] = field(default_factory=list)  # failing seeds the clean copy fails too


def run_copy(copy: Path, args: list[str], timeout: float = TIMEOUT) -> list[dict[str, Any]]:
    """The runner's verdicts on ``copy`` (its ``src/``), one dict per program."""
    root = copy.parent.parent  # copies.snapshot's layout: root/tests beside root/<name>/src
    env = {**os.environ, "PYTHONPATH": f"{copy}{os.pathsep}{root}", COPY_ENV: str(copy)}
    command = [sys.executable, "-m", "tests.fuzz.mutants.runner", *args]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    verdicts = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0:
        raise RuntimeError(f"the runner failed ({done.returncode}) on {copy}:\n{done.stderr[-3000:]}")
    return verdicts


class CleanVerdicts:
    """The clean copy's verdict per seed, run only for the seeds some mutant fails (and remembered)."""

    def __init__(self, clean: Path, world_size: int, hybrid: bool) -> None:
        self.clean, self.world_size, self.hybrid = clean, world_size, hybrid
        self.known: dict[int, str] = {}

    def fails(self, seeds: list[int]) -> set[int]:
        todo = [s for s in seeds if s not in self.known]
        if todo:
            args = ["--seeds", ",".join(map(str, todo)), "--world-size", str(self.world_size)]
            for verdict in run_copy(self.clean, args + (["--hybrid"] if self.hybrid else [])):
                self.known[verdict["seed"]] = verdict["category"]
        return {s for s in seeds if self.known.get(s) in FAILURES}


def score(
    mutant: Mutant, copy: Path, seeds: list[int], clean: CleanVerdicts, world_size: int, hybrid: bool, batch: int
) -> Score:
    """Run ``seeds`` on the mutated ``copy`` until a batch holds a failure the clean copy does not share."""
    began, ran, excused, pending = time.monotonic(), 0, [], list(seeds)
    while pending:  # a runner per 4 batches at most, resumed after a failure the clean copy shares
        chunk = pending[: batch * 4]
        args = ["--seeds", ",".join(map(str, chunk)), "--world-size", str(world_size), "--batch", str(batch)]
        verdicts = run_copy(copy, args + ["--stop"] + (["--hybrid"] if hybrid else []))
        if not verdicts:
            raise RuntimeError(f"{mutant.name}: the runner returned no verdict for seeds {chunk}")
        ran += len(verdicts)
        pending = pending[len(verdicts) :]
        failing = [v for v in verdicts if v["category"] in FAILURES]
        shared = clean.fails([v["seed"] for v in failing])
        excused += sorted(shared)
        caught = [v for v in failing if v["seed"] not in shared]
        if caught:
            first = caught[0]
            detail = " | ".join(first["detail"][:1])[:300]
            seconds = time.monotonic() - began
            return Score(mutant.name, True, first["category"], first["seed"], ran, seconds, detail, excused)
    return Score(mutant.name, False, programs=ran, seconds=time.monotonic() - began, excused=excused)


def demonstrate(
    program: Program, world_size: int, clean: Path, copy: Path, expect: str = "mismatch"
) -> tuple[bool, str]:
    """Whether ``program`` passes (or is refused) on the clean copy and trains wrong, raising nothing, on the mutant
    (or reaches ``expect``: a crash the verdict must not read as the oracle's); and a report."""
    args = ["--program", program.to_json(), "--world-size", str(world_size)]
    [before] = run_copy(clean, args)
    [after] = run_copy(copy, args)
    shown = before["category"] in ("pass", "refused") and after["category"] == expect
    lines = [
        f"  clean copy: {before['category']} {' | '.join(before['detail'][:1])[:300]}",
        f"  mutant:     {after['category']} {' | '.join(after['detail'][:2])[:600]}",
    ]
    return shown, "\n".join(lines)
