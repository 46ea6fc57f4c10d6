"""The fuzzer run inside a process whose ``PYTHONPATH`` starts with a copy of ``src/`` (``python -m
tests.fuzz.mutants.runner``, started by ``score.py``): CI's programs, or one program, each verdict as a JSON line.

``distoptim.__file__`` is checked to lie inside the copy here, in every rank before the programs run, and again in
every rank of every fuzz session (the sessions' body is wrapped), so a run can never test the working tree instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from tests import _dist
from tests.fuzz import session
from tests.fuzz.__main__ import FAILURES
from tests.fuzz.program import Program, generate

COPY_ENV = "DISTOPTIM_MUTANT_COPY"  # the copy's src/ directory, as the parent set it
MARK = "MUTANT-COPY-CHECK"


def check_copy(where: str) -> str:
    """``distoptim``'s file, after asserting that it comes from the copy named by ``COPY_ENV``."""
    import distoptim

    copy = os.path.realpath(os.environ[COPY_ENV])
    found = os.path.realpath(distoptim.__file__)
    if os.path.commonpath([copy, found]) != copy:
        raise AssertionError(f"{MARK}: {where} imported distoptim from {found}, not from the copy {copy}")
    return found


def _where(rank: int, world_size: int) -> str:
    return check_copy(f"rank {rank}")


def _check_every_rank(world_size: int, tries: int = 3) -> None:
    """``check_copy`` in every rank before any program (a group's set-up that a busy machine broke is retried)."""
    for attempt in range(tries):
        try:
            _dist.run_on_ranks(_where, world_size)
            return
        except _dist.RankFailure as error:
            if MARK in str(error) or attempt == tries - 1:
                raise


def _checked_session(rank: int, world_size: int, *args: Any) -> None:
    check_copy(f"rank {rank} of a fuzz session")
    session._session(rank, world_size, *args)


def _run_on_checked_ranks(body: Any, world_size: int, *args: Any, **kwargs: Any) -> Any:
    assert body is session._session, body
    return _dist.run_on_ranks(_checked_session, world_size, *args, **kwargs)


def run(programs: list[Program], world_size: int, batch: int, stop: bool) -> None:
    """Each program's verdict printed as a JSON line (``seed``, ``category``, ``detail``); with ``stop``, none
    after the first batch holding a failure."""
    check_copy("the runner")
    _check_every_rank(world_size)
    session.run_on_ranks = _run_on_checked_ranks  # type: ignore[attr-defined] # and every rank of every session
    for start in range(0, len(programs), batch):
        chunk = programs[start : start + batch]
        verdicts = session.run_programs(chunk, world_size)
        for program, verdict in zip(chunk, verdicts):
            if MARK in json.dumps(verdict):
                raise SystemExit(f"the copy check failed: {verdict}")
            detail = [str(d)[:600] for d in verdict.get("detail", [])[:3]]
            print(json.dumps({"seed": program.seed, "category": verdict["category"], "detail": detail}), flush=True)
        if stop and any(v["category"] in FAILURES for v in verdicts):
            return


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.mutants.runner")
    parser.add_argument("--seeds", help="comma-separated seeds")
    parser.add_argument("--program", help="one program's JSON")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hybrid", action="store_true")
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--stop", action="store_true", help="stop after the first batch with a failure")
    args = parser.parse_args()
    if args.program:
        programs = [Program.from_json(args.program)]
    else:
        programs = [generate(int(seed), hybrid=args.hybrid) for seed in args.seeds.split(",")]
    run(programs, args.world_size, args.batch, args.stop)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
