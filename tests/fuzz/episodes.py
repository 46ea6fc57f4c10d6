"""Two episodes of a fuzz program bigger than one action, done alike on both sides of a ``Run`` (interpret.py):

- ``gan``: a GAN round. A discriminator with its own optimizer (distoptim's in the program's mode, against DDP +
  SGD) is cleared in place (``zero_grad(set_to_none=False)``), steps on the generator's detached output, then the
  generator (the program's model) steps through it, which leaves a gradient in the discriminator for the next clear.
- ``reshard``: a resume at another world size, the program's last action. Saved at the session's W ranks (sharded
  through ``distoptim.checkpoint`` or consolidated), loaded at 1 rank (rank 0, a group of its own) into a model
  built from another seed, one step; saved there, loaded at W ranks, one step. The oracle is resumed the same way
  (the plain optimizer's ``state_dict``, the model's and the master copies) and the end compares everything.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distoptim.checkpoint
from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer
from distoptim.hooks import reduce_to_owners_hook
from tests.fuzz import models as hooks
from tests.fuzz.models import BATCH, VOCAB, batch
from tests.fuzz.modes import BUCKET_CAP_MB, Oracle, Subject, build_subject, group_of, hybrid_groups
from tests.fuzz.program import constructor_defaults, constructor_to_load

GAN_MICRO = 7  # the generator's inputs in a GAN round: a micro-batch number no backward() uses


def _discriminator() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(VOCAB, 8), nn.Tanh(), nn.Linear(8, 1))


def _gan_sides(run: Any, d_lr: float) -> dict[str, Any]:
    """The discriminators, made at the first round (every rank alike): distoptim's, wrapped as the mode says, and
    the oracle's DDP + SGD."""
    if "gan" not in run.extras:
        program = run.program
        model, reference = _discriminator(), _discriminator()
        hooks.register_gradient_hooks(program, model, reference)  # the grid (exact programs), the twin's ulp
        groups: dict[str, Any] = {}
        if program.options.get("hybrid"):
            groups["process_group"], groups["replicate_group"] = hybrid_groups()
        if program.mode == "sdp":  # one ShardedDataParallel a process group (the SDP guide): groups of its own
            groups = _own_groups(bool(program.options.get("hybrid")))
        zero = ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.SGD,
            lr=d_lr,
            momentum=0.9,
            partition=program.options["partition"],
            parameters_as_bucket_view=program.options["bucket_view"],
            **groups,
        )
        wrapper: nn.Module
        if program.mode == "sdp":
            wrapper = ShardedDataParallel(model, zero, bucket_cap_mb=BUCKET_CAP_MB)
        else:
            wrapper = ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)
            if program.mode == "zero2_hook":
                ddp.register_comm_hook(zero, reduce_to_owners_hook)
        plain = torch.optim.SGD(reference.parameters(), lr=d_lr, momentum=0.9)
        run.extras["gan"] = {
            "subject": (model, zero, wrapper),
            "oracle": (reference, plain, DDP(reference, bucket_cap_mb=BUCKET_CAP_MB)),
        }
    return run.extras["gan"]


def _own_groups(hybrid: bool) -> dict[str, Any]:
    """New groups over the ranks of the subject's (every rank creates each, in order, as ``dist.new_group`` needs)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if not hybrid:
        return {"process_group": dist.new_group(list(range(world_size)))}
    shards = [dist.new_group([start, start + 1]) for start in (0, 2)]
    replicas = [dist.new_group([offset, offset + 2]) for offset in (0, 1)]
    return {"process_group": shards[rank // 2], "replicate_group": replicas[rank % 2]}


def gan(run: Any, d_lr: float) -> None:
    sides = _gan_sides(run, d_lr)
    step, rank = run.step_number, run.rank
    inputs = batch(rank, step, GAN_MICRO)
    real = torch.randn(BATCH, VOCAB, generator=torch.Generator().manual_seed(500_000 + 1000 * step + rank))
    generators = {"subject": run.subject.wrapper, "oracle": run.oracle.ddp}
    for side in ("subject", "oracle"):  # the discriminator's round, its last gradient cleared in place
        _, optimizer, wrapper = sides[side]
        with run.on(side):
            optimizer.zero_grad(set_to_none=False)
            with torch.no_grad():
                fake = generators[side](*inputs, step, rank)
            scores = wrapper(torch.cat([fake, real]))
            (scores[:BATCH].mean() - scores[BATCH:].mean()).backward()
            optimizer.step()
    if isinstance(sides["subject"][1], ZeroRedundancyOptimizer):
        sides["subject"][1].sync_finished()
    theirs = dict(sides["oracle"][0].named_parameters())
    for name, got in sides["subject"][0].named_parameters():
        run.compare_tensor(f"action {run.counter}: discriminator {name}", got, theirs[name])  # exact or measured
        with torch.no_grad():
            theirs[name].copy_(got)
    run.zero_grad("optimizer", True)  # the generator's round, through the discriminator (which keeps a gradient)
    for side in ("subject", "oracle"):
        wrapper = sides[side][2]
        with run.on(side):
            (-wrapper(generators[side](*inputs, step, rank)).mean()).backward()
    run.step()


# ----------------------------------------------------------------------------------------- resume elsewhere
def _save(run: Any, subject: Subject, kind: str, path: str, group: Any) -> Any:
    """Subject's checkpoint: sharded (a directory, every rank of ``group`` writes its part) or consolidated (the
    model and ``state_dict()`` on the group's first rank, returned there)."""
    scheduler = None if subject.scheduler is None else subject.scheduler.state_dict()
    scaler = None if subject.scaler is None else subject.scaler.state_dict()
    if kind == "sharded":
        state = {"model": subject.model.state_dict(), "optim": subject.zero.sharded_state_dict()}
        distoptim.checkpoint.save(state, path, process_group=group)
        return {"scheduler": scheduler, "scaler": scaler}
    subject.zero.consolidate_state_dict(0)
    if dist.get_rank(subject.zero.process_group) != 0:
        return None
    model = {k: v.detach().clone() for k, v in subject.model.state_dict().items()}
    return {"model": model, "optim": subject.zero.state_dict(), "scheduler": scheduler, "scaler": scaler}


def _load(run: Any, kind: str, path: str, saved: dict[str, Any], group: Any) -> Subject:
    program = constructor_to_load(run.program, kind)  # the load must restore every hyperparameter (review r-42d)
    if kind == "sharded":
        new = build_subject(program, run.structure, seed=1, group=group)
        state = {"model": new.model.state_dict(), "optim": new.zero.sharded_state_dict()}
        distoptim.checkpoint.load(state, path, process_group=group)
        new.model.load_state_dict(state["model"])
        new.zero.load_sharded_state_dict(state["optim"])
    else:
        new = build_subject(program, run.structure, seed=1, model_state=saved["model"], group=group)
        new.zero.load_state_dict(saved["optim"])
    if new.scheduler is not None:
        new.scheduler.load_state_dict(saved["scheduler"])
    if new.scaler is not None:
        new.scaler.load_state_dict(saved["scaler"])
    return new


def _oracle_state(oracle: Oracle) -> dict[str, Any]:
    return {
        "model": {k: v.detach().clone() for k, v in oracle.model.state_dict().items()},
        "optim": oracle.optimizer.state_dict(),
        "masters": [oracle.masters[id(p)].detach().clone() if id(p) in oracle.masters else None for p in oracle.params],
        "scheduler": None if oracle.scheduler is None else oracle.scheduler.state_dict(),
        "scaler": None if oracle.scaler is None else oracle.scaler.state_dict(),
    }


def _oracle_from(run: Any, kind: str, state: dict[str, Any], group: Any) -> Oracle:
    """The oracle resumed from ``state``: built with torch's defaults (the load restores the groups' settings), then
    the subject's constructor's ``defaults``, which a load keeps and torch reads for Adagrad's lazy ``sum`` of a
    parameter stepped first after it (seed 810032: an added group, a sharded ``reshard``), as ``resume`` does."""
    oracle = Oracle(constructor_defaults(run.program), run.structure, group)
    oracle.model.load_state_dict(state["model"])
    oracle.optimizer.load_state_dict(state["optim"])
    oracle.rebuilt_with(constructor_to_load(run.program, kind).kwargs)
    with torch.no_grad():
        for p, master in zip(oracle.params, state["masters"]):
            if master is not None:
                oracle.masters[id(p)].copy_(master)
    if oracle.scheduler is not None:
        oracle.scheduler.load_state_dict(state["scheduler"])
    if oracle.scaler is not None:
        oracle.scaler.load_state_dict(state["scaler"])
    if run.program.options.get("twin"):  # as ``Run`` gives its first oracle (modes._in_pieces)
        oracle.pieces = run._pieces
    return oracle


def _one_step(run: Any) -> None:
    run.zero_grad("optimizer", True)
    run.backward(1, False)
    run.step()


def reshard(run: Any, kind: str) -> None:
    run.subject.sync_finished()
    for model in (run.subject.model, run.oracle.model):  # one copy of the buffers, as resume() says
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
    solo = group_of([0])  # every rank makes it
    path = os.path.join(run.workdir, f"reshard-{run.program.seed}-{run.counter}")
    saved, oracle_state = _save(run, run.subject, kind, f"{path}-W", None), _oracle_state(run.oracle)
    payload: Any = None
    failed: BaseException | None = None
    if run.rank == 0:  # W ranks -> 1
        try:
            run.subject = _load(run, kind, f"{path}-W", saved, solo)
            with run.on("oracle"):
                run.oracle = _oracle_from(run, kind, oracle_state, solo)
            _one_step(run)
            run.compare_local(f"action {run.counter}: a step at 1 rank after loading at 1 what {run.world_size} saved")
            payload = (_save(run, run.subject, kind, f"{path}-1", solo), _oracle_state(run.oracle))
        except Exception as error:  # a refusal at 1 rank: the others wait in the broadcast below for its outcome
            failed, payload = error, f"{type(error).__name__}: {str(error).strip()}"
    box = [payload]
    dist.broadcast_object_list(box, src=0)  # 1 rank -> W
    if failed is not None:
        raise failed
    if isinstance(box[0], str):  # rank 0's error, relayed as distoptim's agreement relays a rank's (session.py)
        raise ValueError(f"reshard's step at 1 rank failed on rank 0: {box[0]}")
    saved, oracle_state = box[0]
    run.subject = _load(run, kind, f"{path}-1", saved, None)
    with run.on("oracle"):
        run.oracle = _oracle_from(run, kind, oracle_state, None)
    _one_step(run)
