"""``python -m tests.fuzz --seeds N [--start S] [--world-size W] [--shrink]``: run fuzz programs, print failures.

``--program JSON`` reruns one (shrunk) program as printed; ``--actions``/``--modes`` switch parts off.
Failures are mismatch, divergent (ranks disagree: a hang risk), unexpected_error (an error on every rank that the
refusal table, ``refusals.py``, does not predict and match), missing_refusal (a predicted refusal that never came)
and hang; refused (a predicted refusal, its message matched) and oracle_error (plain DDP could not run the program)
are counted, not failures. The exit status is 1 when any failure was reported.
"""

from __future__ import annotations

import argparse
import collections
import signal
import sys
import time
from collections.abc import Iterator

from tests.fuzz import known
from tests.fuzz.program import ACTIONS, MODES, Program, generate
from tests.fuzz.session import FAILURES, refusal_summary, run_programs
from tests.fuzz.shrink import shrink

__all__ = ["FAILURES", "rerun_command", "run_batched"]
BATCH = 25  # programs per spawned session (a hang costs at most the rest of a batch's budget)


def rerun_command(program: Program, world_size: int) -> str:
    return f"PYTHONPATH=$PWD/src python -m tests.fuzz --world-size {world_size} --program '{program.to_json()}'"


def run_batched(programs: list[Program], world_size: int) -> list[dict]:
    verdicts: list[dict] = []
    for start in range(0, len(programs), BATCH):
        verdicts += run_programs(programs[start : start + BATCH], world_size)
    return verdicts


def stream(programs: Iterator[Program], world_size: int, minutes: float | None) -> Iterator[tuple[Program, dict]]:
    """Each program with its verdict, a batch at a time, each failure printed as its batch ends; stops generating
    once ``minutes`` have passed (the batch under way finishes first)."""
    began = time.monotonic()
    done = 0
    while minutes is None or time.monotonic() - began < 60 * minutes:
        batch = [p for _, p in zip(range(BATCH), programs)]
        if not batch:
            return
        for program, verdict in zip(batch, run_programs(batch, world_size)):
            done += 1
            if verdict["category"] in FAILURES:
                print(
                    f"!!! seed {program.seed} ({program.mode}): {verdict['category']}: "
                    f"{str(verdict['detail'][:1])[:300]}",
                    flush=True,
                )
                print("    rerun:", rerun_command(program, world_size), flush=True)
            yield program, verdict
        print(f"... {done} programs, last seed {batch[-1].seed}, {time.monotonic() - began:.0f} s", flush=True)


def blame(failed: list[tuple[Program, dict]], world_size: int) -> dict[int, list[str]]:
    """For each failing program, the known bugs (``known.py``), action kinds and model features whose removal alone
    makes it pass: a cheap first triage, all variants of all failures run in one batch."""
    variants: list[tuple[int, str, Program]] = []
    for program, _ in failed:
        for bug in known.triggered(program):
            variants.append((program.seed, bug, known.without(program, bug)))
        for name in sorted({a.name for a in program.actions}):
            kept = [a for a in program.actions if a.name != name]
            variants.append((program.seed, name, program.replace(actions=kept)))
        for feature in program.features:
            smaller = program.replace(features=[f for f in program.features if f != feature])
            variants.append((program.seed, f"model:{feature}", smaller))
    verdicts = run_batched([v[2] for v in variants], world_size)
    culprits: dict[int, list[str]] = {}
    for (seed, name, _), verdict in zip(variants, verdicts):
        if verdict["category"] in ("pass", "refused"):
            culprits.setdefault(seed, []).append(name)
    return culprits


def report(program: Program, verdict: dict, world_size: int, do_shrink: bool) -> None:
    print(f"\n=== seed {program.seed}: {verdict['category']} ({program.mode})")
    for line in verdict["detail"][: 40 if do_shrink else 4]:
        print("   ", str(line)[-1500:])
    if do_shrink:
        program = shrink(program, verdict["category"], lambda ps: run_batched(ps, world_size))
        print("--- shrunk program:")
    print(program.text())
    print("--- rerun:", rerun_command(program, world_size))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--shrink", action="store_true", help="shrink each failure to a minimal program")
    parser.add_argument("--program", help="a program's JSON, as a failure prints it")
    parser.add_argument("--blame", action="store_true", help="name the action kinds each failure needs")
    parser.add_argument("--avoid-known", action="store_true", help="drop the actions that trigger known bugs")
    parser.add_argument("--only", help="comma-separated seeds to run (instead of --start/--seeds)")
    parser.add_argument("--actions", help=f"comma-separated subset of {','.join(ACTIONS)}")
    parser.add_argument("--hybrid", action="store_true", help="hybrid sharding (shard pairs, replicate): 4 ranks")
    parser.add_argument("--minutes", type=float, help="stop generating after M minutes, then print the summary")
    parser.add_argument("--modes", help=f"comma-separated subset of {','.join(MODES)}")
    args = parser.parse_args()
    if args.program:
        source: Iterator[Program] = iter([Program.from_json(args.program)])
    else:
        actions = set(args.actions.split(",")) if args.actions else None
        modes = tuple(args.modes.split(",")) if args.modes else MODES
        seeds = [int(s) for s in args.only.split(",")] if args.only else range(args.start, args.start + args.seeds)
        source = (generate(seed, actions, modes, args.hybrid) for seed in seeds)
        if args.avoid_known:
            source = (known.avoiding_known(p) for p in source)
    began = time.monotonic()
    programs: list[Program] = []
    verdicts: list[dict] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # timeout(1): still print the summary below
    try:
        for program, verdict in stream(source, args.world_size, args.minutes):
            programs.append(program)
            verdicts.append(verdict)
    except (KeyboardInterrupt, SystemExit):
        print("\n(interrupted: the summary covers the programs that finished)", flush=True)
    counts = collections.Counter((v["category"], p.mode) for p, v in zip(programs, verdicts))
    failed = [(p, v) for p, v in zip(programs, verdicts) if v["category"] in FAILURES]
    for program, verdict in failed:
        report(program, verdict, args.world_size, args.shrink)
    if args.blame and failed:
        print("\nblame (removing these alone makes the program pass):")
        culprits = blame(failed, args.world_size)
        for program, verdict in failed:
            named = culprits.get(program.seed, ["(no single kind)"])
            print(f"  seed {program.seed:5d} {program.mode:12s} {verdict['category']:9s} {named}")
    print(f"\n{len(programs)} programs at {args.world_size} ranks in {time.monotonic() - began:.0f} s")
    for (category, mode), count in sorted(counts.items()):
        print(f"  {category:12s} {mode:12s} {count}")
    for line in refusal_summary(verdicts):  # by the refusal table's kind (refusals.py)
        print(f"  {line}")
    for program, verdict in zip(programs, verdicts):  # a first sample's mismatch that more twin samples measured
        if "resampled" in verdict:
            first = verdict["resampled"][0][:110]  # the first sample's mismatch, not the final verdict's detail
            print(f"  resampled seed {program.seed}: {verdict['category']} (the first sample had: {first})")
    for program, verdict in zip(programs, verdicts):  # the fuzzer's own gaps: programs plain DDP cannot run
        if verdict["category"] == "oracle_error":
            print(f"  oracle_error seed {program.seed}: {verdict['detail'][0][:160]}")
    if failed:  # a run that reported a failure fails (scripts, CI, ``timeout`` wrappers read the exit status)
        sys.exit(1)


if __name__ == "__main__":
    main()
