"""Running one fuzz program on both sides in this rank, action by action, and comparing them.

Each action is done on the subject, then on the oracle (collectives in the same order on every rank). ``check``
compares every parameter and then gives the oracle the subject's values (so a rounding difference does not compound
into the next steps' gradients; a wrong value is caught where it first appears). The end compares parameters,
buffers and the optimizer state (the consolidated ``state_dict()`` against the plain optimizer's).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

import distoptim.checkpoint
from distoptim.zero.shard import MASTER_KEY
from tests.fuzz import episodes, noise, refusals
from tests.fuzz.models import batch, layer
from tests.fuzz.modes import Oracle, Structure, build_subject
from tests.fuzz.program import Action, Program, constructor_to_load, edited_hyperparameters, inexact_parts

EVAL_STEP = 999  # the eval batches' step number (data no step trains on)
# actions after which the step may have run; ``gan`` ends with the generator's step, which a bf16 program must
# align too: unaligned, its bf16 ulps moved the next backward's fp32 gradients by 1e-3 relative, 2.5e-4 after the
# next NAdam step, where aligned they agree to 1e-9 (seed 20474; 20054, 20626, 20678, 20778, 20825 alike)
STEPS = ("step", "closure_step", "scaler_step", "backward", "gan")


class _FailedBackward(Exception):
    """Raised on purpose inside a backward (``Run.failed_backward``)."""


def _fail(*_: Any) -> None:
    raise _FailedBackward("the fuzzer's backward fails here")


def _crash(*_: Any) -> None:
    """The fuzzer's own tests (``sabotage``): a forward raising in a fuzzer frame, as a library bug can make the
    zoo's forward raise (review r-42d's G4: a bucket view of the wrong shape)."""
    raise RuntimeError("a forward crashes here (on purpose)")


SIDE = "fuzz_side"  # the attribute ``Run.on`` tags an exception with: the side that raised it


class OracleFailed(Exception):
    """The oracle itself raised: the program is not one plain DDP runs (a fuzzer problem, not distoptim's)."""


class ComparisonFailed(Exception):
    """The fuzzer's comparison code raised (``fuzzer_error``, a failure): never the oracle's error, which passes."""


def _comparing(method: Any) -> Any:
    """A comparison method whose own exceptions become ``ComparisonFailed`` (``noise.excess`` once raised on a
    column-major parameter, and the program read as ``oracle_error``)."""

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except ComparisonFailed:
            raise
        except Exception as error:
            raise ComparisonFailed(f"{method.__name__}: {type(error).__name__}: {error}") from error

    return wrapped


def same_bits(a: Tensor, b: Tensor, nan_equal: bool = False) -> bool:
    """An exact program's comparison: equal, same dtype. ``nan_equal`` (the optimizer's state only): a NaN where the
    other side has one too counts as equal. Parameters, losses and outputs are compared strictly (review r-42d: a
    NaN on both sides made every later comparison pass, so an oracle gone NaN left the rest of a program vacuous;
    an oracle that goes NaN now reads as a mismatch, visibly not a pass)."""
    if a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    if not nan_equal:
        return False
    both_nan = a.isnan() & b.isnan() if a.is_floating_point() and a.shape == b.shape else None
    return both_nan is not None and bool(((a == b) | both_nan).all())


def is_exact(program: Program, world_size: int) -> bool:
    """Compared bitwise: gradients on the grid (``models.on_grid``) at 2 or 4 ranks, where DDP's division by the
    world size is exact and every reduction order sums grid values to the same fp32 bits."""
    return bool(program.options.get("exact")) and world_size in (2, 4) and not inexact_parts(program)


def refusal_expected(program: Program) -> str:
    """Why every rank must raise for this program (``refusals.TABLE``; the oracle could then not run it: a missing
    refusal would read as ``oracle_error``), or ''."""
    return "; ".join(f"{r.kind} ({r.scenario})" for r in refusals.predicted(program, dist.get_world_size()))


class Run:
    """One pass of a program on both sides: compares (``twin``: the twin pass's record, noise.py), or with
    ``record`` keeps the oracle's values at each comparison (the twin pass)."""

    def __init__(self, program: Program, workdir: str, record: bool = False, twin: noise.Twins | None = None) -> None:
        self.program = program
        self.recorder = noise.Recorder() if record else None
        self.noise = twin or noise.Twins([])
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.workdir = workdir
        self.structure = Structure()
        self.step_number = 0
        self.aligned_at = 0  # the step number at the last alignment (check)
        self.counter = 0
        self.mismatches: list[str] = []
        self.exact = is_exact(program, self.world_size)
        self.must_refuse = refusal_expected(program)
        self.clipped_adaptive = program.optimizer != "SGD" and any(
            a.name == "clip" or (a.name == "scaler_step" and a.args.get("clip")) for a in program.actions
        )
        self.extras: dict[str, Any] = {}  # what gan() and reshard() keep between calls (episodes.py)
        self.oracle_steps = 0  # the oracle's steps so far: the key of each step's gradient in the twin's record
        self.signless: dict[str, Tensor] = {}  # per parameter: elements whose gradient had no sign (oracle_stepping)
        self.sign_slack: dict[str, Tensor] = {}  # ... and what they may be off by since
        self.side = "subject"
        self.subject = build_subject(program, self.structure)
        self.oracle = self._oracle(lambda: Oracle(program))
        if program.options.get("twin"):  # the twin steps a cut bf16 parameter in the subject's pieces (modes.py)
            self.oracle.pieces = self._pieces
        sabotage = program.options.get("sabotage")  # the fuzzer's own tests: a subject wrong on purpose
        if sabotage in ("lr", "lr_then_oracle_fails"):
            for group in self.subject.zero.param_groups:
                group["lr"] *= 1.5
        elif sabotage == "grad_tiny":  # every gradient 2.4e-4 relative too large: inside the old fp32 tolerance
            for param in self.subject.model.parameters():
                param.register_hook(lambda grad: grad * (1 + 2**-12))
        elif sabotage in ("crash_subject_forward", "crash_oracle_forward"):
            crashing = self.subject.model if sabotage == "crash_subject_forward" else self.oracle.model
            crashing.register_forward_pre_hook(_crash)
        elif sabotage == "hang" and self.rank == 0:
            dist.barrier()  # a collective the other ranks never join

    @contextlib.contextmanager
    def on(self, side: str) -> Iterator[None]:
        """The interpreter runs ``side``'s code (``oracle``: DDP + the plain optimizer; anything else the subject's,
        the default): an exception raised inside is tagged with it, the innermost ``on`` first (``run_program``
        reads the tag). Review r-42d: the side was guessed from the traceback's innermost fuzzer frame, so a library
        bug that crashed inside the subject's forward (``models.py``) read as the oracle's error, a pass."""
        before, self.side = self.side, side
        try:
            yield
        except BaseException as error:
            if not hasattr(error, SIDE):
                setattr(error, SIDE, side)
            raise
        finally:
            self.side = before

    def _oracle(self, action: Any) -> Any:
        try:
            return action()
        except Exception as error:
            raise OracleFailed(f"{type(error).__name__}: {error}") from error

    # ------------------------------------------------------------------------------------- comparing
    def compare(self, where: str, align: bool = True) -> None:
        self.subject.sync_finished()
        ours = dict(self.subject.model.named_parameters())
        # every rank must hold the same parameters: on the oracle's side, or the program is one DDP cannot run; on
        # the subject's, or a sync went wrong
        theirs = dict(self.oracle.model.named_parameters())
        # the parameters themselves, bitwise (fp32 and bf16 are exact in fp64; ~2,000 elements a side): a sum let
        # two ranks' values that only sum alike (two elements swapped, an error and its opposite) through
        params = [p.detach() for p in [*ours.values(), *theirs.values()]]
        flat = torch.cat([p.double().reshape(-1) for p in params]).view(torch.int64)
        gathered = [torch.empty_like(flat) for _ in range(self.world_size)]
        dist.all_gather(gathered, flat)
        names = [*(f"subject {n}" for n in ours), *(f"oracle {n}" for n in theirs)]
        bounds = [0, *itertools.accumulate(p.numel() for p in params)]
        differ = [
            name
            for name, start, end in zip(names, bounds, bounds[1:])
            if any(not torch.equal(g[start:end], flat[start:end]) for g in gathered)
        ]
        if any(name.startswith("oracle") for name in differ):
            raise OracleFailed(f"{where}: the oracle's ranks disagree on {differ}")
        self.mismatches += [f"{where}: the ranks hold different values of {name}" for name in differ]
        # not aligned to a subject whose ranks disagree: the oracle's ranks would then disagree, and the program
        # read as the oracle's error, its mismatch dropped (a mutant whose sync skips an element: tests/fuzz/mutants)
        self.compare_local(where, align and not differ)

    @_comparing
    def compare_local(self, where: str, align: bool = True) -> None:
        """This rank's parameters against the oracle's (no collective); ``align``: the oracle takes the subject's.
        Exact programs bitwise; the others within the twin's measured noise (``noise.allowance``), never aligned (so
        a drift adds up). The ``twin`` pass keeps the oracle's values instead."""
        ours = dict(self.subject.model.named_parameters())
        steps = max(1, self.step_number - self.aligned_at)  # rounding differences add up over unaligned steps
        muon = self.oracle.muon_lrs()
        for name, want in self.oracle.model.named_parameters():
            got, key = ours[name].detach(), f"{where}|{name}"
            if self.recorder is not None:
                self.recorder.keep(key, want)
                continue
            if got.stride() != want.stride():
                self.mismatches.append(f"{where}: parameter {name} lost its layout {got.stride()} != {want.stride()}")
            if self.exact:
                if not same_bits(got, want.detach()):
                    off = float((got.float() - want.detach().float()).abs().max())
                    self.mismatches.append(f"{where}: parameter {name}: {off:.3g} off (exact program: bitwise)")
                continue
            twin = self.noise.get(key)
            if id(want) in muon:  # orthogonalized in bf16: in Frobenius norm (noise.excess_norm)
                far = self.noise.farthest(key, want)
                problem = noise.excess_norm(f"{where}: parameter {name}", got, want, twin, steps, far)
            else:
                masters = bool(self.program.options.get("master"))
                far = self.noise.farthest(key, want)
                allowed = noise.allowance(want, twin, steps, want.dtype, masters, far) + self.sign_slack.get(name, 0.0)
                problem = noise.excess(f"{where}: parameter {name}", got, want, allowed)
            if problem:
                self.mismatches.append(problem)
        if align and self.exact:  # (a no-op unless a mismatch was found: it is not carried on)
            self.aligned_at = self.step_number
            with torch.no_grad():
                for name, want in self.oracle.model.named_parameters():
                    want.copy_(ours[name])
            self.oracle.align_masters()

    @contextlib.contextmanager
    def oracle_stepping(self) -> Iterator[None]:
        """Around each step of the oracle. An element whose averaged gradient is within the twin's measured noise of
        zero has no sign the ranks' roundings agree on, and an adaptive optimizer turns either sign into a whole
        update (seed 300554: 3 ranks, AdamW after ``add_group``, one element two updates apart). From that step on
        the element may be off by ``SIGNLESS_UPDATES`` times the oracle's own update of it at each step; every other
        element keeps the twin's allowance. The twin pass records each step's gradients instead."""
        before = {name: p.detach().clone() for name, p in self.oracle.model.named_parameters()}
        with self.on("oracle"):
            yield
        self.oracle_steps += 1
        self._measure_signless(before)

    def _measure_signless(self, before: dict[str, Tensor]) -> None:
        for name, p in self.oracle.model.named_parameters():
            grad = p.grad
            if grad is None or grad.is_sparse or grad.shape != p.shape:
                continue
            key = f"grad|{self.oracle_steps}|{name}"
            if self.recorder is not None:
                self.recorder.keep(key, grad)
                continue
            update = (p.detach().float() - before[name].float()).abs()
            self._piece_rounding(name, p, before[name], update)
            twin = self.noise.get(key)  # the first sample: later ones would widen the signless elements
            if twin is None:
                continue
            signless = noise.signless(grad, twin) | self.signless.get(name, torch.zeros(p.shape, dtype=torch.bool))
            self.signless[name] = signless
            slack = noise.SIGNLESS_UPDATES * update * signless
            self.sign_slack[name] = self.sign_slack.get(name, torch.zeros_like(update)) + slack

    def _piece_rounding(self, name: str, p: Tensor, before: Tensor, update: Tensor) -> None:
        """A bf16 parameter without master weights that an even partition cuts: torch's CPU kernels step the scalar
        tail of a tensor to other bits than its vector body, so a piece's elements can round otherwise than the
        whole tensor's (the mixed-precision guide). Measured (16 x 16 cut 100 / 156, 50 draws): one bf16 ulp of the
        element (SGD, RMSprop with momentum), none for Adam without weight decay or AdamW; Adam's L2 decay, which
        moves a cancelling element by a whole update, is not drawn there (``program._piece_invariant``). So per
        step one ulp of the element and of its update more."""
        options = self.program.options
        if p.dtype != torch.bfloat16 or options.get("partition") != "even" or options.get("master"):
            return
        if not self._cut(name):  # owned whole by one rank: stepped as the oracle steps it, the same bits
            return
        ulps = torch.finfo(torch.bfloat16).eps * (before.float().abs() + update)
        self.sign_slack[name] = self.sign_slack.get(name, torch.zeros_like(update)) + ulps

    def _pieces(self, param: Tensor) -> list[tuple[int, int]]:
        """The twin's oracle parameter ``param``'s pieces ``(offset, length)`` as the subject steps them, where
        ``_piece_rounding`` applies (a bf16 parameter without master weights that the even partition cuts), else
        none: the twin then steps it in those pieces (``modes._in_pieces``), and measures what the pieces' rounding
        moves downstream, which the slack on the parameter itself does not."""
        options = self.program.options
        if param.dtype != torch.bfloat16 or options.get("partition") != "even" or options.get("master"):
            return []
        name = next((n for n, p in self.oracle.model.named_parameters() if p is param), None)
        mine = None if name is None else dict(self.subject.model.named_parameters()).get(name)
        fragments = None if mine is None else self.subject.zero.fragments_of(mine)
        if fragments is None or len(fragments) < 2:
            return []
        return [(fragment.offset, fragment.length) for fragment in fragments]

    def _cut(self, name: str) -> bool:
        """Whether the subject's partition cuts its parameter ``name`` into pieces of several ranks (or does not say:
        a parameter it does not hold, as after new storage, counts as cut)."""
        param = dict(self.subject.model.named_parameters()).get(name)
        fragments = None if param is None else self.subject.zero.fragments_of(param)
        return fragments is None or len(fragments) > 1

    def _loss_moved_by_parameters(self, ours: dict[str, Tensor], theirs: dict[str, Tensor]) -> float:
        """How far the subject's weights at most one bf16 ulp from the oracle's (``ours``, ``theirs``: as each forward
        read them) move this rank's loss: twice ``sum |d loss / d p| * |p_subject - p_oracle|`` over those elements
        (first order). A master on a rounding tie rounds either way, and such an element moves a loss (and the fp32
        weights after it) by more than the twin's ties elsewhere did (3 ranks, seed 300586: two elements of the
        bf16 head, the closure loss 2.9 times the twin's distance). Larger differences get no such slack."""
        if self.exact or self.recorder is not None:
            return 0.0
        model = self.oracle.model
        leaves = {name: p.requires_grad_(model.get_parameter(name).requires_grad) for name, p in theirs.items()}
        state = {**leaves, **{name: b.detach().clone() for name, b in model.named_buffers()}}
        trainable = [name for name, leaf in leaves.items() if leaf.requires_grad]
        inputs = (*batch(self.rank, self.step_number, 0), self.step_number, self.rank)
        with torch.enable_grad():
            loss = torch.func.functional_call(model, state, inputs).square().mean()
            grads = torch.autograd.grad(loss, [leaves[name] for name in trainable], allow_unused=True)
        total = 0.0
        for name, grad in zip(trainable, grads):
            if grad is not None:
                mine, want = ours[name].float(), leaves[name].detach().float()
                apart = (mine - want).abs()
                tie = apart <= torch.finfo(torch.bfloat16).eps * torch.maximum(mine.abs(), want.abs())  # one ulp
                total += float(grad.float().abs().mul(apart * tie).sum())
        return 2 * total

    @_comparing
    def compare_values(
        self, where: str, got: Any, want: Any, ulps_of: torch.dtype | None = None, moved: float = 0.0
    ) -> None:
        """A loss, a clip norm, an eval output: bitwise in exact programs, else within the twin's noise (fp32)."""
        if got is None and want is None:
            return
        if (got is None) != (want is None):
            if self.recorder is None:
                self.mismatches.append(f"{where}: {got!r} != {want!r}")
            return
        if self.recorder is not None:
            self.recorder.keep(where, want)
            return
        a, b = torch.as_tensor(got), torch.as_tensor(want)
        if self.exact:  # the same bits in, the same arithmetic: the same bits out
            if a.shape != b.shape or a.dtype != b.dtype or not same_bits(a, b):
                self.mismatches.append(f"{where}: {a.tolist()} != {b.tolist()} (exact program: bitwise)")
            return
        steps = max(1, self.step_number - self.aligned_at)  # computed from parameters unaligned for that many steps
        allowed = noise.allowance(b, self.noise.get(where), steps, farthest=self.noise.farthest(where, b)) + moved
        if ulps_of is not None:  # a value of inputs rounded to ``ulps_of``: one ulp of it more
            allowed = allowed + torch.finfo(ulps_of).eps * b.detach().float().abs()
        problem = noise.excess(where, a, b, allowed)
        if problem:
            self.mismatches.append(problem)

    def compare_end(self) -> None:
        """Parameters, buffers, the consolidated optimizer state and master weights."""
        self.compare("end", align=False)
        if refusals.sparse_at_even_step(self.program) and self._cut("sparse.weight"):
            self.mismatches.append("end: a step held the sparse embedding's gradient, cut by the partition, unrefused")
        want = self.oracle.optimizer.state_dict()
        masters = {key: self.oracle.masters.get(id(p)) for key, p in enumerate(self.oracle.params)}
        self.compare_buffers("end")
        if self.recorder is not None:
            for key, state in want["state"].items():
                for name, value in state.items():
                    self.recorder.keep(f"end|state|{key}|{name}", value)
            for key, master in masters.items():
                if master is not None:
                    self.recorder.keep(f"end|master|{key}", master)
            return
        self._compare_schedules()
        zero = self.subject.zero
        zero.consolidate_state_dict(0)
        if dist.get_rank(zero.process_group) != 0:  # each shard group's first rank (hybrid: two of them)
            return
        got = zero.state_dict()
        for index, (g, w) in enumerate(zip(got["param_groups"], want["param_groups"], strict=False)):
            for name, value in w.items():  # every hyperparameter torch's group holds, not only lr
                if name != "params" and not _same_setting(g.get(name, _ABSENT), value):
                    self.mismatches.append(f"end: param_groups[{index}][{name!r}] {g.get(name, _ABSENT)} != {value}")
        if len(got["param_groups"]) != len(want["param_groups"]):
            self.mismatches.append(f"end: {len(got['param_groups'])} param groups != {len(want['param_groups'])}")
        for key, state in want["state"].items():
            theirs_all = got["state"].get(key)
            if theirs_all is None:
                if any(_holds_something(v) for v in state.values()):  # not just torch's eager zeros
                    self.mismatches.append(f"end: optimizer state of parameter {key} missing")
                continue
            for name, value in state.items():
                theirs = theirs_all.get(name)
                if theirs is None:
                    self.mismatches.append(f"end: state[{key}][{name!r}] missing")
                    continue
                slack = self._signless_state(key, value)
                where = f"end: state[{key}][{name!r}]"
                self._compare_state(where, theirs, value, f"end|state|{key}|{name}", slack, nan_equal=True)
        for key, state in got["state"].items():
            if MASTER_KEY in state:
                if masters.get(key) is None:
                    self.mismatches.append(f"end: a master weight for parameter {key}, which has none")
                else:
                    # bits below the bf16 parameter's ulp: a write to the model (load, clamp) keeps or resets them
                    # depending on whether the old master still rounds to the parameter, a test of its last bits
                    # (seed 60294: one element 1.9e-6 apart after load_model, where the twin's equalled the oracle's)
                    below = torch.finfo(torch.bfloat16).eps * masters[key].detach().float().abs()
                    self._compare_state(
                        f"end: master weight {key}", state[MASTER_KEY], masters[key], f"end|master|{key}", below
                    )
            others = {k: v for k, v in state.items() if k != MASTER_KEY}
            if key not in want["state"] and any(_holds_something(v) for v in others.values()):
                self.mismatches.append(f"end: state of parameter {key} present, the plain optimizer has none")

    def _compare_schedules(self) -> None:
        """This rank's GradScaler (scale, growth tracker) and LR scheduler against the oracle's, exactly: a scale is
        a power of two, a tracker a count, and a scheduler's state is its own arithmetic on the same numbers."""
        pairs = [
            ("scaler", self.subject.scaler, self.oracle.scaler),
            ("scheduler", self.subject.scheduler, self.oracle.scheduler),
        ]
        for what, ours, theirs in pairs:
            if (ours is None) != (theirs is None):
                self.mismatches.append(f"end: {what}: {ours!r} != {theirs!r}")
            if ours is None or theirs is None:
                continue
            got, want = ours.state_dict(), theirs.state_dict()
            for name, value in want.items():
                if not _same_setting(got.get(name, _ABSENT), value):
                    self.mismatches.append(f"end: {what} {name!r}: {got.get(name, _ABSENT)} != {value}")

    def _signless_state(self, key: int, value: Any) -> Tensor | None:
        """A state element of a parameter element whose gradient had no sign (``oracle_stepping``) is itself a sum
        of roundings: it may be off by ``FACTOR`` times its own size (4 ranks, seed 401690: RMSprop's ``square_avg``
        of such an element twice its oracle's)."""
        names = {id(p): name for name, p in self.oracle.model.named_parameters()}
        name = names.get(id(self.oracle.params[key])) if key < len(self.oracle.params) else None
        signless = self.signless.get(name) if name is not None else None
        if signless is None or not isinstance(value, Tensor) or value.shape != signless.shape:
            return None
        return noise.FACTOR * value.detach().float().abs() * signless

    @_comparing
    def compare_tensor(self, where: str, got: Tensor, want: Tensor) -> None:
        """A tensor outside the model (the GAN's discriminator): recorded by the twin, else as ``_compare_state``."""
        if self.recorder is not None:
            self.recorder.keep(where, want)
        else:
            self._compare_state(where, got, want, where)

    @_comparing
    def compare_buffers(self, where: str) -> None:
        """Each buffer (statistics that carry the parameters' rounding) against the oracle's, as the state is. At a
        ``check`` too: a broadcast of rank 0's buffers that DDP skips shows only until a synced forward broadcasts."""
        ours = dict(self.subject.model.named_buffers())
        for name, buffer in self.oracle.model.named_buffers():
            key = f"{where}|buffer|{name}"
            if self.recorder is not None:
                self.recorder.keep(key, buffer)
            else:
                self._compare_state(f"{where}: buffer {name}", ours[name], buffer, key)

    @_comparing
    def _compare_state(
        self, where: str, got: Any, want: Any, key: str, slack: Tensor | None = None, nan_equal: bool = False
    ) -> None:
        """An end value the alignments never touch (state, masters, buffers): bitwise in exact programs, dtype too
        (``nan_equal``: the optimizer's state, a NaN on both sides equal), else within the twin's noise over all
        the program's steps (and ``slack``)."""
        a, b = torch.as_tensor(got), torch.as_tensor(want).detach()
        if self.exact:
            if a.shape != b.shape or a.dtype != b.dtype:
                self.mismatches.append(f"{where}: {a.dtype} {tuple(a.shape)} != {b.dtype} {tuple(b.shape)}")
            elif not same_bits(a, b, nan_equal):
                self.mismatches.append(f"{where} differs (exact program: bitwise)")
            return
        steps = max(1, self.step_number)
        dtype = b.dtype if b.is_floating_point() else torch.float32
        allowed = noise.allowance(b, self.noise.get(key), steps, dtype, farthest=self.noise.farthest(key, b))
        problem = noise.excess(where, a, b, allowed if slack is None else allowed + slack)
        if problem:
            self.mismatches.append(problem)

    # ------------------------------------------------------------------------------------- actions
    def forward_loss(self, wrapper: Any, micro: int = 0) -> Tensor:
        return wrapper(*batch(self.rank, self.step_number, micro), self.step_number, self.rank).square().mean()

    def zero_grad(self, via: str, set_to_none: bool) -> None:
        s = self.subject
        if via == "optimizer":
            s.zero.zero_grad(set_to_none)
        elif via == "wrapper":
            s.wrapper.zero_grad(set_to_none)
        elif via == "module":
            s.model.zero_grad(set_to_none)
        elif via == "bare":
            for child in s.model.children():
                child.zero_grad(set_to_none)
        else:
            for p in s.model.parameters():
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
        with self.on("oracle"):
            self.oracle.model.zero_grad(set_to_none)

    def backward(self, micro: int, no_sync: bool, grow: str | None = None, at: int = 0) -> None:
        """``micro`` backward passes, all but the last under ``no_sync()`` when asked. Under the overlap hooks the
        step runs inside each backward that reduces (the documented meaning), so the oracle steps after each, one
        micro-batch at a time on both sides; with a bf16 layer both are compared and aligned after each such step
        (the bf16 ulps a step leaves would otherwise move the next micro-batch's fp32 gradients: seed 1963).
        ``grow`` (``unfreeze``, ``add_group``): made after micro-batch ``at``, inside one ``no_sync()`` a wrapper."""
        if grow is not None:
            self._grown_backward(micro, no_sync, grow, at)
            return
        overlap = self.program.mode == "overlap_hook"
        bf16 = any(p.dtype == torch.bfloat16 for p in self.oracle.model.parameters())
        sides = (("subject", self.subject.wrapper), ("oracle", self.oracle.ddp))
        for m in range(micro):
            quiet = no_sync and m < micro - 1
            for side, wrapper in sides:
                with self.on(side), wrapper.no_sync() if quiet else contextlib.nullcontext():  # type: ignore[operator]
                    self.forward_loss(wrapper, m).backward()
                if side == "oracle" and overlap and not quiet:
                    with self.oracle_stepping():
                        self.oracle.step()
            if overlap and bf16 and not quiet and m < micro - 1:  # the last is compared after the action (do)
                self.compare(f"action {self.counter} micro-batch {m}")

    def _grown_backward(self, micro: int, no_sync: bool, grow: str, at: int) -> None:
        """The micro-batches, all but the last inside one ``no_sync()`` of each wrapper (entered once, held across
        the change: a wrapper built by the change enters its own), the model grown by ``grow`` after ``at``."""
        if self.program.mode == "overlap_hook":  # its oracle steps inside each reducing backward (``backward``)
            raise ValueError("backward(grow=...) is not drawn under overlap_hook, whose DDP cannot be built again")
        with contextlib.ExitStack() as quiet:
            entered: list[Any] = []
            for m in range(micro):
                if m == micro - 1:
                    quiet.close()  # the last micro-batch reduces everything accumulated, on both sides
                for side, wrapper in (("subject", self.subject.wrapper), ("oracle", self.oracle.ddp)):
                    with self.on(side):
                        if no_sync and m < micro - 1 and not any(wrapper is w for w in entered):
                            entered.append(wrapper)
                            quiet.enter_context(wrapper.no_sync())
                        self.forward_loss(wrapper, m).backward()
                if m == at:
                    getattr(self, grow)()

    def hand_grad(self) -> None:
        for side, model in (("subject", self.subject.model), ("oracle", self.oracle.model)):
            params = [p for p in model.parameters() if p.requires_grad]
            with self.on(side):
                loss = self.forward_loss(model)
                grads = torch.autograd.grad(loss, params, allow_unused=True)
            for p, g in zip(params, grads):  # a clone: autograd may give two leaves one tensor (``base + delta``),
                g = torch.zeros_like(p) if g is None else g.clone()  # reduced twice in place (seed 140: delta's 2x)
                dist.all_reduce(g)
                p.grad = (g / self.world_size).contiguous()  # row-major, as a gradient a program computes often is,
                # whatever its parameter's layout (autograd's follows a column-major weight's; clipping missed a copy)

    def clip(self, max_norm: float, norm_type: Any) -> None:
        norm_type = math.inf if norm_type == "inf" else float(norm_type)
        got = self.subject.zero.clip_grad_norm_(max_norm, norm_type)
        with self.on("oracle"):
            want = self.oracle.clip(max_norm, norm_type)
        self.compare_values(f"action {self.counter} clip norm", got, want, self._norm_inputs())

    def _norm_inputs(self) -> torch.dtype | None:
        """bf16 where a clip norm measures bf16 gradients: summed in another order by SDP, and the twin's one-ulp-up
        moves a norm's positive and negative elements in opposite directions, so it measures too little there
        (seed 60108: a norm 1.2e-3 off where the twin's distance allowed 4.3e-4)."""
        return torch.bfloat16 if any(p.dtype == torch.bfloat16 for p in self.oracle.model.parameters()) else None

    def step(self) -> None:
        self.subject.zero.step()
        if self.program.mode != "overlap_hook":  # there the oracle stepped in backward()
            with self.oracle_stepping():
                self.oracle.step()
        self.step_number += 1

    def closure_step(self) -> None:
        seen: list[dict[str, Tensor]] = []  # each side's parameters as its forward read them

        def closure(side: Any, optimizer: Any) -> Any:
            def run() -> Tensor:
                optimizer.zero_grad()
                side.model.zero_grad()
                loss = self.forward_loss(side.wrapper if side is self.subject else side.ddp)
                seen.append({name: p.detach().clone() for name, p in side.model.named_parameters()})
                loss.backward()
                return loss.detach()

            return run

        got = self.subject.zero.step(closure(self.subject, self.subject.zero))
        with self.oracle_stepping():
            want = self.oracle.step(closure(self.oracle, self.oracle.optimizer))
        moved = self._loss_moved_by_parameters(*seen) if len(seen) == 2 else 0.0
        self.compare_values(f"action {self.counter} closure loss", got, want, moved=moved)
        self.step_number += 1

    def scaler_step(self, clip: bool, overflow: str | None = None) -> None:
        s = self.subject
        poisoned = _overflowing(overflow, [s.model, self.oracle.model])
        s.scaler.scale(self.forward_loss(s.wrapper)).backward()
        got = None
        if clip:
            if self.program.mode == "sdp":  # unscale_ cannot run on SDP's owned gradient (the guide)
                got = s.zero.clip_grad_norm_(0.5, grad_scale=s.scaler.get_scale())
            else:
                s.scaler.unscale_(s.zero)
                got = s.zero.clip_grad_norm_(0.5)
        s.scaler.step(s.zero)
        s.scaler.update()
        with self.oracle_stepping():
            want = self.oracle.scaler_step(self.forward_loss(self.oracle.ddp), (0.5, 2.0) if clip else None)
        for handle in poisoned:
            handle.remove()
        self.compare_values(f"action {self.counter} scaled clip norm", got, want, self._norm_inputs())
        self.step_number += 1

    def sched_step(self) -> None:
        self.subject.scheduler.step()
        with self.on("oracle"):
            self.oracle.scheduler.step()

    def edit_lr(self, group: int, factor: float) -> None:
        for optimizer in (self.subject.zero, self.oracle.optimizer):
            optimizer.param_groups[group % len(optimizer.param_groups)]["lr"] *= factor

    def edit_hyper(self, group: int, factor: float) -> None:
        """Every hyperparameter but ``lr`` that ``program.edited_hyperparameters`` may change in the group, edited
        alike on both sides between steps (review r-42d: only ``lr`` was ever edited, so a library that pushed only
        ``lr`` into its local optimizer after construction passed)."""
        for optimizer in (self.subject.zero, self.oracle.optimizer):
            chosen = optimizer.param_groups[group % len(optimizer.param_groups)]
            chosen.update(edited_hyperparameters(chosen, factor))

    def eval(self, mode_switch: bool) -> None:
        outputs = []
        for side, wrapper in (("subject", self.subject.wrapper), ("oracle", self.oracle.ddp)):
            with self.on(side):
                if mode_switch:
                    wrapper.eval()
                with torch.no_grad():
                    outputs.append(wrapper(*batch(self.rank, EVAL_STEP, 0), self.step_number, self.rank))
                wrapper.train()
        self.compare_values(f"action {self.counter} eval output", outputs[0], outputs[1])

    def _layers(self, name: str) -> list[Any]:
        found = [layer(self.subject.model, name), layer(self.oracle.model, name)]
        return [] if None in found else found

    def retype(self, layer: str) -> None:
        for side, module in zip(("subject", "oracle"), self._layers(layer)):
            with self.on(side):
                dtype = next(module.parameters()).dtype
                module.to(torch.float64).to(dtype)
        self._rewrap()

    def data_clone(self, layer: str) -> None:
        for side, module in zip(("subject", "oracle"), self._layers(layer)):
            with self.on(side):
                for p in module.parameters():
                    p.data = p.data.clone()
        self._rewrap()

    def _rewrap(self) -> None:
        """DDP does not follow parameters given new storage (its ranks then disagree): wrap again, as a user must."""
        self.subject.rewrap_after_structure_change()
        with self.on("oracle"):
            self.oracle.rewrap(keep_buffers=self.program.mode == "sdp")

    def clamp(self, layer: str) -> None:
        """Each parameter of ``layer`` clamped to 0.9 of the oracle's largest magnitude in it: it always writes (a
        fixed bound below every weight wrote nothing, and a predicted refusal never came: seed 620246)."""
        found = self._layers(layer)  # (the subject's layer, the oracle's) or none
        bounds = [0.9 * float(p.detach().abs().max()) for p in found[1].parameters()] if found else []
        for side, module in zip(("subject", "oracle"), found):
            with self.on(side), torch.no_grad():
                for p, bound in zip(module.parameters(), bounds):
                    p.data.clamp_(-bound, bound)
        with self.on("oracle"):
            self.oracle.refresh_masters()

    def unfreeze(self) -> None:
        if self.subject.model.frozen is None:
            return
        self.structure.unfrozen = True
        self.subject.model.frozen.requires_grad_(True)
        self.subject.rewrap_after_structure_change()
        with self.on("oracle"):
            self.oracle.model.frozen.requires_grad_(True)  # type: ignore[union-attr]
            self.oracle.rewrap(keep_buffers=self.program.mode == "sdp")

    def add_group(self) -> None:
        if self.subject.model.extra is None or self.structure.added:
            return
        self.structure.added = True
        from tests.fuzz.modes import extra_group

        self.subject.model.extra.requires_grad_(True)
        group = extra_group(self.subject.model, self.program.kwargs["lr"])
        # resumed, both sides are built with other defaults than the program's (``resume``): the program's named
        settings = {k: v for k, v in self.program.kwargs.items() if k != "lr"} if self.structure.resumed else {}
        self.subject.zero.add_param_group({**settings, **group})
        with self.on("oracle"):
            self.oracle.model.extra.requires_grad_(True)  # type: ignore[union-attr]
            self.oracle.add_group(settings)
        self.subject.rewrap_after_structure_change()
        with self.on("oracle"):
            self.oracle.rewrap(keep_buffers=self.program.mode == "sdp")

    def load_model(self, via: str, scale: float) -> None:
        sides = (("subject", self.subject.model, self.subject.wrapper), ("oracle", self.oracle.model, self.oracle.ddp))
        for side, model, wrapper in sides:
            with self.on(side):
                target = wrapper if via == "wrapper" else model
                state = {k: v * scale if v.is_floating_point() else v for k, v in target.state_dict().items()}
                target.load_state_dict(state)
        with self.on("oracle"):
            self.oracle.refresh_masters()

    def load_optim(self) -> None:
        zero = self.subject.zero
        zero.consolidate_state_dict(0)
        box = [zero.state_dict() if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        zero.load_state_dict(box[0])
        with self.on("oracle"):
            self.oracle.reload_optimizer()

    def resume(self, kind: str) -> None:
        old = self.subject
        old.sync_finished()
        # the ranks' buffers differ until DDP's next forward broadcasts rank 0's; a checkpoint keeps one rank's copy
        # (DCP deduplicates replicated entries onto any rank): give every rank rank 0's on both sides first
        for model in (old.model, self.oracle.model):
            for buffer in model.buffers():
                dist.broadcast(buffer, src=0)
        if kind == "sharded":
            path = os.path.join(self.workdir, f"ckpt-{self.program.seed}-{self.counter}")
            distoptim.checkpoint.save({"model": old.model.state_dict(), "optim": old.zero.sharded_state_dict()}, path)
            new = build_subject(constructor_to_load(self.program, kind), self.structure, seed=1)
            state = {"model": new.model.state_dict(), "optim": new.zero.sharded_state_dict()}
            distoptim.checkpoint.load(state, path)
            new.model.load_state_dict(state["model"])
            new.zero.load_sharded_state_dict(state["optim"])
        else:
            old.zero.consolidate_state_dict(0)
            box = [old.zero.state_dict() if self.rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            model_state = {k: v.clone() for k, v in old.model.state_dict().items()}
            new = build_subject(
                constructor_to_load(self.program, kind), self.structure, seed=1, model_state=model_state
            )
            new.zero.load_state_dict(box[0])
            with self.on("oracle"):
                self.oracle.reload_optimizer()
        with self.on("oracle"):
            self.oracle.rebuilt_with(constructor_to_load(self.program, kind).kwargs)
        if old.scheduler is not None:
            new.scheduler.load_state_dict(old.scheduler.state_dict())
        if old.scaler is not None:
            new.scaler.load_state_dict(old.scaler.state_dict())
        self.subject = new
        self.structure.resumed = True
        with self.on("oracle"):
            self.oracle.rewrap()  # a resumed job wraps its model anew: its first forward broadcasts buffers, as SDP's
            self.oracle.model.zero_grad(set_to_none=True)  # a resumed job starts without gradients

    def failed_backward(self, layer: str, via: str, set_to_none: bool) -> None:
        """The subject's backward raises in ``layer``'s backward (the layers after it reduced, the others never
        reached), then the gradient is cleared through ``via``: the SDP guide's recovery, after which training goes
        on as DDP's without that batch. DDP has no such recovery (its reducer stays mid-iteration), so the oracle
        runs DDP's forward (buffers broadcast, BatchNorm's statistics updated alike) as one whose backward never
        reduces (under ``no_sync``, its next forward still broadcasting buffers, as after a forward that trained),
        and the same failing backward with fresh leaves for the parameters (out of DDP's sight: its hooks would
        count them as used), buffers kept: the parameters it reached get a ``.grad`` for the clear to zero or drop."""
        oracle = self.oracle.model
        with self.on("oracle"), self.oracle.ddp.no_sync():
            self.forward_loss(self.oracle.ddp)
        self.oracle.ddp.require_forward_param_sync = True
        leaves = {name: p.detach().requires_grad_(p.requires_grad) for name, p in oracle.named_parameters()}
        buffers = [b.detach().clone() for b in oracle.buffers()]
        twin = functools.partial(torch.func.functional_call, oracle, leaves)
        sides = (("subject", self.subject.model, self.subject.wrapper), ("oracle", oracle, lambda *a: twin(a)))
        for side, model, wrapper in sides:
            handle = getattr(model, layer).register_full_backward_pre_hook(_fail)
            try:
                with self.on(side), contextlib.suppress(_FailedBackward):
                    self.forward_loss(wrapper).backward()
            finally:
                handle.remove()
        with torch.no_grad():
            for kept, buffer in zip(buffers, oracle.buffers()):
                buffer.copy_(kept)
        for name, param in oracle.named_parameters():
            if leaves[name].grad is not None and param.grad is None:
                param.grad = torch.zeros_like(param)
        self.zero_grad(via, set_to_none)

    def gan(self, d_lr: float) -> None:
        episodes.gan(self, d_lr)

    def reshard(self, kind: str) -> None:
        episodes.reshard(self, kind)

    def check(self) -> None:
        if self.program.options.get("sabotage") == "momentum_late":  # a hyperparameter no later step reads
            for group in self.subject.zero.param_groups:
                group["momentum"] = 0.5
        if self.program.options.get("sabotage") == "swap_on_rank1" and self.rank == 1:  # sums alike, values not
            with torch.no_grad():
                flat = next(self.subject.model.parameters()).view(-1)
                flat[[0, -1]] = flat[[-1, 0]].clone()
        if self.program.options.get("sabotage") == "buffer_on_rank1" and self.rank == 1:  # the next forward's broadcast
            with torch.no_grad():  # puts rank 0's back on both sides
                next(b for b in self.subject.model.buffers() if b.is_floating_point()).add_(1.0)
        self.compare(f"check at action {self.counter}")
        self.compare_buffers(f"check at action {self.counter}")
        if self.program.options.get("sabotage") == "lr_then_oracle_fails":  # the fuzzer's own test
            raise OracleFailed("the oracle raised after a mismatch (on purpose)")

    def do(self, action: Action) -> None:
        getattr(self, action.name)(**action.args)
        self.counter += 1
        if action.name in STEPS and (
            self.clipped_adaptive or any(p.dtype == torch.bfloat16 for p in self.oracle.model.parameters())
        ):
            # with a bf16 layer every step is compared and aligned (``compare``), not only at ``check()``: the CPU's
            # bf16 kernels round a few ties differently on a fragment than on the whole tensor, and SDP accumulates a
            # bf16 gradient after its reduction where DDP does before; a bf16 ulp of a weight moves every fp32
            # gradient through it by 2^-8 relative, which an adaptive optimizer (Adagrad, Adam) turns into lr * 2^-8
            # on elements whose gradient is near zero, and unaligned over steps that compounds faster than the
            # steps-scaled tolerance (seed 78: 2e-4 after three steps, within the tolerance at each step)
            # (Likewise an adaptive optimizer's program that clips: the clipping norm summed in another order leaves
            # parameters an ulp apart, and a clipped step leaves a tiny second moment, over which the next unclipped
            # step moves the elements whose gradient is small (1e-3 of the largest) by ~5 lr: their rounding becomes
            # 8e-5, which the next backward spreads to every gradient, 2.2e-4 after five unaligned steps: seed 20680.)
            self.compare(f"after action {self.counter - 1}")


_ABSENT = "<absent>"


def _holds_something(value: Any) -> bool:
    """A state entry other than torch's eager zeros: a NaN is something (``abs().sum() > 0`` read it as nothing)."""
    tensor = torch.as_tensor(value)
    return bool((tensor != 0).any())  # NaN != 0


def _same_setting(got: Any, want: Any) -> bool:
    """A hyperparameter or a scaler's/scheduler's entry: numbers within 1e-12 relative, sequences elementwise,
    tensors (a GradScaler's scale) by value, anything else equal."""
    if isinstance(got, Tensor) or isinstance(want, Tensor):
        return _same_setting(torch.as_tensor(got).tolist(), torch.as_tensor(want).tolist())
    if isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(_same_setting(a, b) for a, b in zip(got, want))
    if isinstance(got, bool) or isinstance(want, bool) or not isinstance(want, (int, float)):
        return bool(got == want)
    return isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-12, abs_tol=0.0)


def _overflowing(name: str | None, models: list[Any]) -> list[Any]:
    """An injected overflow (``scaler_step(overflow=layer)``): the gradient of the layer's weight holds an inf in
    its first element on every rank, so under ShardedDataParallel only that element's owner finds it (under DDP every
    rank reads the averaged whole); the hooks' handles, to remove."""

    def poison(grad: Tensor) -> Tensor:
        grad = grad.clone()
        grad.view(-1)[0] = math.inf
        return grad

    return [] if name is None else [layer(model, name).weight.register_hook(poison) for model in models]


def _twin(program: Program, workdir: str, sample: int = 0) -> noise.Record:
    """The twin pass (noise.py): the oracle, its local gradients one ulp up, recorded at each comparison; where it
    raises (a refusal the real pass meets too), what it recorded until then. ``sample``: which draw of the bf16
    directions."""
    folder = os.path.join(workdir, f"twin{sample}")
    os.makedirs(folder, exist_ok=True)
    recorder = noise.Recorder()
    noise.draw(program.seed, sample)
    try:
        run = Run(program.replace(options={**program.options, "twin": True}), folder, record=True)
        recorder = run.recorder or recorder
        for action in program.actions:
            run.do(action)
        run.compare_end()
    except Exception:
        if os.environ.get("FUZZ_DEBUG"):
            traceback.print_exc()
    return recorder.values


def run_program(program: Program, workdir: str, samples: int = 1) -> dict[str, Any]:
    """This rank's outcome: ``{"status": "ok", "mismatches": [...]}`` or ``{"status": "raised", "side": ...}``.
    An inexact program is first run as its ``twin`` (``samples`` times) to measure its noise (noise.py)."""
    run: Run | None = None
    exact = is_exact(program, dist.get_world_size())
    # (a refusal may come after comparisons that count)
    twin = None if exact else noise.Twins([_twin(program, workdir, i) for i in range(samples)])
    try:
        run = Run(program, workdir, twin=twin)
        for action in program.actions:
            run.do(action)
        run.compare_end()
        if run.must_refuse:
            run.mismatches.append(f"{run.must_refuse}: not refused")
        return {"status": "ok", "mismatches": run.mismatches}
    except ComparisonFailed as error:
        return {
            "status": "raised",
            "side": "fuzzer",
            "type": "ComparisonFailed",
            "message": str(error)[:300],
            "at": _at(run),
            "traceback": traceback.format_exc()[-3000:],
            "mismatches": [] if run is None else run.mismatches,
        }
    except OracleFailed as error:
        return _oracle_failed(run, error)
    except Exception as error:
        if getattr(error, SIDE, None) == "oracle":  # raised while the interpreter ran the oracle (``Run.on``)
            return _oracle_failed(run, OracleFailed(f"{type(error).__name__}: {error}"))
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return {
            "status": "raised",
            "side": "subject",
            "type": type(error).__name__,
            "message": message[:300],
            "at": _at(run),
            "traceback": traceback.format_exc()[-3000:],
            "mismatches": [] if run is None else run.mismatches,
        }


def _oracle_failed(run: Run | None, error: OracleFailed) -> dict[str, Any]:
    seen = [] if run is None else run.mismatches  # a mismatch recorded before the oracle failed stands
    if run is not None and run.must_refuse:  # the subject ran what it should have refused
        return {"status": "ok", "mismatches": [*seen, f"{run.must_refuse}: not refused (the oracle then: {error})"]}
    return {
        "status": "raised",
        "side": "oracle",
        "type": "OracleFailed",
        "message": str(error),
        "at": _at(run),
        "traceback": traceback.format_exc()[-3000:],
        "mismatches": seen,
    }


def _at(run: Run | None) -> str:
    return "construction" if run is None else f"action {run.counter}"
