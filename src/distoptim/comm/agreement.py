"""Agreement across ranks: each rank does its part, then one small all-reduce tells every rank whether all of them
succeeded and whether their fingerprints match, so that all ranks raise the same clear error or none does.

A fingerprint maps "what {} is" templates to canonical values; when two ranks disagree, a second round gathers
the fingerprints and names the first difference, with both values in the template's "{}". Nothing here needs numpy.
Agreements travel on the group's control twin (``_groups.control_group``: the group itself under gloo, a gloo twin
under NCCL): their values are host values, and reading a GPU tensor back would stall the CPU on the GPU's queue.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from distoptim.comm.groups import control_group
from distoptim.comm.objects import all_gather_objects
from distoptim.comm.released import release

__all__ = ["SAME_EVERYWHERE", "STEP_FIX", "Fingerprint", "agree_across_ranks", "run_agreed", "run_step_agreed"]

Fingerprint = dict[str, Any]  # "what {} is" -> a canonical value; "{}" takes "<mine> vs <theirs>" in messages

_DIGEST_WORDS = 4  # 4 x 62 bits of a sha256: non-negative int64 words whose negation cannot overflow

_T = TypeVar("_T")

SAME_EVERYWHERE = (
    "every rank must pass the same parameters (shapes, dtypes, requires_grad, groups) and settings (hyperparameters "
    "included)"
)


Groups = dist.ProcessGroup | Sequence[dist.ProcessGroup]
"""A group, or groups whose union is agreed over (hybrid sharding: a shard group and its replicas)."""


def agree_across_ranks(
    local: Fingerprint | BaseException,
    group: Groups,
    what: str,
    fix: str = SAME_EVERYWHERE,
    flags: Sequence[bool] = (),
) -> tuple[bool, ...]:
    """Raise on every rank unless every rank succeeded (``local`` is its fingerprint) and all fingerprints agree;
    return, for each of ``flags`` (verdicts carried along, such as "a gradient held an inf"), whether any rank raised
    it. Every rank must pass as many flags.

    One all-reduce (MAX) of ``[failed, -failed, flags, digest, -digest]`` over each group's control twin in turn
    tells every rank whether any or all failed and whether the digests' maxima equal their minima. A failing rank
    raises its own error; the others name it.
    """
    groups = [group] if isinstance(group, dist.ProcessGroup) else list(group)
    controls, cpu = [control_group(g) for g in groups], torch.device("cpu")
    failed = isinstance(local, BaseException)
    words = [0] * _DIGEST_WORDS if isinstance(local, BaseException) else _digest(local)
    summary = torch.tensor(
        [int(failed), -int(failed), *map(int, flags), *words, *(-w for w in words)], dtype=torch.int64
    )
    for control in controls:  # the maxima over each group in turn: the maxima over their union
        dist.all_reduce(summary, op=dist.ReduceOp.MAX, group=control)
    release(summary)  # gloo's thread lets go of it now, not while the interpreter exits (an abort)
    maxima = summary.tolist()  # a CPU tensor: no device to wait for
    any_failed, all_failed = maxima[0] == 1, -maxima[1] == 1
    flagged, digests = tuple(value == 1 for value in maxima[2 : 2 + len(flags)]), maxima[2 + len(flags) :]
    agreed = digests[:_DIGEST_WORDS] == [-w for w in digests[_DIGEST_WORDS:]]
    if isinstance(local, BaseException) and all_failed:
        raise local
    if any_failed:
        text = f"{type(local).__name__}: {local}" if failed else None
        found = _first_of_everyone(text, controls, len(controls) > 1)
        if isinstance(local, BaseException):
            raise local
        rank, message = found if found is not None else ("of another group", "(see that rank's error)")
        raise ValueError(f"{what} failed on rank {rank}: {message}")
    if not isinstance(local, BaseException) and not agreed:
        for control in controls:
            _raise_first_disagreement(local, all_gather_objects(local, control, cpu), control, what, fix)
        raise ValueError(f"{what}: the ranks' settings differ (between groups of ranks); {fix}")
    return flagged


def _first_of_everyone(value: Any, controls: list[dist.ProcessGroup], global_ranks: bool) -> tuple[Any, Any] | None:
    """The first rank (a group rank, or a global one over several groups) whose ``value`` is not None, and it."""
    for control in controls:
        values = all_gather_objects(value, control, torch.device("cpu"))
        for rank, other in enumerate(values):
            if other is not None:
                return (dist.get_global_rank(control, rank) if global_ranks else rank), other
    return None


def _digest(local: Fingerprint) -> list[int]:
    encoded = hashlib.sha256(repr(list(local.items())).encode()).digest()
    return [int.from_bytes(encoded[8 * i : 8 * i + 8], "little") >> 2 for i in range(_DIGEST_WORDS)]


def run_agreed(
    action: Callable[[], _T],
    group: Groups,
    what: str,
    errors: tuple[type[BaseException], ...] = (Exception,),
    then_agree_on: Callable[[_T], Fingerprint] = lambda result: {},
    fix: str = SAME_EVERYWHERE,
) -> _T:
    """``action()`` on this rank, with its success agreed (one all-reduce): if it raised one of ``errors`` on any
    rank, every rank raises (the failing one its own error, the others a ``ValueError`` naming it), so that no rank
    goes on to a collective the failing one never reaches. ``then_agree_on(result)``, evaluated after a successful
    ``action``, must be the same on every rank too (a ``ValueError`` with ``fix`` otherwise), in the same all-reduce."""
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
) -> tuple[_T, tuple[bool, ...]]:
    """``action()``, a step's local part, then ``run_agreed``'s all-reduce: every rank raises if it raised on any, or
    if the ranks' ``fingerprint()`` (which parameters they train, with which hyperparameters) now differ because a
    setting was changed on some ranks only. Returns the action's result and, for each of ``flags(result)``
    (``flags(None)`` on a rank whose action raised: as many, all False), whether it held on any rank."""
    return _run(action, group, "step", (Exception,), lambda _: fingerprint(), STEP_FIX, flags)


def _raise_first_disagreement(
    local: Fingerprint, everyone: list[Fingerprint], group: dist.ProcessGroup, what: str, fix: str
) -> None:
    me = dist.get_rank(group)
    for rank, other in enumerate(everyone):
        difference = _first_difference(local, other)
        if difference is not None:
            raise ValueError(f"{what}: rank {me} and rank {rank} disagree ({difference}); {fix}")


def _first_difference(mine: Fingerprint, theirs: Fingerprint) -> str | None:
    for template in [*mine, *(key for key in theirs if key not in mine)]:
        a, b = (_show(side, template) for side in (mine, theirs))
        if a != b:
            return template.replace("{}", f"{a} vs {b}", 1)
    return None


def _show(entries: Fingerprint, template: str) -> str:
    return repr(entries[template]) if template in entries else "(not set)"
