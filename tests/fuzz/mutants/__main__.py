"""``python -m tests.fuzz.mutants [--only NAME,...] [--seeds N] [--rev REV]``: the fuzzer, as CI runs it
(``test_fuzz.CI_SEEDS`` at 2 ranks), against each planted bug in a temporary copy of ``src/`` and ``tests/`` (of
commit REV, HEAD by default, or of the working tree: ``--rev worktree``); prints caught/missed per mutant (the
verdict and first catching seed) and the score. ``--demonstrate NAME|all``: the mutant's own program (``demos.py``)
passes on the clean copy and trains wrong, without an error, on the mutant. ``--list``: what each mutant breaks.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tests.fuzz.mutants.catalog import BY_NAME, MUTANTS, Mutant
from tests.fuzz.mutants.copies import mutated, snapshot
from tests.fuzz.mutants.demos import DEMO_VERDICTS, DEMOS
from tests.fuzz.mutants.score import CleanVerdicts, demonstrate, score


def _chosen(names: str | None) -> list[Mutant]:
    if not names or names == "all":
        return list(MUTANTS)
    unknown = [n for n in names.split(",") if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"unknown mutants {unknown}; known: {', '.join(BY_NAME)}")
    return [BY_NAME[n] for n in names.split(",")]


def _demonstrate(mutants: list[Mutant], root: Path, clean: Path) -> int:
    failed = 0
    for mutant in mutants:
        program, world_size = DEMOS[mutant.name]
        expect = DEMO_VERDICTS.get(mutant.name, "mismatch")
        shown, report = demonstrate(program, world_size, clean, mutated(mutant, clean, root), expect)
        failed += not shown
        print(f"{mutant.name}: {'silent wrong result shown' if shown else 'NOT SHOWN'} ({mutant.slip})", flush=True)
        print(report, flush=True)
    return 1 if failed else 0


def _score(mutants: list[Mutant], root: Path, clean: Path, args: argparse.Namespace) -> int:
    from tests.fuzz.test_fuzz import CI_SEEDS

    seeds = CI_SEEDS[: args.seeds] if args.seeds else CI_SEEDS
    verdicts = CleanVerdicts(clean, args.world_size, args.hybrid)
    print(f"{len(mutants)} mutants, {len(seeds)} seeds at {args.world_size} ranks{' (hybrid)' * args.hybrid}")
    caught = 0
    for mutant in mutants:
        result = score(mutant, mutated(mutant, clean, root), seeds, verdicts, args.world_size, args.hybrid, args.batch)
        caught += result.caught
        outcome = f"caught  {result.verdict:9s} seed {result.seed}" if result.caught else "MISSED" + " " * 19
        excused = f" (clean fails {result.excused} too)" if result.excused else ""
        print(f"  {mutant.name:28s} {outcome} {result.programs:4d} programs {result.seconds:5.0f} s{excused}")
        if result.caught:
            print(f"      {result.detail[:200]}")
        sys.stdout.flush()
    print(f"score: {caught} of {len(mutants)} caught")
    return 0 if caught == len(mutants) else 1


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.mutants", description=__doc__)
    parser.add_argument("--only", help="comma-separated mutant names (default: all)")
    parser.add_argument("--seeds", type=int, help="only the first N of CI's seeds")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hybrid", action="store_true", help="hybrid programs (with --world-size 4)")
    parser.add_argument("--batch", type=int, default=10, help="programs per spawned session")
    parser.add_argument("--demonstrate", metavar="NAME", help="show NAME (or all) to be a silent wrong result")
    parser.add_argument("--list", action="store_true")
    parser.add_argument(
        "--rev", default="HEAD", help="the commit whose src/ and tests/ are copied (default HEAD; 'worktree': the tree)"
    )
    args = parser.parse_args()
    if args.list:
        for mutant in MUTANTS:
            print(f"{mutant.name:28s} {mutant.feature}: {mutant.slip}")
        return
    with tempfile.TemporaryDirectory(prefix="distoptim-mutants-") as tmp:
        root = Path(tmp)
        clean = snapshot(root, None if args.rev == "worktree" else args.rev)
        if args.demonstrate:
            sys.exit(_demonstrate(_chosen(args.demonstrate), root, clean))
        sys.exit(_score(_chosen(args.only), root, clean, args))


if __name__ == "__main__":
    main()
