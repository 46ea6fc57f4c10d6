"""Running many fuzz programs in one spawned session of ranks, with each program's outcome agreed across ranks.

The ranks form their own gloo group with a short timeout (``PG_TIMEOUT``), so a program that leaves one rank in a
collective its peer never joins fails within seconds. Rank 0 appends each program's classified outcome to a file;
when a session dies (a hang, a broken group), the parent reads what finished, records the next program as
``hang``, and starts a new session with the rest. Nothing outlives ``run_on_ranks``'s timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from tests._dist import RankFailure, run_on_ranks
from tests.fuzz.interpret import run_program
from tests.fuzz.program import Program

PG_TIMEOUT = 20.0  # seconds a collective waits for a peer before the group raises
SECONDS_PER_PROGRAM = 6.0  # the session's budget per program, beyond a fixed start-up allowance
REFUSALS = ("ValueError", "RuntimeError", "TypeError")  # what distoptim documents raising


def _raised_in_fuzzer(text: str) -> bool:
    """The innermost frame with source is the fuzzer's own (the oracle's side or its arithmetic), not distoptim's.
    ``Subject.sync_finished`` relaying the owners' refusal to the other ranks counts as distoptim's (seed 646)."""
    frames = [line for line in text.splitlines() if line.strip().startswith("File ") and "/torch/" not in line]
    relayed = bool(frames) and "tests/fuzz/modes.py" in frames[-1] and frames[-1].endswith(", in sync_finished")
    return bool(frames) and "tests/fuzz/" in frames[-1] and not relayed


def classify(outcomes: list[dict[str, Any]]) -> dict[str, Any]:
    """One program's verdict from every rank's outcome."""
    statuses = {o["status"] for o in outcomes}
    if statuses == {"ok"}:
        mismatches = [f"rank {r}: {m}" for r, o in enumerate(outcomes) for m in o["mismatches"]]
        return {"category": "mismatch" if mismatches else "pass", "detail": mismatches[:40]}
    raised = [o for o in outcomes if o["status"] == "raised"]
    if len(raised) < len(outcomes):
        first = raised[0]
        return {
            "category": "divergent",
            "detail": [
                f"{first['type']} at {first['at']} on some ranks only: {first['message']}",
                first.get("traceback", ""),
            ],
        }
    if any(o["side"] == "oracle" for o in raised) or any(_raised_in_fuzzer(o.get("traceback", "")) for o in raised):
        return {"category": "oracle_error", "detail": [raised[0]["message"], raised[0].get("traceback", "")]}
    # the agreement (distoptim/comm/agreement.py): the rank that failed raises its own error, the others a
    # ValueError naming it ("... failed on rank N: <its error>"): one refusal, raised on every rank
    own = [o for o in raised if not (o["type"] == "ValueError" and " failed on rank " in o["message"])]
    if own and len(own) < len(raised) and all(f"{own[0]['type']}: " in o["message"] for o in raised if o not in own):
        raised = own
    signatures = {(o["type"], o["at"]) for o in raised}
    text = " ".join(o["message"] for o in raised)
    if "Timed out" in text or "Connection closed" in text or "Connection reset" in text:
        return {"category": "hang", "detail": [raised[0]["message"], raised[0].get("traceback", "")]}
    from_distoptim = any("/distoptim/" in o.get("traceback", "") for o in raised)  # (sync_finished: the owners)
    if len(signatures) == 1 and raised[0]["type"] in REFUSALS and from_distoptim:
        return {"category": "refused", "detail": [f"{raised[0]['type']} at {raised[0]['at']}: {raised[0]['message']}"]}
    return {
        "category": "crash",
        "detail": [f"{o['type']} at {o['at']}: {o['message']}" for o in raised] + [raised[0].get("traceback", "")],
    }


def _session(rank: int, world_size: int, programs: list[str], workdir: str, pg_timeout: float) -> None:
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", timeout=timedelta(seconds=pg_timeout), rank=rank, world_size=world_size)
    for index, text in enumerate(programs):
        with open(os.path.join(workdir, f"progress-{rank}"), "w") as handle:
            handle.write(str(index))
        outcome = run_program(Program.from_json(text), workdir)
        outcomes: list[Any] = [None] * world_size
        dist.all_gather_object(outcomes, outcome)
        if rank == 0:
            with open(os.path.join(workdir, "results.jsonl"), "a") as handle:
                handle.write(json.dumps(classify(outcomes)) + "\n")
        if classify(outcomes)["category"] == "hang":
            return  # the group may be broken: the parent starts a new session for the rest
    dist.destroy_process_group()


def run_programs(programs: list[Program], world_size: int = 2, pg_timeout: float = PG_TIMEOUT) -> list[dict[str, Any]]:
    """Every program's verdict (``category``: pass, refused, mismatch, divergent, crash, hang, oracle_error)."""
    verdicts: list[dict[str, Any]] = []
    pending = list(programs)
    while pending:
        workdir = tempfile.mkdtemp(prefix="distoptim-fuzz-")
        failure = ""
        try:
            run_on_ranks(
                _session,
                world_size,
                [p.to_json() for p in pending],
                workdir,
                pg_timeout,
                timeout=30 + pg_timeout + SECONDS_PER_PROGRAM * len(pending),
                backend=None,
            )
        except RankFailure as error:
            failure = str(error)
        results_file = os.path.join(workdir, "results.jsonl")
        done = []
        if os.path.exists(results_file):
            with open(results_file) as handle:
                done = [json.loads(line) for line in handle if line.strip()]
        shutil.rmtree(workdir, ignore_errors=True)
        verdicts += done
        pending = pending[len(done) :]
        if pending and (failure or not done):
            verdicts.append({"category": "hang", "detail": [failure[-3000:]]})
            pending = pending[1:]
    return verdicts
