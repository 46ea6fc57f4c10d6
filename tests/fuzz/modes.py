"""Setting up both sides of a fuzz program: the subject (distoptim in the program's mode) and the oracle (DDP with
``find_unused_parameters`` + the plain ``torch.optim`` optimizer, over fp32 copies of bf16 parameters when the
mode keeps master weights), each on its own copy of the model built from the same seed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer
from distoptim.hooks import reduce_to_owners_hook
from tests.fuzz.matrices import MUON, PlainPerGroup, constructor_class, muon_step_size, with_muon_groups
from tests.fuzz.models import FuzzModel, param_groups
from tests.fuzz.program import Program
from tests.zero._hooks import register

MODEL_SEED = 0
BUCKET_CAP_MB = 0.002  # several buckets per dtype, on both sides
NOISE = 1e-3  # an averaged gradient element this far below its tensor's largest is rounding-sized (note_noise)
# a gradient element's rounding difference relative to its tensor's largest element: twice the largest measured
# (5.7e-7, seed 20110: sdp, parameters an ulp apart after a clipped step; 2.3e-7 in seed 20680's zero1)
GRAD_ROUNDING = 1e-6
# the same for a bf16 gradient that one side sums in bf16 (DDP: each micro-batch's all-reduce and its accumulation
# into .grad round to bf16) and the other in fp32 (ShardedDataParallel's reduce_dtype with master weights): one bf16
# ulp of the summands, which are about the tensor's largest (seed 34222: RMSprop's second step divided a head element
# accumulated over 3 micro-batches by its first's, 0.00195 off where fp32's rounding allowed 0.00135)
BF16_GRAD_ROUNDING = 2**-8
# a clip's coefficient when bf16 gradients set the norm: DDP averages them in bf16, ShardedDataParallel with master
# weights in fp32 (reduce_dtype), a relative 2^-8 apart; every clipped gradient carries it, and an adaptive update
# (RMSprop's first steps: lr * g / sqrt(0.01 g^2), ten times lr) moves by up to ten times lr times that (seed 39086),
# an SGD update with momentum 0.9 by up to ten times lr * |g| times that (seed 38762); bf16 gradients summed in bf16
# in another order than DDP's (ShardedDataParallel without masters, the hooks) likewise (50506: passes without the clip)
CLIP_ROUNDING = 10 * 2**-8
_GROUPS: dict[tuple[int, ...], Any] = {}


def group_of(ranks: list[int]) -> Any:
    """The gloo group of ``ranks``, made once per session: every rank asks for the same groups in the same order
    (each runs the same programs), as ``dist.new_group`` needs."""
    key = tuple(ranks)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(ranks))
    return _GROUPS[key]


def hybrid_groups() -> tuple[Any, Any]:
    """This rank's shard group and replicate group at 4 ranks: shards {0, 1} and {2, 3}, replicas {0, 2}, {1, 3}."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size != 4:
        raise ValueError(f"fuzz: hybrid programs run at 4 ranks, not {world_size} (--world-size 4)")
    shards = [group_of([start, start + 1]) for start in (0, 2)]
    replicas = [group_of([offset, offset + 2]) for offset in (0, 1)]
    return shards[rank // 2], replicas[rank % 2]


@dataclass
class Structure:
    """What the program changed in the model's structure so far (a resume rebuilds it)."""

    unfrozen: bool = False
    added: bool = False


def on_grid(program: Program) -> bool:
    """Whether both sides round each rank's local gradient to ``models.GRID`` (exact programs)."""
    return bool(program.options.get("exact"))


def program_groups(program: Program, model: FuzzModel, lr: float) -> list[dict[str, Any]]:
    """The program's param groups: the model zoo's, each split into Muon's matrices and the rest for Muon."""
    groups = param_groups(model, lr)
    return with_muon_groups(groups, model, lr) if program.optimizer == MUON else groups


def _scheduler(optimizer: Any, program: Program) -> Any:
    if any(a.name == "sched_step" for a in program.actions):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
    return None


def _scaler(program: Program) -> Any:
    if any(a.name == "scaler_step" for a in program.actions):
        return torch.amp.GradScaler("cpu", init_scale=2.0**10)
    return None


def extra_group(model: FuzzModel, lr: float) -> dict[str, Any]:
    assert model.extra is not None
    return {"params": list(model.extra.parameters()), "lr": lr * 3}


def _ddp(model: nn.Module, group: Any = None) -> DDP:
    group_kwargs = {} if group is None else {"process_group": group}
    return DDP(model, find_unused_parameters=True, bucket_cap_mb=BUCKET_CAP_MB, **group_kwargs)


def _thaw(model: FuzzModel, structure: Structure) -> None:
    if structure.unfrozen and model.frozen is not None:
        model.frozen.requires_grad_(True)
    if structure.added and model.extra is not None:
        model.extra.requires_grad_(True)


@dataclass
class Subject:
    program: Program
    model: FuzzModel
    zero: ZeroRedundancyOptimizer
    wrapper: nn.Module = field(init=False)
    scheduler: Any = None
    scaler: Any = None
    group: Any = None  # the data-parallel group (None: the world); a resume at another world size makes its own

    def wrap(self) -> None:
        """(Re)wrap the model as the mode says; DDP modes wrap again after a structure change, as a user must."""
        mode, options = self.program.mode, self.program.options
        if mode == "sdp":
            master = options["master"]
            self.wrapper = ShardedDataParallel(
                self.model,
                self.zero,
                bucket_cap_mb=BUCKET_CAP_MB,
                reduce_dtype=torch.float32 if master else None,
                overlap_param_sync=options["overlap"],
            )
            return
        self.wrapper = ddp = _ddp(self.model, self.group)
        if mode == "zero2_hook":
            ddp.register_comm_hook(self.zero, reduce_to_owners_hook)
        elif mode == "overlap_hook":
            register(ddp, self.zero, options.get("reduction", "all_reduce"), options["stepping"])

    def rewrap_after_structure_change(self) -> None:
        if self.program.mode != "sdp":
            self.wrap()

    def sync_finished(self) -> None:
        """Land the parameter sync before the fuzzer reads parameters. A write the sync saw in flight raises in
        ``sync_finished`` on the ranks that own the written piece only (the others cannot see it); the user's next
        step or checkpoint raises it on every rank. The fuzzer's reads are not the user's: they raise it on every
        rank too, with the owner's message, instead of leaving the others in the comparison's collective."""
        error, own = "", None
        try:
            self.zero.sync_finished()
        except RuntimeError as raised:
            error, own = str(raised), raised
        errors: list[str] = [""] * dist.get_world_size(self.group)
        dist.all_gather_object(errors, error, group=self.group)
        first = next((e for e in errors if e), "")
        if own is not None:
            raise own  # distoptim's own, with its traceback
        if first:
            raise RuntimeError(first)


def build_subject(
    program: Program,
    structure: Structure,
    seed: int = MODEL_SEED,
    model_state: dict[str, Tensor] | None = None,
    group: Any = None,
) -> Subject:
    model = FuzzModel(program.features, seed, grid=on_grid(program))
    _thaw(model, structure)
    if model_state is not None:
        model.load_state_dict(model_state)
    options, lr = program.options, program.kwargs["lr"]
    groups: dict[str, Any] = {"process_group": group}
    if options.get("hybrid"):
        groups["process_group"], groups["replicate_group"] = hybrid_groups()
    zero = ZeroRedundancyOptimizer(
        program_groups(program, model, lr),
        constructor_class(program.optimizer),
        parameters_as_bucket_view=options["bucket_view"],
        overlap_with_ddp=program.mode == "overlap_hook",
        partition=options["partition"],
        master_dtype=torch.float32 if options["master"] else None,
        **groups,
        **program.kwargs,
    )
    if structure.added:
        zero.add_param_group(extra_group(model, lr))
    subject = Subject(program, model, zero, scheduler=_scheduler(zero, program), scaler=_scaler(program), group=group)
    subject.wrap()
    return subject


class Oracle:
    """DDP + the plain optimizer; with master weights the optimizer steps fp32 copies of the bf16 parameters, which
    follow the model whenever the program writes to it (a load, a clamp): the model is what the user sees."""

    def __init__(self, program: Program, structure: Structure | None = None, group: Any = None) -> None:
        self.program = program
        self.model = FuzzModel(program.features, MODEL_SEED, grid=on_grid(program))
        structure = structure or Structure()
        _thaw(self.model, structure)
        self.lr = program.kwargs["lr"]
        self.masters: dict[int, Tensor] = {}
        self.noisy: dict[int, Tensor] = {}  # per parameter, the elements note_noise marked since the last alignment
        self.relative_noise: dict[int, Tensor] = {}  # per parameter and element, its gradient's relative rounding
        self.state_noise: dict[int, float] = {}  # per parameter, a relative rounding its optimizer state carries
        groups = program_groups(program, self.model, self.lr)
        if program.options["master"]:
            for entry in groups:
                for p in entry["params"]:
                    if p.dtype != torch.float32:
                        self.masters[id(p)] = p.detach().float().requires_grad_()
        self.params = [p for g in groups for p in g["params"]]
        stepped = [{**g, "params": [self._stepped(p) for p in g["params"]]} for g in groups]
        if program.optimizer == MUON:  # one plain optimizer per group, as plain torch users write it
            self.optimizer: Any = PlainPerGroup(stepped, torch.optim.AdamW, program.kwargs)
        else:
            self.optimizer = getattr(torch.optim, program.optimizer)(stepped, **program.kwargs)
        if structure.added:
            self.add_group()
        self.scheduler = _scheduler(self.optimizer, program)
        self.scaler = _scaler(program)
        self.group = group
        self.ddp = _ddp(self.model, group)

    def muon_lrs(self) -> dict[int, float]:
        """For each model parameter Muon steps (Muon programs), its step size now (``matrices.muon_step_size``)."""
        if not isinstance(self.optimizer, PlainPerGroup):
            return {}
        model_of = {id(self._stepped(p)): p for p in self.params}
        return {
            id(model_of[id(q)]): muon_step_size(part.param_groups[0]["lr"], tuple(q.shape))
            for part in self.optimizer.parts
            if isinstance(part, torch.optim.Muon)
            for q in part.param_groups[0]["params"]
            if id(q) in model_of
        }

    def _stepped(self, p: Tensor) -> Tensor:
        return self.masters.get(id(p), p)

    def rewrap(self, keep_buffers: bool = False) -> None:
        """DDP again after parameters got new storage (DDP does not follow them). Its construction broadcasts rank
        0's buffers; ``keep_buffers``: each rank keeps its own, as a DDP that followed the storage would (where the
        subject is not rewrapped: ShardedDataParallel follows the storage itself)."""
        buffers = [b.detach().clone() for b in self.model.buffers()] if keep_buffers else []
        syncs_next = self.ddp.require_forward_param_sync  # a DDP that followed: broadcasts where it would have
        self.ddp = _ddp(self.model, self.group)
        if keep_buffers:
            self.ddp.require_forward_param_sync = syncs_next
        with torch.no_grad():
            for buffer, saved in zip(self.model.buffers(), buffers):
                buffer.copy_(saved)

    def add_group(self) -> None:
        group = extra_group(self.model, self.lr)
        self.params += group["params"]
        self.optimizer.add_param_group(group)

    def to_masters(self) -> None:
        for p in self.params:
            if id(p) in self.masters:
                self.masters[id(p)].grad = None if p.grad is None else p.grad.float()

    def from_masters(self) -> None:
        with torch.no_grad():
            for p in self.params:
                if id(p) in self.masters:
                    p.copy_(self.masters[id(p)])

    def refresh_masters(self) -> None:
        """Masters take the values of parameters the program wrote (a load, a clamp): those that no longer equal
        their master rounded to their dtype. An unwritten one keeps its fp32 master, as distoptim's does (re-seeding
        it anyway drops the bits below a bf16 ulp, and the next steps round to another bf16 value now and then)."""
        with torch.no_grad():
            for p in self.params:
                master = self.masters.get(id(p))
                if master is not None and not torch.equal(p, master.to(p.dtype)):
                    master.copy_(p.float())

    def align_masters(self) -> None:
        """After an alignment (the model took the subject's values): each element whose master no longer rounds to
        its parameter takes the parameter's value; the others keep their fp32 bits. Without it the master of an
        element the alignment moved (a noisy element Adam's first step moved by lr on one side only) stepped on
        from the old value: seed 20046, a bf16 head element ``lr`` off after the next step though aligned before."""
        with torch.no_grad():
            for p in self.params:
                master = self.masters.get(id(p))
                if master is not None:
                    torch.where(master.to(p.dtype) == p, master, p.float(), out=master)

    def note_noise(self, scale: float = 1.0) -> None:
        """Mark the elements whose averaged gradient is near zero (below ``NOISE`` of the tensor's largest): a
        gradient summed in another order (reduced to owners, in fp32, over micro-batches) differs there by a few
        ulps of the summands, as large as the element itself. SGD moves such an element by lr * (that ulp); an
        adaptive optimizer divides it by its own running magnitude (Adam's first step is lr * sign(g)), so a
        rounding difference becomes up to lr per step. ``Run.compare_local`` bounds those elements by the learning
        rate instead of the rounding tolerance, until the next alignment.

        Above that threshold an element's rounding is ``GRAD_ROUNDING`` of the largest (``BF16_GRAD_ROUNDING`` for a
        bf16 gradient summed otherwise than DDP sums it), relative to itself (summed over the steps since the
        alignment, ``relative_noise``): an adaptive update moves by that fraction of itself (RMSprop's
        ``lr * g / sqrt(v)``, its ``v`` tiny after a clipped step, moved 1.7e-5 at 1.05e-3 of the largest: seed
        20680), which ``Run.compare_local`` allows on top of the tolerance."""
        if self.program.optimizer == "SGD":
            return
        # L2 weight decay (Adam's, not AdamW's) adds weight_decay * p to the gradient inside the step: where that
        # cancels the gradient, the sum is rounding-sized too (seed 31874: a bf16 element of a fragment, lr off)
        decoupled = self.program.optimizer in ("AdamW", MUON)  # Muon programs: AdamW on what the decay reaches
        coupled = self.program.kwargs.get("weight_decay", 0.0) if not decoupled else 0.0
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None and p.grad.numel():
                    grad = p.grad.detach()
                    grad = (grad.to_dense() if grad.is_sparse else grad).float().abs()
                    noisy = grad <= NOISE * grad.amax()
                    if coupled and not p.grad.is_sparse:  # (a GradScaler's gradient still carries its ``scale``)
                        decay = coupled * p.detach().float()
                        summed = (p.grad.detach().float() / scale + decay).abs()
                        noisy |= summed <= NOISE * torch.maximum(grad.amax() / scale, decay.abs().amax())
                    self.noisy[id(p)] = noisy | self.noisy[id(p)] if id(p) in self.noisy else noisy
                    summed_apart = p.grad.dtype == torch.bfloat16 and self.program.mode != "zero1"  # not DDP's bits
                    rounding = BF16_GRAD_ROUNDING if summed_apart else GRAD_ROUNDING
                    relative = rounding * grad.amax() / grad.clamp_min(NOISE * grad.amax()).clamp_min(1e-30)
                    if id(p) in self.relative_noise:
                        relative += self.relative_noise[id(p)]
                    self.relative_noise[id(p)] = relative

    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.note_noise()
        self.to_masters()
        self.optimizer.step()
        self.from_masters()
        return loss

    def clip(self, max_norm: float, norm_type: float, grads: list[Tensor] | None = None) -> Tensor:
        """``torch.nn.utils.clip_grad_norm_``'s arithmetic with the norm accumulated in fp32 (as ZeRO's)."""
        if grads is None:
            grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:  # torch's clip_grad_norm_ of no gradients
            return torch.tensor(0.0)
        norms = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads])
        total = norms.amax() if math.isinf(norm_type) else torch.linalg.vector_norm(norms, norm_type)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coefficient)
        rounded_in_bf16 = any(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in self.params)
        summed_apart = self.program.options.get("master") or self.program.mode != "zero1"  # not DDP's own bf16 sums
        if summed_apart and rounded_in_bf16 and float(coefficient) < 1.0:
            for p in self.params:  # kept in the optimizer's state (RMSprop's v, SGD's momentum): outlives alignments
                if p.grad is not None:  # SGD moves by lr * g: the rounding of g is what it carries (seed 38762)
                    gain = float(p.grad.detach().float().abs().amax()) if self.program.optimizer == "SGD" else 1.0
                    self.state_noise[id(p)] = self.state_noise.get(id(p), 0.0) + CLIP_ROUNDING * gain
        return total

    def scaler_step(self, loss: Tensor, clip: tuple[float, float] | None) -> Tensor | None:
        self.scaler.scale(loss).backward()
        self.note_noise(self.scaler.get_scale())
        self.to_masters()
        total = None
        if clip is not None:
            self.scaler.unscale_(self.optimizer)
            grads = [q.grad for g in self.optimizer.param_groups for q in g["params"] if q.grad is not None]
            total = self.clip(*clip, grads=grads)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.from_masters()
        for p in self.params:  # the scaler unscaled the masters' gradients in place: as it would the model's
            if id(p) in self.masters and p.grad is not None:
                p.grad.copy_(self.masters[id(p)].grad)
        return total


def world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()
