"""Running many fuzz programs in one spawned session of ranks, with each program's outcome agreed across ranks.

The ranks form their own gloo group with a short timeout (``PG_TIMEOUT``), so a program that leaves one rank in a
collective its peer never joins fails within seconds. Rank 0 appends each program's classified outcome to a file;
when a session dies (a hang, a broken group), the parent reads what finished, records the next program as
``hang``, and starts a new session with the rest. Nothing outlives ``run_on_ranks``'s timeout.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import tempfile
import warnings
from datetime import timedelta
from typing import Any

import torch.distributed as dist

import distoptim
from tests._dist import RankFailure, run_on_ranks
from tests.fuzz import modes, noise, refusals
from tests.fuzz.interpret import is_exact, run_program
from tests.fuzz.program import Program

PG_TIMEOUT = 20.0  # seconds a collective waits for a peer before the group raises
SECONDS_PER_PROGRAM = 6.0  # the session's budget per program, beyond a fixed start-up allowance
# mismatches a session measures again with more twin samples (``noise.Twins``: about 1 + RESAMPLES times a program's
# cost each, budgeted below); past them a mismatch stands as it is (a failure, never a pass)
RESAMPLED_PER_SESSION = 3
REFUSALS = ("ValueError", "RuntimeError", "TypeError")  # what distoptim documents raising
OURS = os.path.dirname(os.path.abspath(distoptim.__file__)) + os.sep  # the imported package, not any "distoptim" path
# verdicts that fail a run: ``unexpected_error`` (an error on every rank that no table entry predicts and matches,
# or not distoptim's own: a raw torch error), ``missing_refusal`` (a predicted refusal that never came),
# ``fuzzer_error`` (the comparison code itself raised: what it compared is unknown)
FAILURES = ("mismatch", "divergent", "unexpected_error", "missing_refusal", "hang", "fuzzer_error")


def _frames(text: str, torch_too: bool = False) -> list[str]:
    """The traceback's frames (outside torch unless ``torch_too``), outermost first: ``File "path", line N, in f``."""
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("File ")]
    return lines if torch_too else [line for line in lines if "/torch/" not in line]


def _raised_in(text: str, torch_too: bool = False) -> str:
    """The path of the innermost frame (outside torch unless ``torch_too``: where a torch function was called), or
    ''. With ``torch_too``, the raising frame: a torch function's own raise is torch's, not distoptim's."""
    frames = _frames(text, torch_too)
    return frames[-1].split('"')[1] if frames and frames[-1].count('"') >= 2 else ""


def _relayed(outcome: dict[str, Any], own: list[dict[str, Any]]) -> bool:
    """A rank that raised another rank's error: distoptim's agreement (``ValueError ... failed on rank N: <its
    error>``), the fuzzer's reshard (the one-rank part's error), or ``Subject.sync_finished`` (the owners')."""
    message = outcome["message"]
    if outcome["type"] == "ValueError" and " failed on rank " in message:
        return any(f"{o['type']}: " in message for o in own)
    frames = _frames(outcome.get("traceback", ""))
    in_sync = bool(frames) and "/tests/fuzz/modes.py" in frames[-1] and frames[-1].endswith(", in sync_finished")
    return in_sync and any(o["message"] == message for o in own)


def _own_errors(raised: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The errors raised on every rank with the relays of one rank's error by the others folded into it."""
    relays = [o for o in raised if o["type"] == "ValueError" and " failed on rank " in o["message"]]
    relays += [o for o in raised if o not in relays and "/tests/fuzz/modes.py" in _raised_in(o.get("traceback", ""))]
    own = [o for o in raised if o not in relays]
    if own and all(_relayed(o, own) for o in relays):
        return own
    return raised


def _action_of(mismatch: str, program: Program) -> int:
    """The action a mismatch was recorded at (``action N``, ``check at action N``; the end: after the last)."""
    found = re.search(r"\baction (\d+)", mismatch)
    return int(found.group(1)) if found else len(program.actions)


def classify(outcomes: list[dict[str, Any]], program: Program, world_size: int) -> dict[str, Any]:
    """One program's verdict from every rank's outcome; a refusal passes only where ``refusals.TABLE`` predicts
    (or allows) it for ``program`` and its message matches."""
    statuses = {o["status"] for o in outcomes}
    expected = refusals.predicted(program, world_size)
    if statuses == {"ok"}:
        mismatches = [f"rank {r}: {m}" for r, o in enumerate(outcomes) for m in o["mismatches"]]
        if expected:
            named = [f"{r.kind}: {r.scenario}" for r in expected]
            return {
                "category": "missing_refusal",
                "detail": ["no rank raised; predicted: " + "; ".join(named), *mismatches],
            }
        return {"category": "mismatch" if mismatches else "pass", "detail": mismatches[:40]}
    raised = [o for o in outcomes if o["status"] == "raised"]
    broken = [o for o in raised if o.get("side") == "fuzzer"]
    if broken:  # the comparison raised on some rank: never the oracle's error, never a pass
        return {"category": "fuzzer_error", "detail": [broken[0]["message"], broken[0].get("traceback", "")]}
    if len(raised) < len(outcomes):
        first = raised[0]
        return {
            "category": "divergent",
            "detail": [
                f"{first['type']} at {first['at']} on some ranks only: {first['message']}",
                first.get("traceback", ""),
            ],
        }
    error = f"{raised[0]['type']} at {raised[0]['at']}: {raised[0]['message']}"
    text = " ".join(o["message"] for o in raised)
    if "Timed out" in text or "Connection closed" in text or "Connection reset" in text:
        return {"category": "hang", "detail": [raised[0]["message"], raised[0].get("traceback", "")]}
    own = _own_errors(raised)
    refusal = refusals.matching(program, world_size, f"{own[0]['type']}: {own[0]['message']}")
    stale = None if refusal is None else refusal.stale_from(program)  # a refusal the library defers by design
    before = [
        f"rank {r}: {m}"
        for r, o in enumerate(outcomes)
        for m in o.get("mismatches", [])
        if stale is None or _action_of(m, program) < stale
    ]
    if before:  # a wrong value seen before the error stands, whatever the error
        return {"category": "mismatch", "detail": [*before[:40], f"then every rank raised: {error}"]}
    # the side the interpreter ran when it raised (``interpret.Run.on``), not guessed from the traceback: a library
    # bug raising inside the subject's forward (the fuzzer's models.py) once read as the oracle's error, a pass
    if any(o["side"] == "oracle" for o in own):
        return {"category": "oracle_error", "detail": [own[0]["message"], own[0].get("traceback", "")]}
    first = own[0]
    alike = len({(o["type"], o["at"], o["message"]) for o in own}) == 1
    ours = all(_raised_in(o.get("traceback", ""), torch_too=True).startswith(OURS) for o in own)
    if alike and ours and first["type"] in REFUSALS and refusal is not None:
        return {
            "category": "refused",
            "kind": refusal.kind,
            "detail": [f"{first['type']} at {first['at']}: {first['message']}"],
        }
    why = "no refusal predicted matches" if ours else "not raised by distoptim"
    return {
        "category": "unexpected_error",
        "detail": [
            f"{first['type']} at {first['at']} ({why}; predicted: {[r.kind for r in expected]}): {first['message']}",
            *(f"{o['type']} at {o['at']}: {o['message']}" for o in own[1:]),
            first.get("traceback", ""),
        ],
    }


def refusal_summary(verdicts: list[dict[str, Any]]) -> list[str]:
    """The refusals by kind and the refused share, as printed after each run."""
    kinds = collections.Counter(v.get("kind", "?") for v in verdicts if v["category"] == "refused")
    share = sum(kinds.values()) / max(1, len(verdicts))
    lines = [f"refused: {sum(kinds.values())} of {len(verdicts)} programs ({share:.0%})"]
    return lines + [f"  refused x{count}: {kind}" for kind, count in kinds.most_common()]


def _verdict(program: Program, workdir: str, world_size: int, samples: int = 1) -> dict[str, Any]:
    outcomes: list[Any] = [None] * world_size
    dist.all_gather_object(outcomes, run_program(program, workdir, samples))
    return classify(outcomes, program, world_size)


def _session(rank: int, world_size: int, programs: list[str], workdir: str, pg_timeout: float) -> None:
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", timeout=timedelta(seconds=pg_timeout), rank=rank, world_size=world_size)
    resampled = 0
    for index, text in enumerate(programs):
        with open(os.path.join(workdir, f"progress-{rank}"), "w") as handle:
            handle.write(str(index))
        program = Program.from_json(text)
        verdict = _verdict(program, workdir, world_size)
        inexact = verdict["category"] == "mismatch" and not is_exact(program, world_size)
        if inexact and resampled < RESAMPLED_PER_SESSION:  # noise.Twins: more samples
            first, resampled = verdict, resampled + 1
            verdict = _verdict(program, workdir, world_size, samples=1 + noise.RESAMPLES)
            verdict["resampled"] = first["detail"][:3]
        if rank == 0:
            with open(os.path.join(workdir, "results.jsonl"), "a") as handle:
                handle.write(json.dumps(verdict) + "\n")
        if verdict["category"] == "hang":
            return  # the group may be broken: the parent starts a new session for the rest
        if any(action.name == "failed_backward" for action in program.actions):  # its ranks may have launched
            dist.destroy_process_group()  # different reductions: the group's tags apart, a wrapper on it refused
            modes.forget_groups()
            store = f"file://{os.path.join(workdir, f'group-{index}')}"
            dist.init_process_group("gloo", store, timedelta(seconds=pg_timeout), rank=rank, world_size=world_size)
    dist.destroy_process_group()


def run_programs(programs: list[Program], world_size: int = 2, pg_timeout: float = PG_TIMEOUT) -> list[dict[str, Any]]:
    """Every program's verdict (``category``: pass, refused (with its ``kind``), oracle_error, or one of
    ``FAILURES``)."""
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
                timeout=30
                + pg_timeout
                + SECONDS_PER_PROGRAM * (len(pending) + RESAMPLED_PER_SESSION * noise.RESAMPLES),
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
