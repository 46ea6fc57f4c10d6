"""Agreement across ranks: each rank does its part, then one small all-reduce tells every rank whether all of them
succeeded and whether their fingerprints match, so that all ranks raise the same clear error or none does.

A fingerprint maps "what {} is" templates to canonical values; when two ranks disagree, a second round gathers
the fingerprints and names the first difference, with both values in the template's "{}". Nothing here needs numpy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from distoptim.zero import comm

__all__ = ["SAME_EVERYWHERE", "Fingerprint", "agree_across_ranks", "run_agreed", "run_step_agreed"]

Fingerprint = dict[str, Any]  # "what {} is" -> a canonical value; "{}" takes "<mine> vs <theirs>" in messages

_DIGEST_WORDS = 4  # 4 x 62 bits of a sha256: non-negative int64 words whose negation cannot overflow

_T = TypeVar("_T")

SAME_EVERYWHERE = (
    "every rank must pass the same parameters (shapes, dtypes, requires_grad, groups) and settings (hyperparameters "
    "included)"
)


def agree_across_ranks(
    local: Fingerprint | BaseException,
    group: comm.Group,
    what: str,
    device: torch.device | None = None,
    fix: str = SAME_EVERYWHERE,
) -> None:
    """Raise on every rank unless every rank succeeded (``local`` is its fingerprint) and all fingerprints agree.

    One all-reduce (MAX) of ``[failed, -failed, digest, -digest]`` tells every rank whether any or all failed and
    whether the digests' maxima equal their minima. A failing rank raises its own error; the others name it.
    ``device``: the communication device, ``comm.comm_device(group)`` when None.
    """
    device = comm.comm_device(group) if device is None else device
    failed = isinstance(local, BaseException)
    words = [0] * _DIGEST_WORDS if isinstance(local, BaseException) else _digest(local)
    summary = torch.tensor([int(failed), -int(failed), *words, *(-w for w in words)], dtype=torch.int64)
    maxima = comm.all_reduce_(summary.to(device), group, "max").tolist()
    any_failed, all_failed = maxima[0] == 1, -maxima[1] == 1
    agreed = maxima[2 : 2 + _DIGEST_WORDS] == [-w for w in maxima[2 + _DIGEST_WORDS :]]
    if isinstance(local, BaseException) and all_failed:
        raise local
    if any_failed:
        texts = comm.all_gather_objects(f"{type(local).__name__}: {local}" if failed else None, group, device)
        if isinstance(local, BaseException):
            raise local
        rank, message = next((rank, text) for rank, text in enumerate(texts) if text is not None)
        raise ValueError(f"{what} failed on rank {rank}: {message}")
    if not isinstance(local, BaseException) and not agreed:
        _raise_first_disagreement(local, comm.all_gather_objects(local, group, device), group, what, fix)


def _digest(local: Fingerprint) -> list[int]:
    encoded = hashlib.sha256(repr(list(local.items())).encode()).digest()
    return [int.from_bytes(encoded[8 * i : 8 * i + 8], "little") >> 2 for i in range(_DIGEST_WORDS)]


def run_agreed(
    action: Callable[[], _T],
    group: comm.Group,
    what: str,
    device: torch.device | None = None,
    errors: tuple[type[BaseException], ...] = (Exception,),
    then_agree_on: Callable[[_T], Fingerprint] = lambda result: {},
    fix: str = SAME_EVERYWHERE,
) -> _T:
    """``action()`` on this rank, with its success agreed (one all-reduce): if it raised one of ``errors`` on any
    rank, every rank raises (the failing one its own error, the others a ``ValueError`` naming it), so that no rank
    goes on to a collective the failing one never reaches. ``then_agree_on(result)``, evaluated after a successful
    ``action``, must be the same on every rank too (a ``ValueError`` with ``fix`` otherwise), in the same all-reduce."""
    outcome: Fingerprint | BaseException
    try:
        result = action()
        outcome = then_agree_on(result)
    except errors as error:
        outcome = error
    agree_across_ranks(outcome, group, what, device, fix)
    return result


def run_step_agreed(
    action: Callable[[], _T], requires_grad: Callable[[], Sequence[bool]], group: comm.Group, device: torch.device
) -> _T:
    """``action()``, a step's local part, then ``run_agreed``'s all-reduce: every rank raises if it raised on any, or
    if the ranks now train different parameters (``requires_grad()``, changed on some ranks only)."""

    def trained(result: _T) -> Fingerprint:
        return {"the parameters that require grad, by index: {}": tuple(i for i, r in enumerate(requires_grad()) if r)}

    fix = "change requires_grad alike on every rank, between the same two steps"
    return run_agreed(action, group, "step", device, then_agree_on=trained, fix=fix)


def _raise_first_disagreement(
    local: Fingerprint, everyone: list[Fingerprint], group: comm.Group, what: str, fix: str
) -> None:
    me = comm.group_rank(group)
    for rank, other in enumerate(everyone):
        difference = _first_difference(local, other)
        if difference is not None:
            raise ValueError(f"{what}: rank {me} and rank {rank} disagree ({difference}); {fix}")
    raise ValueError(f"{what}: the ranks' fingerprints differ but rank {me} agrees with all of them")


def _first_difference(mine: Fingerprint, theirs: Fingerprint) -> str | None:
    for template in [*mine, *(key for key in theirs if key not in mine)]:
        a, b = (_show(side, template) for side in (mine, theirs))
        if a != b:
            return template.replace("{}", f"{a} vs {b}", 1)
    return None


def _show(entries: Fingerprint, template: str) -> str:
    return repr(entries[template]) if template in entries else "(not set)"
