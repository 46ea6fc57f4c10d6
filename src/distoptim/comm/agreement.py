"""Agreement across ranks: each rank does its part, then one small all-reduce of host values tells every rank whether
all succeeded and their fingerprints match, so that all ranks raise the same error or none does."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from distoptim.comm.groups import control_group
from distoptim.comm.objects import all_gather_objects, release

__all__ = [
    "SAME_EVERYWHERE",
    "STEPPING_ONLY",
    "STEP_FIX",
    "Fingerprint",
    "agree_across_ranks",
    "run_agreed",
    "run_step_agreed",
]

Fingerprint = dict[str, Any]  # "what {} is" -> a canonical value; "{}" takes "<mine> vs <theirs>" in messages

_DIGEST_WORDS = 4  # 4 x 62 bits of a sha256: non-negative int64 words whose negation cannot overflow
_ABSENT = -(1 << 62)  # a rank without a STEPPING_ONLY part: below every negated digest word, so it moves no maximum

STEPPING_ONLY = "(compared among the ranks stepping only)"
"""A fingerprint's key whose value (a fingerprint) only the ranks giving it compare (a rank joined under Join: none)."""

_T = TypeVar("_T")

SAME_EVERYWHERE = (
    "every rank must pass the same parameters (shapes, dtypes, requires_grad, groups) and settings (hyperparameters "
    "included)"
)


Groups = dist.ProcessGroup | Sequence[dist.ProcessGroup]
"""A group, or groups whose union is agreed over (hybrid sharding: a shard group and its replicas)."""


def agree_across_ranks(
    local: Fingerprint | BaseException, group: Groups, what: str, fix: str = SAME_EVERYWHERE, flags: Sequence[bool] = ()
) -> tuple[bool, ...]:
    """Raise on every rank (a failing one its own error, the others naming it) unless every rank succeeded (``local``:
    its fingerprint) and all fingerprints agree; return, for each of ``flags``, whether any rank raised it."""
    groups = [group] if isinstance(group, dist.ProcessGroup) else list(group)
    controls, cpu = [control_group(g) for g in groups], torch.device("cpu")
    failed = isinstance(local, BaseException)
    always, optional = (None, None) if isinstance(local, BaseException) else (_always(local), local.get(STEPPING_ONLY))
    summary = torch.tensor(
        [int(failed), -int(failed), *map(int, flags), *_words(always), *_words(optional)], dtype=torch.int64
    )
    for control in controls:  # the maxima over each group in turn: the maxima over their union
        dist.all_reduce(summary, op=dist.ReduceOp.MAX, group=control)
    release(summary)  # gloo's thread lets go of it now, not while the interpreter exits (an abort)
    maxima = summary.tolist()  # a CPU tensor: no device to wait for
    any_failed, all_failed = maxima[0] == 1, -maxima[1] == 1
    flagged, digests = tuple(value == 1 for value in maxima[2 : 2 + len(flags)]), maxima[2 + len(flags) :]
    if isinstance(local, BaseException) and all_failed:
        raise local
    if any_failed:
        text = f"{type(local).__name__}: {local}" if failed else None
        found = _first_of_everyone(text, controls, len(controls) > 1)
        if isinstance(local, BaseException):
            raise local
        shown = f"rank {found[0]}: {found[1]}" if found is not None else "a rank of another group (see its error)"
        raise ValueError(f"{what} failed on {shown}")
    n = 2 * _DIGEST_WORDS
    if not isinstance(local, BaseException) and not (_agreed(digests[:n]) and _agreed(digests[n:])):
        gathered = [(control, all_gather_objects(local, control, cpu)) for control in controls]  # every rank, each
        for control, everyone in gathered:  # group (a rank raising at its first group left the others waiting)
            _raise_first_disagreement(local, everyone, control, what, fix)
        raise ValueError(f"{what}: the ranks' settings differ (between groups of ranks); {fix}")
    return flagged


def _first_of_everyone(value: Any, controls: list[dist.ProcessGroup], global_ranks: bool) -> tuple[Any, Any] | None:
    """The first rank (a group rank, or a global one over several groups) whose ``value`` is not None, and it; every
    rank gathers over every group (one returning at its first group left the others waiting in their next)."""
    gathered = [(control, all_gather_objects(value, control, torch.device("cpu"))) for control in controls]
    for control, values in gathered:
        for rank, other in enumerate(values):
            if other is not None:
                return (dist.get_global_rank(control, rank) if global_ranks else rank), other
    return None


def _words(part: Fingerprint | None) -> list[int]:
    """A part's digest words and their negations; zeros and ``_ABSENT`` (moving no maximum) where there is none."""
    if part is None:
        return [0] * _DIGEST_WORDS + [_ABSENT] * _DIGEST_WORDS
    encoded = hashlib.sha256(repr(list(part.items())).encode()).digest()
    words = [int.from_bytes(encoded[8 * i : 8 * i + 8], "little") >> 2 for i in range(_DIGEST_WORDS)]
    return [*words, *(-w for w in words)]


def _agreed(maxima: list[int]) -> bool:
    """Whether a part's digest maxima equal its minima (the negated maxima), or no rank gave it."""
    n = _DIGEST_WORDS
    return maxima[n:] == [_ABSENT] * n or maxima[:n] == [-w for w in maxima[n:]]


def run_agreed(
    action: Callable[[], _T],
    group: Groups,
    what: str,
    errors: tuple[type[BaseException], ...] = (Exception,),
    then_agree_on: Callable[[_T], Fingerprint] = lambda result: {},
    fix: str = SAME_EVERYWHERE,
) -> _T:
    """``action()`` on this rank, with its success agreed: if it raised one of ``errors`` on any rank, every rank
    raises. ``then_agree_on(result)`` must be the same on every rank too (a ``ValueError`` with ``fix`` otherwise)."""
    return _run(action, group, what, errors, then_agree_on, fix, lambda _: ())[0]


def _run(
    action: Callable[[], _T],
    group: Groups,
    what: str,
    errors: tuple[type[BaseException], ...],
    then_agree_on: Callable[[_T], Fingerprint],
    fix: str,
    flags: Callable[[_T | None], Sequence[bool]],
) -> tuple[_T, tuple[bool, ...]]:
    outcome: Fingerprint | BaseException
    raised = flags(None)  # a failing rank raises none of them
    try:
        result = action()
        outcome, raised = then_agree_on(result), flags(result)
    except errors as error:
        outcome = error
    flagged = agree_across_ranks(outcome, group, what, fix, raised)  # raises on every rank if any action raised
    return result, flagged


STEP_FIX = "change requires_grad and hyperparameters alike on every rank, between the same two steps"


def run_step_agreed(
    action: Callable[[], _T],
    fingerprint: Callable[[], Fingerprint],
    group: Groups,
    flags: Callable[[_T | None], Sequence[bool]] = lambda result: (),
    joined: bool = False,
) -> tuple[_T, tuple[bool, ...]]:
    """``action()``, a step's local part, agreed as ``run_agreed`` with ``fingerprint()``; returns its result and,
    for each of ``flags(result)``, whether it held on any rank. A ``joined`` rank leaves out ``STEPPING_ONLY``."""
    agreed_on = (lambda _: _always(fingerprint())) if joined else (lambda _: fingerprint())
    return _run(action, group, "step", (Exception,), agreed_on, STEP_FIX, flags)


def _always(local: Fingerprint) -> Fingerprint:
    return {key: value for key, value in local.items() if key != STEPPING_ONLY}


def _raise_first_disagreement(
    local: Fingerprint, everyone: list[Fingerprint], group: dist.ProcessGroup, what: str, fix: str
) -> None:
    """Name the first difference this rank sees, else (a joined rank) the first between two others."""
    me = dist.get_rank(group)
    pairs = [(me, rank) for rank in range(len(everyone))]
    pairs += [(a, b) for a in range(len(everyone)) for b in range(a + 1, len(everyone))]
    for a, b in pairs:
        difference = _first_difference(local if a == me else everyone[a], everyone[b])
        if difference is not None:
            raise ValueError(f"{what}: rank {a} and rank {b} disagree ({difference}); {fix}")


def _first_difference(mine: Fingerprint, theirs: Fingerprint) -> str | None:
    """The first entry that differs; ``STEPPING_ONLY`` entries only where both ranks give them."""
    if STEPPING_ONLY in mine and STEPPING_ONLY in theirs:
        mine, theirs = ({**_always(side), **side[STEPPING_ONLY]} for side in (mine, theirs))
    else:
        mine, theirs = _always(mine), _always(theirs)
    for template in [*mine, *(key for key in theirs if key not in mine)]:
        a, b = (repr(side[template]) if template in side else "(not set)" for side in (mine, theirs))
        if a != b:
            return template.replace("{}", f"{a} vs {b}", 1)
    return None
