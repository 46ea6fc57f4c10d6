"""Setting up both sides of a fuzz program: the subject (distoptim in the program's mode) and the oracle (DDP with
``find_unused_parameters`` + the plain ``torch.optim`` optimizer, over fp32 copies of bf16 parameters when the
mode keeps master weights), each on its own copy of the model built from the same seed."""

from __future__ import annotations

import copy
import math
import types
from collections.abc import Callable
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
from tests.zero._codec import eligible, round_trip
from tests.zero._hooks import register

MODEL_SEED = 0
BUCKET_CAP_MB = 0.002  # several buckets per dtype, on both sides
_GROUPS: dict[tuple[int, ...], Any] = {}


def group_of(ranks: list[int]) -> Any:
    """The gloo group of ``ranks``, made once per session: every rank asks for the same groups in the same order
    (each runs the same programs), as ``dist.new_group`` needs."""
    key = tuple(ranks)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(ranks))
    return _GROUPS[key]


def forget_groups() -> None:
    """After ``dist.destroy_process_group()``: the next ``group_of`` makes its group anew."""
    _GROUPS.clear()


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
    # the subject was rebuilt with other settings than the program's (``program.constructor_to_load``) and loaded:
    # a group added later takes the new constructor's defaults, as torch's would, so it names the program's
    resumed: bool = False


def on_grid(program: Program) -> bool:
    """Whether both sides round each rank's local gradient to ``models.GRID``: exact programs at 2 or 4 ranks (at 3
    the division by the world size rounds anyway, and a coarse gradient only makes more near-ties)."""
    return bool(program.options.get("exact")) and dist.get_world_size() in (2, 4)


def program_groups(program: Program, model: FuzzModel, lr: float) -> list[dict[str, Any]]:
    """The program's param groups: the model zoo's, each split into Muon's matrices and the rest for Muon; with
    ``format_on="last"`` the last one names the program's state format."""
    groups = param_groups(model, lr)
    groups = with_muon_groups(groups, model, lr) if program.optimizer == MUON else groups
    if state_format(program) != "fp32" and program.options.get("format_on") == "last":
        groups[-1] = {**groups[-1], "state_format": state_format(program)}
    return groups


def state_format(program: Program) -> str:
    """The program's ZeRO state format where it is compared (on the grid, bitwise); elsewhere (3 ranks) fp32 on
    both sides: a format's rounding turns a reduction-order ulp into a whole quantization step."""
    return str(program.options.get("state_format", "fp32")) if on_grid(program) else "fp32"


def constructor_format(program: Program) -> dict[str, str]:
    """The ``state_format`` ZeroRedundancyOptimizer is built with (``format_on="all"``), as keyword arguments."""
    fmt = state_format(program)
    return {"state_format": fmt} if fmt != "fp32" and program.options.get("format_on") != "last" else {}


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


def _ddp(model: nn.Module, group: Any = None, two_stage: bool = False, static_graph: bool = False) -> DDP:
    group_kwargs = {} if group is None else {"process_group": group}
    ddp = DDP(
        model, find_unused_parameters=True, bucket_cap_mb=BUCKET_CAP_MB, static_graph=static_graph, **group_kwargs
    )
    if two_stage:
        # a lambda: DDP checks a hook's annotations against the classes, and this module's are strings
        ddp.register_comm_hook(hybrid_groups(), lambda groups, bucket: _two_stage_mean(groups, bucket))
    return ddp


def static_graph(program: Program) -> bool:
    """Whether both sides promise a static graph (``program._static_graph``): ShardedDataParallel agrees on the used
    parameters at the first backward only, and the oracle's DDP is built with ``static_graph=True`` as well."""
    return bool(program.options.get("static_graph"))


def sums_in_two_stages(program: Program, group: Any = None) -> bool:
    """Whether the subject sums each gradient within its shard pair, then across the pairs (hybrid ``sdp`` and
    ``zero2_hook`` over the world), where DDP's own all-reduce adds the four ranks in its ring's order. The oracle's
    DDP then sums in the subject's two stages (seed 43031): both orders are DDP's arithmetic, but a bf16 sum rounded
    otherwise flips a bf16 step's tie, which everything after it carries, and the twin measures no such flip."""
    return bool(program.options.get("hybrid")) and program.mode in ("sdp", "zero2_hook") and group is None


def _two_stage_mean(groups: tuple[Any, Any], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's average as two all-reduces, over the shard pair then the replicate pair (the subject's order)."""
    buffer = bucket.buffer().mul_(1.0 / dist.get_world_size())  # DDP's reducer: times 1/N, then summed
    for group in groups:
        dist.all_reduce(buffer, group=group)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


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
            # gradients reduced in their own dtype, as DDP's: ``reduce_dtype=torch.float32`` sums a bf16 gradient in
            # fp32, arithmetic DDP has no way to do (seed 102534: a master a bf16 ulp of its gradient apart after one
            # step, outside the twin's measure); its parity test: tests/sharded_data_parallel/test_parity.py
            self.wrapper = ShardedDataParallel(
                self.model,
                self.zero,
                bucket_cap_mb=BUCKET_CAP_MB,
                overlap_param_sync=options["overlap"],
                static_graph=static_graph(self.program),
            )
            return
        self.wrapper = ddp = _ddp(self.model, self.group, static_graph=static_graph(self.program))
        if mode == "zero2_hook":  # the deprecated hook (its FutureWarning: session.py ignores warnings) averages
            # over the optimizer's ranks, which are DDP's (reshard's one-rank group too)
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
        **constructor_format(program),
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
        # the twin (noise.py): the same oracle with its local gradients one ulp up
        twin = ("muon" if program.optimizer == MUON else "fp") if program.options.get("twin") else ""
        self.model = FuzzModel(program.features, MODEL_SEED, grid=on_grid(program), twin=twin)
        structure = structure or Structure()
        _thaw(self.model, structure)
        self.lr = program.kwargs["lr"]
        self.masters: dict[int, Tensor] = {}
        groups = program_groups(program, self.model, self.lr)
        if program.options["master"]:
            for entry in groups:
                for p in entry["params"]:
                    if p.dtype != torch.float32:
                        self.masters[id(p)] = p.detach().float().requires_grad_()
        self.params = [p for g in groups for p in g["params"]]
        stepped = [{**g, "params": [self._stepped(p) for p in g["params"]]} for g in groups]
        default_format = constructor_format(program).get("state_format", "fp32")
        self.formats = {  # the stepped tensors whose state the subject keeps in a format (``_codec``)
            p: g.get("state_format", default_format)
            for g in stepped
            for p in g["params"]
            if eligible(p, g.get("state_format", default_format))
        }
        stepped = [{k: v for k, v in g.items() if k != "state_format"} for g in stepped]
        if program.optimizer == MUON:  # one plain optimizer per group, as plain torch users write it
            self.optimizer: Any = PlainPerGroup(stepped, torch.optim.AdamW, program.kwargs)
        else:
            self.optimizer = getattr(torch.optim, program.optimizer)(stepped, **program.kwargs)
        # the twin's step (noise.py) takes the subject's pieces of a cut bf16 parameter from ``Run`` (``_in_pieces``)
        self.pieces: Callable[[Tensor], list[tuple[int, int]]] | None = None
        step = _in_pieces(type(self.optimizer).step, self) if twin else type(self.optimizer).step
        if self.formats:
            step = _coded_step(step, self.formats)
        if step is not type(self.optimizer).step:
            self.optimizer.step = types.MethodType(step, self.optimizer)
        if structure.added:
            self.add_group()
        self.scheduler = _scheduler(self.optimizer, program)
        self.scaler = _scaler(program)
        self.group = group
        self.ddp = _ddp(self.model, group, sums_in_two_stages(program, group), static_graph(program))

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
        self.ddp = _ddp(
            self.model, self.group, sums_in_two_stages(self.program, self.group), static_graph(self.program)
        )
        if keep_buffers:
            self.ddp.require_forward_param_sync = syncs_next
        with torch.no_grad():
            for buffer, saved in zip(self.model.buffers(), buffers):
                buffer.copy_(saved)

    def reload_optimizer(self) -> None:
        """The consolidated round trip the subject makes (``load_optim``, ``resume``): torch's ``load_state_dict``
        casts each floating state to its parameter's dtype (NAdam's ``mu_product`` to bf16, seed 104686)."""
        self.optimizer.load_state_dict(copy.deepcopy(self.optimizer.state_dict()))  # PlainPerGroup: into each part

    def rebuilt_with(self, kwargs: dict[str, Any]) -> None:
        """The resumed job's optimizer is built with ``kwargs`` (``constructor_to_load``), then loads: a load keeps the
        constructor's ``defaults``, which ``add_param_group`` fills in and Adagrad's lazy ``sum`` of an added
        parameter starts from (torch reads ``self.defaults["initial_accumulator_value"]``, never the group's own).
        ``PlainPerGroup`` (Muon) builds a part per added group from the group's settings and keeps its own."""
        if not isinstance(self.optimizer, PlainPerGroup):
            self.optimizer.defaults = type(self.optimizer)([torch.zeros(1, requires_grad=True)], **kwargs).defaults

    def add_group(self, settings: dict[str, Any] | None = None) -> None:
        group = {**(settings or {}), **extra_group(self.model, self.lr)}
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

    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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
        return total

    def scaler_step(self, loss: Tensor, clip: tuple[float, float] | None) -> Tensor | None:
        self.scaler.scale(loss).backward()
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


def _in_pieces(step: Any, oracle: Oracle) -> Any:
    """The twin's ``step`` (noise.py), then each parameter ``oracle.pieces`` names stepped again from its values and
    state before, piece by piece, each piece a tensor of its own: as the subject's even partition steps a bf16
    parameter without master weights that it cuts (``LocalTensor``). torch's CPU kernels step a tensor's scalar tail
    to other bits than its vector body, so a piece's element can round to the other bf16 neighbour of a near tie
    than the whole tensor's (seed 941301: head.weight[251] and [252], SGD, pieces 136 / 120 of 256). The real
    oracle steps whole tensors, as plain torch does; its twin, stepping as the subject does, measures what that
    flip moves downstream: the next forward reads the flipped weight, and every fp32 gradient through it moves by
    ~2^-8 relative (``inp``, ``body``, ``out``: 6x to 18x the twin's distance where it stepped whole tensors).
    Only ``pieces``, the subject's fragments, comes from the subject; never its values. A bound method
    (``types.MethodType``), as ``_coded_step``; a step the GradScaler skips never reaches it."""

    def stepped(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        pieces = oracle.pieces
        cut = {}
        if pieces is not None:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    spans = pieces(p) if p.grad is not None and p.is_contiguous() else []
                    if spans:
                        held = optimizer.state.get(p, {})
                        state = {k: v.clone() if isinstance(v, Tensor) else v for k, v in held.items()}
                        cut[p] = (group, spans, p.detach().clone(), state)
        loss = step(optimizer, *args, **kwargs)
        for p, (group, spans, before, state) in cut.items():
            for offset, length in spans:
                _step_piece(optimizer, p, group, before, state, offset, length)
        return loss

    return stepped


def _step_piece(
    optimizer: torch.optim.Optimizer,
    p: Tensor,
    group: dict[str, Any],
    before: Tensor,
    state: dict[str, Any],
    offset: int,
    length: int,
) -> None:
    """``p``'s elements ``[offset, offset + length)`` (memory order; ``p`` contiguous) stepped from ``before`` and
    ``state`` by a plain optimizer of ``p``'s class and ``group``'s settings over that piece alone, written back into
    ``p`` and into the state the whole step left (a state tensor of ``p``'s shape; a scalar one, as Adam's ``step``,
    is the same for every piece)."""
    span = slice(offset, offset + length)
    piece = nn.Parameter(before.reshape(-1)[span].clone())
    assert p.grad is not None
    piece.grad = p.grad.detach().reshape(-1)[span].clone()
    parts = getattr(optimizer, "parts", [optimizer])  # ``PlainPerGroup``: the part that steps ``p``
    cls = next(type(part) for part in parts if any(q is p for g in part.param_groups for q in g["params"]))
    plain = cls([piece])
    plain.param_groups[0].update((k, v) for k, v in group.items() if k != "params")
    plain.state[piece] = {
        k: v.reshape(-1)[span].clone() if isinstance(v, Tensor) and v.shape == p.shape else copy.deepcopy(v)
        for k, v in state.items()
    }
    plain.step()
    with torch.no_grad():
        p.reshape(-1)[span].copy_(piece)
        for k, v in plain.state[piece].items():
            whole = optimizer.state[p].get(k)
            if isinstance(whole, Tensor) and whole.shape == p.shape:
                whole.reshape(-1)[span].copy_(v)


def _coded_step(step: Any, formats: dict[Tensor, str]) -> Any:
    """``step`` followed by the codec round trip of the stepped tensors' state: the plain optimizer then holds what
    the subject's decodes to. A bound method (``types.MethodType``), as LR schedulers wrap ``step.__func__``; a step
    the GradScaler skips never reaches it."""

    def coded(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        stepped = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        loss = step(optimizer, *args, **kwargs)
        round_trip(optimizer.state, stepped, formats)
        return loss

    return coded


def world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()
