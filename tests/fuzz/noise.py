"""Noise measured, not assumed: the allowance of an inexact program (a bf16 layer, a clip, 3 ranks, Newton-Schulz)
comes from a second oracle run in the same session that differs from the first only by rounding.

``run_program`` (interpret.py) runs an inexact program twice on every rank. First as its ``twin``: the oracle's
local gradients moved one ulp up (``one_ulp_up``, a tensor hook on each parameter: every summand of every reduction
moves, so a sum that cancels moves by its summands' ulps, as a reduction in another order does; a bf16 gradient,
and a matrix Muon orthogonalizes in bf16, by a bf16 ulp), its values recorded at each comparison. Then for real:
each element of the subject within ``FACTOR`` times the twin's distance from the oracle there (or that distance's
rms over the tensor, if larger; at least ``OUTLIER`` times its largest in the tensor), plus ``floor``
(fp32: ``FLOOR_ULPS`` ulps of the element and its tensor's mean per step; bf16: of the element). The
subject's trajectory never depends on the oracle, so both passes see the same subject. Neither oracle is ever
aligned to the subject: an allowance is what the twin drifted since the start, never carried past an alignment,
and a slow drift of the subject adds up until it leaves the allowance.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

# the subject may be this many times as far from the oracle as the twin is, at the element or in its tensor's rms
# (a rounding difference lands on other elements in the subject than in the twin: bf16 sums, near-zero gradients)
FACTOR = 8.0
# ... and at least this many times the twin's largest distance in the tensor: a rounding-sized gradient (nearly
# cancelling) that an adaptive optimizer turns into a whole update lands on one element in the twin, another in
# the subject
OUTLIER = 2.0
# an element whose gradient has no sign (``signless``) may be off by this many times the oracle's update of it, per
# step from then on: a sign flip turns an update into its opposite (2), plus weight decay's share of the update
SIGNLESS_UPDATES = 3.0
FLOOR_ULPS = 4  # ulps (of the element, plus of its tensor's mean magnitude) allowed per unaligned step regardless
# a bf16 tensor without master weights: ulps of the element alone per unaligned step (each step rounds it once);
# with masters one bf16 ulp of the element in all (the master's rounding to the parameter), the rest measured
BF16_ULPS = 1
Record = dict[str, Tensor]  # what a pass saw at each comparison: "where|what" -> the oracle's value
_DIRECTIONS = torch.Generator().manual_seed(0)  # a bf16 gradient's elements move up or down, as orders round them
RESAMPLES = 16  # more twin samples for an inexact program's mismatch (``Twins``), each fp32 element either way too
# ... and an element may be this many times the farthest later sample's distance (``Twins``): a sample that rounds
# the same element as the subject lands about as far, give or take what follows it
RESAMPLED_FACTOR = 4.0
_either_way = {"fp32 too": False}


def draw(seed: int, sample: int) -> None:
    """Which twin sample the next twin pass is: its directions from the program's ``seed`` (a verdict must not depend
    on the program's place in a session: hybrid seed 10), and past the first, fp32 elements up or down too."""
    _DIRECTIONS.manual_seed(seed + 1_000_003 * sample)
    _either_way["fp32 too"] = sample > 0


def one_bf16_ulp_up(grad: Tensor) -> Tensor:
    """The twin's hook on a matrix Muon steps: Newton-Schulz runs in bf16, where an fp32 ulp mostly vanishes and a
    reduction in another order now and then moves an element by a bf16 ulp: every element to the next bf16 value
    up (in a later sample, ``draw``, up or down at random)."""
    up = torch.nextafter(grad.bfloat16(), torch.full_like(grad, math.inf, dtype=torch.bfloat16)).to(grad.dtype)
    if not _either_way["fp32 too"]:
        return up
    down = torch.randint(0, 2, grad.shape, generator=_DIRECTIONS).bool()  # a later sample: either way
    return torch.where(down, 2 * grad - up, up)


def one_ulp_up(grad: Tensor) -> Tensor:
    """The twin's gradient hook: every element one ulp of its dtype up (toward +inf)."""
    if grad.is_sparse:
        grad = grad.coalesce()
        values = grad.values()
        up = torch.nextafter(values, torch.full_like(values, math.inf))
        return torch.sparse_coo_tensor(grad.indices(), up, grad.size())
    return torch.nextafter(grad, torch.full_like(grad, math.inf))


def one_ulp_up_of_sum(param: Tensor) -> Any:
    """The twin's hook on ``param``: its gradient one ulp up, of the gradient or of what it accumulates into,
    whichever is larger. A sum accumulated before its reduction (DDP: ``.grad`` then the all-reduce) rounds where
    one accumulated after it (``ShardedDataParallel``: each backward reduced, then added) does not: in bf16 a whole
    ulp of the accumulated gradient (seed 100670: three micro-batches, Adam). A bf16 gradient's elements move up or
    down at random: another reduction order rounds each either way, and all moving up rounds fewer of the bf16
    weights after them across a tie (3 ranks: seeds 301066, 301590, 301622 within the twin's measure only so)."""

    def hook(grad: Tensor) -> Tensor:
        up = one_ulp_up(grad)
        held = param.grad
        if grad.is_sparse or held is None or held.is_sparse or held.shape != grad.shape:
            return up
        total = held + grad
        ulp_of_total = torch.nextafter(total, torch.full_like(total, math.inf)) - total
        return torch.where(ulp_of_total > up - grad, grad + ulp_of_total, up)

    def either_way(grad: Tensor) -> Tensor:
        moved = hook(grad)
        if grad.is_sparse or (grad.dtype != torch.bfloat16 and not _either_way["fp32 too"]):
            return moved
        down = torch.randint(0, 2, grad.shape, generator=_DIRECTIONS).bool()
        return torch.where(down, grad - (moved - grad), moved)

    return either_way


def signless(grad: Tensor, twin: Tensor) -> Tensor:
    """Per element: whether the oracle's averaged gradient is within ``FACTOR`` times the twin's distance from it (or
    that distance's rms over the tensor) of zero, so that its sign is the rounding's."""
    g = grad.detach().float()
    apart = (twin.detach().float() - g).abs()
    spread = apart.square().mean().sqrt() if apart.numel() else apart.sum()
    return g.abs() < FACTOR * torch.maximum(apart, spread)  # strict: a gradient exactly 0 with no noise has none


def floor(want: Tensor, steps: int, dtype: torch.dtype = torch.float32, masters: bool = False) -> Tensor:
    """What any element may be off without a measurement (the twin can be exactly right where the subject rounds
    once): in fp32 ``FLOOR_ULPS`` ulps of itself and of its tensor's mean magnitude per unaligned step; in bf16 (or
    fp16) ``BF16_ULPS`` of itself per step, or with master weights one ulp of itself in all (4 ulps of the mean
    per step grew to 31% of the median weight after 5 steps: issue 42's review)."""
    want = want.detach().float()
    eps = torch.finfo(dtype).eps
    if torch.finfo(dtype).bits < 32:
        return eps * want.abs() * (1 if masters else steps * BF16_ULPS)
    scale = want.abs().mean() if want.numel() else torch.tensor(0.0)
    return steps * FLOOR_ULPS * eps * (want.abs() + scale)


def allowance(
    want: Tensor,
    twin: Tensor | None,
    steps: int,
    dtype: torch.dtype = torch.float32,
    masters: bool = False,
    farthest: Tensor | None = None,
) -> Tensor:
    """Per element: ``FACTOR`` times the twin's distance from the oracle (at least its rms over the tensor), at
    least ``OUTLIER`` times its largest in the tensor, plus the floor in ``dtype`` (``masters``: a bf16 parameter
    stepped through fp32 master weights); with later samples (``Twins.farthest``) at least ``RESAMPLED_FACTOR``
    times the farthest sample's distance at the element, plus the floor."""
    want = want.detach().float()
    ulps = floor(want, steps, dtype, masters)
    if twin is None or twin.shape != want.shape:
        return ulps
    apart = (twin.detach().float() - want).abs()
    if not apart.numel():
        return ulps
    spread, largest = apart.square().mean().sqrt(), apart.max()
    measured = torch.maximum(FACTOR * torch.maximum(apart, spread), OUTLIER * largest)
    if farthest is not None and farthest.shape == want.shape:
        measured = torch.maximum(measured, RESAMPLED_FACTOR * (farthest.detach().float() - want).abs())
    return measured + ulps


def excess(where: str, got: Tensor, want: Tensor, allowed: Tensor) -> str:
    """'' if every element of ``got`` is within ``allowed`` of ``want``, else what is off."""
    a, b = got.detach().float(), want.detach().float()
    if a.shape != b.shape:
        return f"{where}: shapes {tuple(a.shape)} != {tuple(b.shape)}"
    off = (a - b).abs()
    bad = ~(off <= allowed)  # NaN counts as off
    if not bool(bad.any()):
        return ""
    worst = int(torch.where(bad, off - allowed, torch.zeros_like(off)).nan_to_num(math.inf).argmax())
    return (
        f"{where}: {int(bad.sum())} / {off.numel()} elements off, {float(off.reshape(-1)[worst]):.3g} where "
        f"{float(allowed.reshape(-1)[worst]):.3g} is allowed (the twin's distance times {FACTOR:g}, with the floor)"
    )


def excess_norm(
    where: str, got: Tensor, want: Tensor, twin: Tensor | None, steps: int, farthest: Tensor | None = None
) -> str:
    """A Muon matrix in Frobenius norm (Newton-Schulz in bf16 moves a few elements by much of themselves when the
    gradient's last bits differ, the twin's others than the subject's): within ``FACTOR`` times the twin's
    distance (or ``RESAMPLED_FACTOR`` times the farthest later sample's), plus the floor's norm."""
    b = want.detach().float()
    off = float((got.detach().float() - b).norm())
    allowed = float(floor(b, steps).norm())
    if twin is not None and twin.shape == b.shape:
        measured = FACTOR * float((twin.detach().float() - b).norm())
        if farthest is not None and farthest.shape == b.shape:
            measured = max(measured, RESAMPLED_FACTOR * float((farthest.detach().float() - b).norm()))
        allowed += measured
    if not off <= allowed:
        measured = "" if twin is not None else " (no twin: the floor alone)"
        return f"{where}: {off:.3g} off in Frobenius norm where {allowed:.3g} is allowed{measured}"
    return ""


class Twins:
    """The twin passes' records. The first sample is the measure (``FACTOR`` times its distance, ``allowance``);
    the later ones, drawn only for a mismatch (``RESAMPLES``), catch a discrete rounding the first missed: where a
    bf16 or clip rounding flips, a whole bf16 ulp moves a gradient and everything after it, and one sample now and
    then flips fewer elements than the subject (4 ranks, ``sdp``: 5 of 318 such programs 1.02x to 1.88x their
    allowance with one). A sample that flips the same element lands about as far as the subject, so an element may
    be ``RESAMPLED_FACTOR`` times the farthest sample's distance, no more: ``FACTOR`` times the farthest of five hid
    a clip coefficient 1e-3 off and an SDP bf16 gradient 1% short (issue 42's second review)."""

    def __init__(self, records: list[Record]) -> None:
        self.records = records

    def get(self, key: str) -> Tensor | None:
        """The first sample's value at ``key`` (None: not recorded)."""
        return self.records[0].get(key) if self.records else None

    def farthest(self, key: str, want: Any) -> Tensor | None:
        """Per element, the later samples' value farthest from ``want`` (None: no later sample recorded ``key``)."""
        values = [record[key] for record in self.records[1:] if key in record]
        if not values:
            return None
        farthest, target = values[0], torch.as_tensor(want).detach().float()
        for value in values[1:]:
            if value.shape == farthest.shape == target.shape:
                fuller = (value.float() - target).abs() > (farthest.float() - target).abs()
                farthest = torch.where(fuller, value, farthest)
        return farthest


class Recorder:
    """What the twin pass keeps: the oracle's value at each comparison point."""

    def __init__(self) -> None:
        self.values: Record = {}

    def keep(self, key: str, value: Any) -> None:
        self.values[key] = torch.as_tensor(value).detach().clone()


def _measure(rank: int, world_size: int, text: str, workdir: str) -> float:
    """One rank: the program's largest parameter difference between the subject and the oracle at its end."""
    from tests.fuzz.interpret import Run
    from tests.fuzz.program import Program

    program = Program.from_json(text)
    run = Run(program, workdir, record=True)  # nothing compared, nothing aligned
    for action in program.actions:
        run.do(action)
    run.subject.sync_finished()
    theirs = dict(run.oracle.model.named_parameters())
    worst = max(float((p.detach() - theirs[n].detach()).abs().max()) for n, p in run.subject.model.named_parameters())
    return worst


def measure(world_size: int, steps: int, grid: bool) -> float:
    """``ShardedDataParallel`` (even partition) against DDP + AdamW, ``steps`` steps: the largest difference."""
    import tempfile

    from tests._dist import run_on_ranks
    from tests.fuzz.program import Action, Program

    block = [
        Action("zero_grad", {"via": "optimizer", "set_to_none": True}),
        Action("backward", {"micro": 1}),
        Action("step"),
    ]
    block[1].args["no_sync"] = False
    options = {"partition": "even", "bucket_view": False, "master": False, "overlap": False, "exact": grid}
    program = Program(0, [], "sdp", options, "AdamW", {"lr": 0.01, "weight_decay": 0.1}, block * steps)
    with tempfile.TemporaryDirectory() as workdir:
        return max(run_on_ranks(_measure, world_size, program.to_json(), workdir))


if __name__ == "__main__":  # python -m tests.fuzz.noise: the grid's effect, as DESIGN.md quotes it
    for size in (2, 3, 4):
        print(
            f"{size} ranks, 6 steps: {measure(size, 6, True):.3g} with the grid, {measure(size, 6, False):.3g} without"
        )
