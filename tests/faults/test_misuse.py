"""Every misuse distoptim knows, as one table: what the user did wrong, and the error every rank raises for it.

The table doubles as the documentation of distoptim's errors: read ``MISUSES`` top to bottom, topic by topic. Each
row is a ``Misuse``: its name, the action that commits it (``act(r)``, run on every rank; ``r.bad`` says whether
this rank misbehaves and ``r.pick(good, bad)`` chooses accordingly), which ranks misbehave (``ONE``: rank 1 only,
the others do the right thing; ``ALL``; ``BOTH``: the row runs twice, once each way), the exception type, and a
regular expression that the message must match (``re.search``): what was wrong and, where distoptim writes the
message, how to fix it. A few rows carry torch's own message (an optimizer class refusing a hyperparameter, DCP
refusing a checkpoint); the table checks that it reaches every rank.

What a row promises, checked on 2 real gloo ranks:
- every rank raises within ``DEADLINE_S``: a misbehaving rank the documented exception; a rank that did the right
  thing either the same, or the ``ValueError`` that names the misbehaving rank (``... failed on rank 1: TypeError:
  <the same message>``), which is how distoptim's agreements report an error found on one rank only;
- no rank hangs: each row runs on its own process group (a fresh ``dist.new_group``, about 10 ms on gloo) with a
  timeout of ``DEADLINE_S``, so a row that leaves its group desynchronised cannot disturb the next one; the ranks
  meet in a barrier of the default group before each row.

``KNOWN_GAPS`` lists misuses handled badly today (a hang until the group's timeout, a silent wrong answer, an
unclear message, an error on one rank only), each with what goes wrong. They run like the table and are expected
to fail (``xfail(strict=True)``): fixing one makes its test fail until the row moves into ``MISUSES``. Rows marked
``isolated`` desynchronise gloo so badly that it aborts the process; they run in ranks of their own.

All rows but the isolated ones run in one spawn of 2 ranks (``tests._dist.run_on_ranks``), one after another, each
on fresh objects; every rank returns its verdict on each row, and the parent reports each row as a test of its own.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.algorithms.join import Join
from torch.distributed.checkpoint.api import CheckpointException
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import (
    DistributedOptimizer,
    PostLocalSGDOptimizer,
    ShardedDataParallel,
    ZeroRedundancyOptimizer,
    as_functional_optim,
    checkpoint,
)
from distoptim.averagers import HierarchicalModelAverager, PeriodicModelAverager
from distoptim.functional import FunctionalAdam, FunctionalOptimizer
from distoptim.hooks import (
    PostLocalSGDState,
    allreduce_hook,
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
    post_localSGD_hook,
    reduce_to_owners_hook,
)
from tests._dist import RankFailure, run_on_ranks

DEADLINE_S = 10.0
"""Every rank must have raised within this many seconds of starting a row; also each row's group timeout."""
GAP_TIMEOUT_S = 1.0
"""The group timeout of rows in KNOWN_GAPS: those that hang today give up after this long."""

ONE, ALL, BOTH = ("one",), ("all",), ("one", "all")
SGD, ADAMW = torch.optim.SGD, torch.optim.AdamW


@dataclass(frozen=True)
class Rank:
    """One rank's view of one run of a row."""

    rank: int
    bad: bool  # whether this rank misbehaves in this run
    group: dist.ProcessGroup  # fresh for this run, timeout DEADLINE_S (GAP_TIMEOUT_S for known gaps)
    workdir: str  # a directory of this run, the same on every rank

    def pick(self, good: Any, bad: Any) -> Any:
        """``bad`` on a misbehaving rank, ``good`` on the others."""
        return bad if self.bad else good


@dataclass(frozen=True)
class Misuse:
    """One row of the table: a misuse and the error it gets."""

    name: str
    act: Callable[[Rank], object]
    ranks: tuple[str, ...]  # ONE, ALL or BOTH
    error: type[BaseException]
    says: str  # regex (re.search, DOTALL) the message must match
    gap: str = ""  # KNOWN_GAPS only: what goes wrong today
    isolated: bool = False  # may abort the process: run in ranks of its own


# ------------------------------------------------------------------------------------------------- building blocks
def _p(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.zeros(shape, dtype=dtype, requires_grad=True)


def _two() -> list[Tensor]:
    return [_p(3), _p(4)]


class _ClosureSGD(SGD):
    """A step that requires a closure, as SAM's: it would run the model inside each rank's shard step."""

    def step(self, closure: Any) -> Any:  # type: ignore[override]
        return super().step(closure)


def _zero(r: Rank, params: Any = None, cls: Any = SGD, **kwargs: Any) -> ZeroRedundancyOptimizer:
    """A ZeroRedundancyOptimizer over ``params`` (two small parameters by default) on the row's group."""
    params = _two() if params is None else params
    return ZeroRedundancyOptimizer(params, cls, process_group=r.group, **{"lr": 0.1, **kwargs})


def _give_grads(params: Iterable[Tensor]) -> None:
    for param in params:
        param.grad = torch.ones_like(param) if param.requires_grad else None


def _stepped(zero: ZeroRedundancyOptimizer) -> ZeroRedundancyOptimizer:
    _give_grads(zero.global_params)
    zero.step()
    return zero


def _plain_state_dict(cls: Any, shapes: Sequence[int], **kwargs: Any) -> dict[str, Any]:
    """What a plain ``cls`` over 1-D parameters of ``shapes`` saves after one step."""
    params = [_p(n) for n in shapes]
    optimizer = cls(params, **kwargs)
    _give_grads(params)
    optimizer.step()
    return optimizer.state_dict()


def _save_sharded(r: Rank, zero: ZeroRedundancyOptimizer) -> str:
    path = os.path.join(r.workdir, "checkpoint")
    dcp.save({"optim": _stepped(zero).sharded_state_dict()}, checkpoint_id=path, process_group=r.group)
    return path


def _load_sharded(r: Rank, path: str, zero: ZeroRedundancyOptimizer) -> None:
    """The documented resume: dcp.load into the new optimizer's sharded_state_dict(), then load_sharded_state_dict."""
    state = {"optim": zero.sharded_state_dict()}
    dcp.load(state, checkpoint_id=path, process_group=r.group)
    zero.load_sharded_state_dict(state["optim"])


def _save_checkpoint(r: Rank, zero: ZeroRedundancyOptimizer) -> str:
    path = os.path.join(r.workdir, "checkpoint")
    checkpoint.save({"optim": _stepped(zero).sharded_state_dict()}, path, process_group=r.group)
    return path


def _load_checkpoint(r: Rank, path: str, zero: ZeroRedundancyOptimizer) -> None:
    """The crash-safe resume: distoptim.checkpoint.load into sharded_state_dict(), then load_sharded_state_dict."""
    state = {"optim": zero.sharded_state_dict()}
    checkpoint.load(state, path, process_group=r.group)
    zero.load_sharded_state_dict(state["optim"])


def _load_damaged_checkpoint(r: Rank) -> None:
    path = _save_checkpoint(r, _zero(r, cls=ADAMW))
    if r.rank == 0:
        os.remove(os.path.join(path, "__1_0.distcp"))
    dist.barrier(group=r.group)
    _load_checkpoint(r, path, _zero(r, cls=ADAMW))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _ddp(r: Rank, model: nn.Module | None = None) -> DDP:
    return DDP(_model() if model is None else model, process_group=r.group)


def _backward(ddp: DDP) -> None:
    ddp(torch.ones(2, 4)).sum().backward()


def _overlap(r: Rank, ddp: DDP) -> ZeroRedundancyOptimizer:
    return _zero(r, ddp.module.parameters(), overlap_with_ddp=True)


def _averager(r: Rank, **kwargs: Any) -> PeriodicModelAverager:
    return PeriodicModelAverager(**{"period": 2, **kwargs}, process_group=r.group)


def _parameter() -> nn.Parameter:
    param = nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    return param


class _ClosureFailed(RuntimeError):
    """What the closures of the closure rows raise."""


# ---------------------------------------------------------------------------------------- actions too long for a lambda
def _hook_given_the_module(r: Rank) -> None:
    model = _model()
    hook_with_zero_step(allreduce_hook, model, _zero(r, model.parameters(), overlap_with_ddp=True))


def _hook_with_arguments_swapped(r: Rank) -> None:
    ddp = _ddp(r)
    zero = _overlap(r, ddp)
    hook_with_zero_step(allreduce_hook, *r.pick((ddp, zero), (zero, ddp)))


def _second_hook(r: Rank) -> None:
    ddp = _ddp(r)
    zero = _overlap(r, ddp)
    hook_with_zero_step(allreduce_hook, ddp, zero)
    hook_with_zero_step_interleaved(allreduce_hook, ddp, zero)


def _hook_over_another_model(r: Rank, hook: Callable[..., Any]) -> None:
    ddp = _ddp(r)
    hook(allreduce_hook, ddp, _zero(r, _model().parameters(), overlap_with_ddp=True))


def _hook_registered_on_another_model(r: Rank, hook: Callable[..., Any]) -> None:
    built_for, other = _ddp(r), _ddp(r)
    other.register_comm_hook(None, hook(allreduce_hook, built_for, _overlap(r, built_for)))
    _backward(other)


def _clip_under_overlap(r: Rank) -> None:
    ddp = _ddp(r)
    zero = _overlap(r, ddp)
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    _backward(ddp)
    zero.clip_grad_norm_(1.0)


def _zero_holds_more_than_ddp(r: Rank) -> None:
    ddp = _ddp(r)
    hook_with_zero_step(allreduce_hook, ddp, _zero(r, [*ddp.module.parameters(), _p(3)], overlap_with_ddp=True))


def _wrapped_hook_registered_with(r: Rank, inner: Callable[..., Any], zero_as_state: bool) -> None:
    """An overlap hook around ``inner``, registered with ``inner``'s state: the optimizer, or None."""
    ddp = _ddp(r)
    zero = _overlap(r, ddp)
    ddp.register_comm_hook(zero if zero_as_state else None, hook_with_zero_step(inner, ddp, zero))
    _backward(ddp)


def _overlap_step_without_hook(r: Rank) -> None:
    _overlap(r, _ddp(r)).step()


def _overlap_step_before_backward(r: Rank) -> None:
    ddp = _ddp(r)
    zero = _overlap(r, ddp)
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    zero.step()


def _overlap_zero_grad_after_unhooked_backward(r: Rank) -> None:
    ddp = _ddp(r)
    zero = _overlap(r, ddp)
    _backward(ddp)
    zero.zero_grad()


def _overlap_zero_grad_after_unhooked_backward_first_unused(r: Rank) -> None:
    ddp = _ddp(r)
    zero = _overlap(r, ddp)
    _backward(ddp)
    next(ddp.parameters()).grad = None  # as if the first parameter were unused: the others' gradients still count
    zero.zero_grad()


def _overlap_step_with_kwargs(r: Rank) -> None:
    ddp = _ddp(r)
    zero = _overlap(r, ddp)
    ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    _backward(ddp)
    zero.step(lr=0.5)


def _reduce_to_owners_without_zero(r: Rank) -> None:
    ddp = _ddp(r)
    zero = _zero(r, ddp.module.parameters())
    ddp.register_comm_hook(r.pick(zero, None), reduce_to_owners_hook)
    _backward(ddp)


def _post_local_sgd_hook_without_state(r: Rank) -> None:
    ddp = _ddp(r)
    ddp.register_comm_hook(r.pick(PostLocalSGDState(r.group, r.group, 1), None), post_localSGD_hook)
    _backward(ddp)


def _allreduce_hook_with_zero_as_state(r: Rank) -> None:
    ddp = _ddp(r)
    ddp.register_comm_hook(_zero(r, ddp.module.parameters()), allreduce_hook)
    _backward(ddp)


def _state_dict_after_a_newer_step(r: Rank) -> None:
    zero = _stepped(_zero(r))
    zero.consolidate_state_dict(to=0)
    _stepped(zero)
    zero.state_dict()


def _consolidate_to(r: Rank, bad_to: Any) -> None:
    _stepped(_zero(r)).consolidate_state_dict(to=r.pick(0, bad_to))


def _frozen_with_grad(r: Rank) -> None:
    zero = _zero(r, [_p(3), _p(4).requires_grad_(False)])
    _give_grads(zero.global_params)
    if r.bad:
        zero.global_params[1].grad = torch.ones(4)
    zero.step()


def _closure_raises(r: Rank) -> None:
    def closure() -> float:
        if r.bad:
            raise _ClosureFailed("the closure failed on purpose")
        return 0.0

    zero = _zero(r)
    _give_grads(zero.global_params)
    zero.step(closure)


def _clip_non_finite(r: Rank) -> None:
    zero = _zero(r)
    _give_grads(zero.global_params)
    zero.global_params[0].grad[0] = r.pick(1.0, float("nan"))
    zero.clip_grad_norm_(1.0, error_if_nonfinite=True)


def _add_group_while_another_builds(r: Rank) -> None:
    zero = _zero(r)
    if r.bad:
        zero.add_param_group({"params": [_p(5)]})
    else:
        _zero(r, [_p(5)])


def _load_state_dict_then_step(r: Rank, bad: dict[str, Any]) -> None:
    zero = _zero(r, cls=ADAMW)
    zero.load_state_dict(r.pick(_plain_state_dict(ADAMW, (3, 4), lr=0.1), bad))
    _stepped(zero)


def _unfreeze_on_one_rank(r: Rank) -> None:
    zero = _zero(r, [_p(5), _p(3).requires_grad_(False), _p(4)])
    zero.global_params[1].requires_grad_(r.bad)
    _stepped(zero)


def _lr_on_one_rank(r: Rank) -> None:
    zero = _stepped(_zero(r))
    zero.param_groups[0]["lr"] = r.pick(0.1, 0.5)  # a scheduler run on one rank only, say
    _stepped(zero)


def _sdp(r: Rank, model: nn.Module | None = None, **kwargs: Any) -> ShardedDataParallel:
    """A ShardedDataParallel over a small model and a ZeRO over its parameters, on the row's group."""
    model = _model() if model is None else model
    return ShardedDataParallel(model, _zero(r, model.parameters(), partition="even", **kwargs), bucket_cap_mb=0.001)


def _sdp_over_other_parameters(r: Rank) -> None:
    model = _model()
    params = list(model.parameters())
    ShardedDataParallel(model, _zero(r, r.pick(params, [*params[1:], _p(3)])))


def _sdp_buffers_differ(r: Rank) -> None:
    model = _model()
    model.register_buffer("running", torch.zeros(r.pick(2, 3)))  # not in ZeRO: SDP's own agreement sees it
    ShardedDataParallel(model, _zero(r, model.parameters()))


def _sdp_after_a_step(r: Rank) -> None:
    model = _model()
    zero = _stepped(_zero(r, model.parameters(), ADAMW, partition="even"))
    ShardedDataParallel(model, zero)


def _sdp_over_adagrad_one_rank_owns_nothing(r: Rank) -> None:
    """Adagrad's state exists at construction, but only on the ranks owning a piece: a one-element model leaves the
    other rank none, and the refusal must not depend on this rank's shard (it once hung there)."""
    model = nn.Linear(1, 1, bias=False)
    ShardedDataParallel(model, _zero(r, model.parameters(), torch.optim.Adagrad, partition="even"))


def _sdp_twice(r: Rank) -> None:
    model = _model()
    zero = _zero(r, model.parameters())
    ShardedDataParallel(model, zero)
    ShardedDataParallel(model, zero)


def _sdp_under_join(r: Rank) -> None:
    sdp = _sdp(r)
    with Join([sdp.zero]):
        sdp(torch.ones(2, 4)).sum().backward()


def _averagers_disagree_on_period(r: Rank) -> None:
    averager, param = _averager(r, period=r.pick(2, 3)), _parameter()
    for _ in range(3):
        averager.average_parameters([param])


def _post_local_sgd_negative_step(r: Rank) -> None:
    optimizer = PostLocalSGDOptimizer(SGD([_p(3)], lr=0.1), _averager(r))
    optimizer.load_state_dict({**_plain_state_dict(SGD, (3,), lr=0.1), "step": -1})


# torch's text for state_dict() before consolidate_state_dict(), which distoptim keeps as its prefix
_NOT_CONSOLIDATED = (
    r"^Optimizer state has not been consolidated on this rank\. Please call `consolidate_state_dict\(to=\d\)`"
)

# ----------------------------------------------------------------------------------------------------------- table
MISUSES: list[Misuse] = [
    # --- ZeroRedundancyOptimizer: arguments. Checked on every rank before anything is built; a bad argument on one
    # --- rank only raises there, and the others raise a ValueError naming that rank and its error.
    Misuse("params is a single tensor", lambda r: _zero(r, r.pick([_p(3)], _p(3))), BOTH,
           TypeError, r"got a single tensor; wrap it in a list"),
    Misuse("params is not an iterable", lambda r: _zero(r, r.pick([_p(3)], 5)), BOTH,
           TypeError, r"got int; pass model\.parameters\(\) or a list of"),
    Misuse("params mixes tensors and group dicts", lambda r: _zero(r, r.pick([_p(3)], [_p(3), {"params": [_p(3)]}])),
           BOTH, TypeError, r"mixes tensors and param-group dicts; pass either only tensors or only dicts"),
    Misuse("params is empty", lambda r: _zero(r, r.pick([_p(3)], [])), BOTH,
           ValueError, r"empty parameter list; pass at least one parameter"),
    Misuse("a param group without 'params'", lambda r: _zero(r, r.pick([_p(3)], [{"lr": 0.1}])), BOTH,
           ValueError, r"param group 0 has no 'params' key; each group dict needs 'params'"),
    Misuse("a parameter that is not a tensor", lambda r: _zero(r, r.pick([_p(3)], [_p(3), "bias"])), BOTH,
           TypeError, r"param group 0 holds a str, not a tensor; pass the parameters themselves \(model\.parameters"),
    Misuse("a sparse parameter", lambda r: _zero(r, [r.pick(_p(3, 3), torch.zeros(3, 3).to_sparse().requires_grad_())]),
           BOTH, ValueError, r"sparse parameter .*keep sparse parameters in a separate, unsharded optimizer"),
    Misuse("a non-leaf parameter", lambda r: _zero(r, [r.pick(_p(3), _p(3) * 2)]), BOTH,
           ValueError, r"can't optimize a non-leaf Tensor"),  # torch's own message: the optimizer class refuses it
    Misuse("optimizer_class given by name", lambda r: _zero(r, cls=r.pick(SGD, "sgd")), BOTH,
           TypeError, r"optimizer_class must be a torch\.optim\.Optimizer subclass such as torch\.optim\.AdamW"
                      r".*got str 'sgd'"),
    Misuse("optimizer_class given as an instance", lambda r: _zero(r, cls=r.pick(SGD, SGD([_p(1)], lr=0.1))), BOTH,
           TypeError, r"got an instance of SGD: pass the class, with its hyperparameters as keyword arguments"),
    Misuse("optimizer_class is the generic FunctionalOptimizer",
           lambda r: _zero(r, cls=r.pick(SGD, FunctionalOptimizer)), BOTH,
           TypeError, r"got the generic FunctionalOptimizer, use one of its subclasses"),
    # torch's own messages: the optimizer class refuses them (built over meta-device stand-ins first).
    Misuse("a hyperparameter the optimizer refuses", lambda r: _zero(r, lr=r.pick(0.1, -1.0)), BOTH,
           ValueError, r"Invalid learning rate: -1\.0"),
    Misuse("an unknown hyperparameter", lambda r: _zero(r, **r.pick({}, {"lrr": 0.1})), BOTH,
           TypeError, r"unexpected keyword argument 'lrr'"),
    # Positional arguments follow torch's signature, (params, optimizer_class, process_group, ...).
    Misuse("lr passed positionally, where process_group goes", lambda r: ZeroRedundancyOptimizer(_two(), SGD, 0.1), ALL,
           TypeError, r"process_group must be a torch\.distributed\.ProcessGroup or None, got float 0\.1; pass the "
                      r"optimizer's hyperparameters by keyword"),
    Misuse("overlap_with_ddp with an optimizer without a functional form",
           lambda r: _zero(r, cls=r.pick(SGD, torch.optim.Adafactor), overlap_with_ddp=True), BOTH,
           ValueError, r"Adafactor has none; use one of SGD, Adam, AdamW"),
    Misuse("an optimizer that couples every parameter in its step (LBFGS)",
           lambda r: _zero(r, cls=r.pick(SGD, torch.optim.LBFGS)), BOTH,
           ValueError, r"torch\.optim\.LBFGS couples every parameter in one step.*use torch\.optim\.LBFGS without "
                       r"ZeroRedundancyOptimizer"),
    Misuse("an optimizer whose step requires a closure (SAM)", lambda r: _zero(r, cls=r.pick(SGD, _ClosureSGD)), BOTH,
           TypeError, r"_ClosureSGD\.step requires a closure .*use an optimizer whose step takes closure=None"),
    Misuse("an unknown partition", lambda r: _zero(r, partition=r.pick("greedy", "flat")), BOTH,
           ValueError, r"partition must be one of 'greedy', 'even', got 'flat'"),
    Misuse("a parameter that is not a matrix in a Muon group (its own optimizer_class)",
           lambda r: _zero(r, [{"params": [r.pick(_p(4, 3), _p(4))], "optimizer_class": torch.optim.Muon}],
                           partition="even"), BOTH,
           ValueError, r"Muon\), parameter 0 has shape \(4,\): a vector or scalar.*put this parameter in a group"),
    Misuse("partition='even' with a parameter that does not fill its memory",
           lambda r: _zero(r, [r.pick(_p(4, 3), torch.zeros(4, 6)[:, ::2].requires_grad_())], partition="even"), BOTH,
           ValueError, r"does not fill its memory densely.*make it contiguous .*or use partition='greedy'"),
    Misuse("master_dtype that is not a floating-point dtype",
           lambda r: _zero(r, master_dtype=r.pick(None, torch.int32)), BOTH,
           TypeError, r"master_dtype must be a floating-point torch\.dtype such as torch\.float32, or None"),
    # --- ZeroRedundancyOptimizer: ranks that disagree. One 80-byte all-reduce compares every rank's parameters and
    # --- settings; on a difference every rank raises, naming the first difference and both values.
    Misuse("ranks pass different optimizer classes", lambda r: _zero(r, cls=r.pick(SGD, torch.optim.Adam)), ONE,
           ValueError, r"disagree \(settings: 'optimizer_class' .*every rank must pass the same"),
    Misuse("ranks pass different hyperparameters", lambda r: _zero(r, lr=r.pick(0.1, 0.2)), ONE,
           ValueError, r"disagree \(settings: 'lr' (0\.1 vs 0\.2|0\.2 vs 0\.1)\)"),
    Misuse("ranks give a param group different hyperparameters",
           lambda r: _zero(r, [{"params": [_p(3)], "lr": r.pick(0.1, 0.2)}, {"params": [_p(4)]}]), ONE,
           ValueError, r"disagree \(param group 0: 'lr' (0\.1 vs 0\.2|0\.2 vs 0\.1)\)"),
    Misuse("ranks split the parameters into different param groups",
           lambda r: _zero(r, r.pick([{"params": _two()}], [{"params": [_p(3)]}, {"params": [_p(4)]}])), ONE,
           ValueError, r"disagree \((1 vs 2|2 vs 1) param groups\)"),
    Misuse("ranks pass different partition modes", lambda r: _zero(r, partition=r.pick("greedy", "even")), ONE,
           ValueError, r"disagree \(settings: 'partition' ('greedy' vs 'even'|'even' vs 'greedy')\)"),
    Misuse("ranks pass different master_dtype", lambda r: _zero(r, master_dtype=r.pick(None, torch.float32)), ONE,
           ValueError, r"disagree \(settings: 'master_dtype' .*torch\.float32"),
    Misuse("ranks pass different parameters_as_bucket_view",
           lambda r: _zero(r, parameters_as_bucket_view=r.pick(False, True)), ONE,
           ValueError, r"disagree \(settings: 'parameters_as_bucket_view' (False vs True|True vs False)\)"),
    Misuse("ranks pass different overlap_with_ddp", lambda r: _zero(r, overlap_with_ddp=r.pick(False, True)), ONE,
           ValueError, r"disagree \(settings: 'overlap_with_ddp' (False vs True|True vs False)\)"),
    Misuse("ranks pass parameters of different shapes", lambda r: _zero(r, [_p(3), _p(r.pick(4, 5))]), ONE,
           ValueError, r"disagree \(param group 0, parameter 1: \(shape, dtype, device, requires_grad\) "),
    Misuse("ranks pass the parameters in different orders",
           lambda r: _zero(r, r.pick([_p(3), _p(4)], [_p(4), _p(3)])), ONE,
           ValueError, r"disagree \(param group 0, parameter 0: \(shape, dtype, device, requires_grad\) "),
    Misuse("ranks pass parameters of different dtypes",
           lambda r: _zero(r, [_p(3, dtype=r.pick(torch.float32, torch.float64))]), ONE,
           ValueError, r"disagree \(param group 0, parameter 0: .*torch\.float64"),
    Misuse("ranks freeze different parameters",
           lambda r: _zero(r, [_p(3), _p(4).requires_grad_(r.pick(True, False))]), ONE,
           ValueError, r"disagree \(param group 0, parameter 1: \(shape, dtype, device, requires_grad\) "),
    Misuse("ranks lay a parameter out with different strides",
           lambda r: _zero(r, [r.pick(_p(4, 3), torch.zeros(3, 4).t().requires_grad_())]), ONE,
           ValueError, r"disagree \(param group 0, parameter 0: strides (\(3, 1\) vs \(1, 4\)|\(1, 4\) vs \(3, 1\))\)"),
    Misuse("ranks pass different numbers of parameters", lambda r: _zero(r, r.pick(_two(), [*_two(), _p(5)])), ONE,
           ValueError, r"disagree \(param group 0 has (2 vs 3|3 vs 2) parameters\)"),
    Misuse("add_param_group with different hyperparameters",
           lambda r: _zero(r).add_param_group({"params": [_p(5)], "lr": r.pick(0.1, 0.2)}), ONE,
           ValueError, r"add_param_group: rank \d and rank \d disagree \(param group 1: 'lr' "),
    Misuse("add_param_group with different parameters",
           lambda r: _zero(r).add_param_group({"params": [_p(r.pick(5, 6))]}), ONE,
           ValueError, r"add_param_group: rank \d and rank \d disagree \(param group 1, parameter 0: "),
    Misuse("add_param_group with a parameter already held",
           lambda r: (z := _zero(r)).add_param_group({"params": [r.pick(_p(5), z.global_params[0])]}), BOTH,
           ValueError, r"some parameters appear in more than one parameter group"),  # torch's own message
    # Both calls start with the same agreement, so they meet, and every rank sees that they differ.
    Misuse("add_param_group on one rank while the other builds an optimizer", _add_group_while_another_builds, ONE,
           ValueError, r"disagree"),
    # --- Stepping and clipping. step() agrees, in one small all-reduce before the sync, that its local part succeeded
    # --- on every rank with the same parameters trainable: a failing rank raises its error, the others name it.
    Misuse("a frozen parameter has a gradient", _frozen_with_grad, BOTH,
           RuntimeError, r"requires_grad=False has a gradient.*Set requires_grad=True on it \(on every rank\)"
                         r".*or set its \.grad to None"),
    Misuse("the closure raises", _closure_raises, BOTH,
           _ClosureFailed, r"the closure failed on purpose"),
    Misuse("requires_grad changed on one rank only between steps", _unfreeze_on_one_rank, ONE,
           ValueError, r"step: rank \d and rank \d disagree \(the parameters that require grad, by index: "
                       r"(\(0, 1, 2\) vs \(0, 2\)|\(0, 2\) vs \(0, 1, 2\))\); change requires_grad and "
                       r"hyperparameters alike on every rank"),
    Misuse("a hyperparameter changed on one rank only between steps", _lr_on_one_rank, ONE,
           ValueError, r"step: rank \d and rank \d disagree \(param group 0: 'lr' (0\.1 vs 0\.5|0\.5 vs 0\.1)\); "
                       r"change requires_grad and hyperparameters alike on every rank"),
    Misuse("a non-finite gradient norm with error_if_nonfinite=True", _clip_non_finite, BOTH,
           RuntimeError, r"total norm of order 2\.0 of the gradients is non-finite .*pass error_if_nonfinite=False"),
    # --- Consolidated checkpoints (torch.optim's format).
    Misuse("state_dict() before consolidate_state_dict()", lambda r: _stepped(_zero(r)).state_dict(), ALL,
           RuntimeError, _NOT_CONSOLIDATED),
    Misuse("state_dict() after a step that followed the consolidation", _state_dict_after_a_newer_step, ALL,
           RuntimeError, _NOT_CONSOLIDATED),
    Misuse("consolidate_state_dict(to=) past the last rank", lambda r: _consolidate_to(r, 2), BOTH,
           ValueError, r"consolidate_state_dict\(to=2\): 'to' must be a rank of the group, 0\.\.1"),
    Misuse("consolidate_state_dict(to=) differs across ranks", lambda r: _consolidate_to(r, 1), ONE,
           ValueError, r"disagree \(\d vs \d consolidation target\); pass the same 'to' everywhere"),
    Misuse("consolidate_state_dict(to=) not an int", lambda r: _consolidate_to(r, "0"), BOTH,
           TypeError, r"'to' must be a rank \(an int\), 0\.\.1"),
    Misuse("load_state_dict of another optimizer class's dict",
           lambda r: _zero(r, cls=ADAMW).load_state_dict(_plain_state_dict(SGD, (3, 4), lr=0.1, momentum=0.9)), ALL,
           ValueError, r"has no 'amsgrad', 'betas', 'eps', which AdamW needs: it was saved by a different optimizer "
                       r"class .*Load a state dict saved by AdamW, or build ZeroRedundancyOptimizer with the"),
    Misuse("load_state_dict of another model's dict (other shapes)",
           lambda r: _zero(r, cls=ADAMW).load_state_dict(_plain_state_dict(ADAMW, (3, 5), lr=0.1)), ALL,
           ValueError, r"state\[1\]\['exp_avg'\] in the state dict has shape \(5,\) but parameter 1 has shape \(4,\)"
                       r".*saved for other parameters .*Load a state dict saved for these parameters"),
    Misuse("load_state_dict of another model's dict, then step()",
           lambda r: _load_state_dict_then_step(r, _plain_state_dict(ADAMW, (3, 5), lr=0.1)), BOTH,
           ValueError, r"saved for other parameters .*Load a state dict saved for these parameters"),
    Misuse("load_state_dict of another model's dict (other param groups)",
           lambda r: _zero(r).load_state_dict({"state": {}, "param_groups": [{"params": [0]}, {"params": [1]}]}), ALL,
           ValueError, r"has 2 param groups but this optimizer has 1; load a state dict saved for these parameters"),
    Misuse("load_state_dict of another model's dict (other group sizes)",
           lambda r: _zero(r).load_state_dict({"state": {}, "param_groups": [{"params": [0]}]}), ALL,
           ValueError, r"param group 0 has 1 parameters in the state dict but 2 in this optimizer; load a state dict"),
    Misuse("load_state_dict of a sharded_state_dict()",
           lambda r: (z := _zero(r)).load_state_dict(z.sharded_state_dict()), ALL,
           ValueError, r"expected an optimizer state dict with 'state' and 'param_groups' keys.*a dict from "
                       r"sharded_state_dict\(\) loads with dcp\.load then load_sharded_state_dict\(\)"),
    # --- Sharded checkpoints (torch.distributed.checkpoint).
    Misuse("load_sharded_state_dict of a torch.optim state dict",
           lambda r: _zero(r).load_sharded_state_dict(_plain_state_dict(SGD, (3, 4), lr=0.1)), ALL,
           ValueError, r"not a loaded sharded optimizer state: pass the dict that zero\.sharded_state_dict\(\) "
                       r"returned, after dcp\.load"),
    Misuse("load_sharded_state_dict of another optimizer class's checkpoint",
           lambda r: _load_sharded(r, _save_sharded(r, _zero(r, cls=ADAMW, weight_decay=0.1)), _zero(r)), ALL,
           ValueError, r"different optimizer class.*build ZeroRedundancyOptimizer with the optimizer class"),
    Misuse("load_sharded_state_dict of another model's checkpoint (other param groups)",
           lambda r: _load_sharded(r, _save_sharded(r, _zero(r, [{"params": [_p(3)]}, {"params": [_p(4)]}])), _zero(r)),
           ALL, ValueError, r"the checkpoint has 2 param groups but this optimizer has 1"),
    Misuse("load_sharded_state_dict of another model's checkpoint (parameters without state, other shapes)",
           lambda r: _load_sharded(r, _save_sharded(r, _zero(r, [_p(4, 3)], SGD)), _zero(r, [_p(3, 4)], SGD)), ALL,
           ValueError, r"saved for other parameters \(shapes \[\(4, 3\)\].*load a checkpoint of this model"),
    # DCP's own message: it compares the shapes while loading, before distoptim sees the dict.
    Misuse("load_sharded_state_dict of another model's checkpoint (same sizes, other shapes)",
           lambda r: _load_sharded(r, _save_sharded(r, _zero(r, [_p(4, 3)], ADAMW)), _zero(r, [_p(3, 4)], ADAMW)), ALL,
           CheckpointException, r"Size mismatch between saved torch\.Size\(\[4, 3\]\) and current: "
                                r"torch\.Size\(\[3, 4\]\)"),
    Misuse("load_sharded_state_dict of another model's checkpoint (other sizes)",
           lambda r: _load_sharded(r, _save_sharded(r, _zero(r, [_p(3), _p(5)], ADAMW)), _zero(r, cls=ADAMW)), ALL,
           CheckpointException, r"Size mismatch between saved torch\.Size\(\[5\]\) and current: torch\.Size\(\[4\]\)"),
    # distoptim.checkpoint.load checks the checkpoint first, on every rank: a ValueError, and nothing loaded.
    Misuse("distoptim.checkpoint.load of another model's checkpoint (other sizes)",
           lambda r: _load_checkpoint(r, _save_checkpoint(r, _zero(r, [_p(3), _p(5)], ADAMW)), _zero(r, cls=ADAMW)),
           ALL, ValueError, r"holds optim\.state\.1\.exp_avg with shape \(5,\), but the state to load has shape "
                            r"\(4,\): it was saved from another model"),
    Misuse("distoptim.checkpoint.load of another model's checkpoint (same sizes, other shapes)",
           lambda r: _load_checkpoint(r, _save_checkpoint(r, _zero(r, [_p(4, 3)], ADAMW)), _zero(r, [_p(3, 4)], ADAMW)),
           ALL, ValueError, r"holds optim\.state\.0\.exp_avg with shape \(4, 3\), but the state to load has shape "
                            r"\(3, 4\)"),
    Misuse("distoptim.checkpoint.load of a checkpoint whose data file is missing", _load_damaged_checkpoint, ALL,
           ValueError, r"is damaged: its data file __1_0\.distcp is missing"),
    # --- Overlap with DDP: the hook and the optimizer are built for each other, over the same parameters.
    Misuse("overlap hook for an optimizer built without overlap_with_ddp",
           lambda r: hook_with_zero_step(allreduce_hook, (d := _ddp(r)), _zero(r, d.module.parameters())), ALL,
           ValueError, r"built with overlap_with_ddp=True; rebuild it with ZeroRedundancyOptimizer\(\.\.\., "
                       r"overlap_with_ddp=True\) or drop the hook"),
    Misuse("overlap hook given the module instead of the DDP model", _hook_given_the_module, ALL,
           TypeError, r"ddp must be a DistributedDataParallel model, got Sequential"),
    Misuse("overlap hook with ddp and zero swapped", _hook_with_arguments_swapped, ALL,
           TypeError, r"zero must be a ZeroRedundancyOptimizer, got DistributedDataParallel; the arguments are "
                      r"\(hook, ddp, zero\)"),
    Misuse("a second overlap hook for one optimizer", _second_hook, ALL,
           ValueError, r"a ZeRO overlap hook is already registered for this ZeroRedundancyOptimizer"),
    Misuse("overlap hook over another DDP model's parameters",
           lambda r: _hook_over_another_model(r, hook_with_zero_step), ALL,
           ValueError, r"the DDP model trains parameters this ZeroRedundancyOptimizer does not hold: '0\.weight'"
                       r".*Give ZeRO all of the DDP model's trainable parameters"),
    Misuse("interleaved overlap hook over another DDP model's parameters",
           lambda r: _hook_over_another_model(r, hook_with_zero_step_interleaved), ALL,
           ValueError, r"does not hold: '0\.weight'.*Give ZeRO all of the DDP model's trainable parameters"),
    Misuse("overlap hook for an optimizer holding parameters DDP does not have", _zero_holds_more_than_ddp, ALL,
           ValueError, r"trainable parameters that are not in the DDP model: param_groups\[0\]\['params'\]\[4\] "
                       r"\(3,\).*Build ZeRO over the DDP model's parameters"),
    Misuse("overlap hook around reduce_to_owners_hook, registered without the optimizer as state",
           lambda r: _wrapped_hook_registered_with(r, reduce_to_owners_hook, zero_as_state=False), ALL,
           TypeError, r"reduce_to_owners_hook needs the ZeroRedundancyOptimizer as its state"),
    Misuse("overlap hook around allreduce_hook, registered with the optimizer as state",
           lambda r: _wrapped_hook_registered_with(r, allreduce_hook, zero_as_state=True), ALL,
           TypeError, r"process_group must be a torch\.distributed\.ProcessGroup or None, got ZeroRedundancyOptimizer"),
    Misuse("overlap hook registered on another DDP model than the one it was built for",
           lambda r: _hook_registered_on_another_model(r, hook_with_zero_step), ALL,
           ValueError, r"this ZeRO overlap hook was built for another DistributedDataParallel model than the one "
                       r"running it"),
    Misuse("interleaved overlap hook registered on another DDP model than the one it was built for",
           lambda r: _hook_registered_on_another_model(r, hook_with_zero_step_interleaved), ALL,
           ValueError, r"built for another DistributedDataParallel model"),
    # --- Overlap with DDP: step() only confirms the step the hook ran in the backward.
    Misuse("step() under overlap_with_ddp with no hook registered", _overlap_step_without_hook, ALL,
           RuntimeError, r"no overlap hook is registered: call ddp\.register_comm_hook\(None, hook_with_zero_step"),
    Misuse("step() under overlap_with_ddp before any backward", _overlap_step_before_backward, ALL,
           RuntimeError, r"the DDP comm hook has not stepped since the last step\(\); run loss\.backward\(\) on the "
                         r"DDP model's output"),
    Misuse("zero_grad() under overlap_with_ddp after a backward no hook stepped",
           _overlap_zero_grad_after_unhooked_backward, ALL,
           RuntimeError, r"has gradients but no optimizer step ran: register hook_with_zero_step"),
    Misuse("zero_grad() under overlap_with_ddp after an unhooked backward, first parameter without a gradient",
           _overlap_zero_grad_after_unhooked_backward_first_unused, ALL,
           RuntimeError, r"has gradients but no optimizer step ran: register hook_with_zero_step"),
    Misuse("step() under overlap_with_ddp with keyword arguments", _overlap_step_with_kwargs, ALL,
           TypeError, r"step\(\) takes no keyword arguments, got \['lr'\]: the step already ran inside DDP's backward"),
    Misuse("clip_grad_norm_ under overlap_with_ddp (the step already ran)", _clip_under_overlap, ALL,
           RuntimeError, r"overlap_with_ddp=True\) cannot clip: its step already ran inside DDP's backward"),
    # --- Gradient sharding (ZeRO-2) and the other DDP hooks: the hook's state must be what the hook expects.
    Misuse("reduce_to_owners_hook registered without the optimizer as its state", _reduce_to_owners_without_zero, ALL,
           TypeError, r"reduce_to_owners_hook needs the ZeroRedundancyOptimizer as its state: "
                      r"ddp\.register_comm_hook\(zero, reduce_to_owners_hook\), got NoneType"),
    Misuse("post_localSGD_hook registered without a PostLocalSGDState", _post_local_sgd_hook_without_state, ALL,
           TypeError, r"post_localSGD_hook needs a PostLocalSGDState as its state: ddp\.register_comm_hook\("
                      r"PostLocalSGDState\(\.\.\.\), post_localSGD_hook\), got NoneType"),
    Misuse("allreduce_hook registered with the optimizer as its state", _allreduce_hook_with_zero_as_state, ALL,
           TypeError, r"process_group must be a torch\.distributed\.ProcessGroup or None, got ZeroRedundancyOptimizer"),
    Misuse("PostLocalSGDState with a negative start_localSGD_iter", lambda r: PostLocalSGDState(r.group, None, -1), ALL,
           ValueError, r"start_localSGD_iter must be >= 0, got -1"),
    # --- Post-local SGD and model averagers: checked when built or called, before any collective.
    Misuse("PostLocalSGDOptimizer over a ZeroRedundancyOptimizer",
           lambda r: PostLocalSGDOptimizer(_zero(r), _averager(r)), ALL,
           ValueError, r"PostLocalSGDOptimizer cannot wrap a ZeroRedundancyOptimizer that shards over the ranks it "
                       r"averages: .*the averaging would change nothing"),
    Misuse("PostLocalSGDOptimizer given the optimizer class", lambda r: PostLocalSGDOptimizer(SGD, _averager(r)), ALL,
           TypeError, r"optim must be a torch\.optim\.Optimizer instance .*got the class SGD; build it first, e\.g\. "
                      r"torch\.optim\.SGD\(model\.parameters\(\), lr=0\.1\)"),
    Misuse("PostLocalSGDOptimizer given no averager", lambda r: PostLocalSGDOptimizer(SGD([_p(3)], lr=0.1), 2), ALL,
           TypeError, r"averager must be a ModelAverager, e\.g\. PeriodicModelAverager, got <class 'int'>"),
    Misuse("PostLocalSGDOptimizer state dict with a negative step", _post_local_sgd_negative_step, ALL,
           ValueError, r"state_dict\['step'\] must be >= 0, got -1"),
    Misuse("PeriodicModelAverager with period 0", lambda r: _averager(r, period=r.pick(2, 0)), BOTH,
           ValueError, r"Arg ``period`` must be a positive value\. Got 0: the steps between averagings"),
    Misuse("an averager with negative warmup_steps", lambda r: _averager(r, warmup_steps=-1), ALL,
           ValueError, r"Arg ``warmup_steps`` must be a non-negative number\. Got -1; use 0 to average from the first"),
    Misuse("averagers with different periods on the ranks", _averagers_disagree_on_period, ONE,
           ValueError, r"disagree \(\d vs \d period\); every rank must pass the same period\(s\) and warmup_steps"),
    Misuse("average_parameters of a single tensor", lambda r: _averager(r).average_parameters(_parameter()), ALL,
           TypeError, r"not a single tensor; pass model\.parameters\(\) or optimizer\.param_groups"),
    Misuse("average_parameters of plain tensors", lambda r: _averager(r).average_parameters([torch.ones(3)]), ALL,
           TypeError, r"plain torch\.Tensor, not an nn\.Parameter.*wrap it in torch\.nn\.Parameter"),
    Misuse("average_parameters of one param group dict",
           lambda r: _averager(r).average_parameters({"params": [_parameter()]}), ALL,
           TypeError, r"single param-group dict; pass a list of them"),
    Misuse("average_parameters of names", lambda r: _averager(r).average_parameters(["weight"]), ALL,
           TypeError, r"item 0 has type str; pass model\.parameters\(\) or optimizer\.param_groups"),
    Misuse("HierarchicalModelAverager without levels", lambda r: HierarchicalModelAverager({}, process_group=r.group),
           ALL, ValueError, r"must not be empty\. Map at least one period to a group size, e\.g\. \{2: 1, 4: 2\}"),
    Misuse("HierarchicalModelAverager with periods out of order",
           lambda r: HierarchicalModelAverager({4: 1, 2: 2}, process_group=r.group), ALL,
           ValueError, r"list periods in increasing order \(smallest, most local level first\), got \[4, 2\]"),
    Misuse("HierarchicalModelAverager whose last level is not the whole group",
           lambda r: HierarchicalModelAverager({2: 1, 4: 1}, process_group=r.group), ALL,
           ValueError, r"The last value in arg ``period_group_size_dict`` 1 must be equal to the size of arg "
                       r"``process_group`` 2"),
    # --- ShardedDataParallel: checked, and agreed, before anything is built.
    Misuse("ShardedDataParallel over a ZeRO built with overlap_with_ddp",
           lambda r: ShardedDataParallel((m := _model()), _zero(r, m.parameters(), overlap_with_ddp=True)), ALL,
           ValueError, r"ShardedDataParallel reduces the gradients itself.*build the ZeroRedundancyOptimizer without "
                       r"overlap_with_ddp"),
    Misuse("ShardedDataParallel over a ZeRO that holds other parameters than the module trains",
           _sdp_over_other_parameters, ALL,
           ValueError, r"the module's trainable parameters must be exactly the ZeroRedundancyOptimizer's: it does not "
                       r"hold the module's '0\.weight'.*the module has no param_groups\[0\]\['params'\]\[3\] \(3,\)"),
    Misuse("ShardedDataParallel with another model (a buffer) on one rank", _sdp_buffers_differ, ONE,
           ValueError, r"ShardedDataParallel construction: rank \d and rank \d disagree \(buffer 'running': \(shape, "
                       r"dtype\) (\(\(2,\), 'torch.float32'\) vs \(\(3,\)|\(\(3,\), 'torch.float32'\) vs \(\(2,\))"),
    Misuse("ShardedDataParallel over an even-partition ZeRO that has stepped already", _sdp_after_a_step, ALL,
           RuntimeError, r"re-cuts an even partition into buckets.*wrap the model before the optimizer has any state"),
    Misuse("ShardedDataParallel over an even Adagrad ZeRO of which one rank owns nothing",
           _sdp_over_adagrad_one_rank_owns_nothing, ALL,
           RuntimeError, r"re-cuts an even partition into buckets.*wrap the model before the optimizer has any state"),
    Misuse("ShardedDataParallel twice over one ZeRO", _sdp_twice, ALL,
           ValueError, r"already belongs to a ShardedDataParallel: wrap the model once"),
    Misuse("ShardedDataParallel with a bad bucket_cap_mb",
           lambda r: ShardedDataParallel((m := _model()), _zero(r, m.parameters()), bucket_cap_mb=r.pick(1, -1)),
           BOTH, ValueError, r"bucket_cap_mb must be a positive number of MiB, got -1"),
    Misuse("ShardedDataParallel with an infinite bucket_cap_mb",
           lambda r: ShardedDataParallel((m := _model()), _zero(r, m.parameters()), bucket_cap_mb=float("inf")),
           ALL, ValueError, r"bucket_cap_mb must be a positive number of MiB, got inf"),
    Misuse("ShardedDataParallel with a bucket_cap_mb no int holds in bytes",
           lambda r: ShardedDataParallel((m := _model()), _zero(r, m.parameters()), bucket_cap_mb=1e303),
           ALL, ValueError, r"bucket_cap_mb must be a positive number of MiB, got 1e\+303"),
    Misuse("ShardedDataParallel with Join (uneven inputs)", _sdp_under_join, ALL,
           NotImplementedError, r"Join \(uneven inputs\) is not supported with ShardedDataParallel"),
    # --- Functional optimizers.
    Misuse("as_functional_optim of an optimizer without a functional form",
           lambda r: as_functional_optim(torch.optim.LBFGS), ALL,
           ValueError, r"LBFGS'> does not have a functional counterpart! supported: torch\.optim\.SGD"),
    Misuse("as_functional_optim with an unknown hyperparameter", lambda r: as_functional_optim(SGD, lrr=0.1), ALL,
           TypeError, r"FunctionalSGD\(\): got an unexpected keyword argument 'lrr'"),
    Misuse("as_functional_optim with a hyperparameter torch.optim refuses", lambda r: as_functional_optim(SGD, lr=-1.0),
           ALL, ValueError, r"Invalid learning rate: -1\.0"),  # torch's own message, as torch.optim.SGD gives it
    Misuse("the generic FunctionalOptimizer built directly", lambda r: FunctionalOptimizer([_p(3)]), ALL,
           TypeError, r"FunctionalOptimizer is generic; build FunctionalSGD, FunctionalAdam, \.\.\. instead"),
    Misuse("a functional optimizer over no parameters", lambda r: FunctionalAdam([]), ALL,
           ValueError, r"optimizer got an empty parameter list \(FunctionalAdam\); use as_functional_optim\(\) for an "
                       r"optimizer driven by step_param\(\) alone"),
    Misuse("a functional step with too few gradients", lambda r: FunctionalAdam(_two()).step([torch.ones(3)]), ALL,
           ValueError, r"Params length: 2\. Gradients length: 1 \(FunctionalAdam\.step\(\): pass one gradient per "
                       r"parameter"),
    # --- DistributedOptimizer: checked before any RPC.
    Misuse("DistributedOptimizer of an optimizer that needs a closure",
           lambda r: DistributedOptimizer(torch.optim.LBFGS, []), ALL,
           TypeError, r"LBFGS\.step needs a closure; it cannot step from an autograd context"),
    Misuse("DistributedOptimizer given the optimizer by name", lambda r: DistributedOptimizer("sgd", []), ALL,
           TypeError, r"optimizer_class must be a class such as torch\.optim\.SGD, got 'sgd'"),
    Misuse("DistributedOptimizer over no parameters", lambda r: DistributedOptimizer(SGD, [], lr=0.1), ALL,
           ValueError, r"DistributedOptimizer got an empty params_rref"),
    Misuse("DistributedOptimizer over tensors instead of RRefs", lambda r: DistributedOptimizer(SGD, _two(), lr=0.1),
           ALL, TypeError, r"params_rref must hold RRefs to parameters, got Tensor; wrap each in "
                           r"torch\.distributed\.rpc\.RRef\(param\)"),
]  # fmt: skip

KNOWN_GAPS: list[Misuse] = []


# ---------------------------------------------------------------------------------------------------------- runner
@dataclass(frozen=True)
class Case:
    """One run of a row: the row, and which ranks misbehave."""

    row: Misuse
    mode: str  # "one" or "all"

    @property
    def id(self) -> str:
        return f"{self.row.name}: {'rank 1 only' if self.mode == 'one' else 'every rank'}"


def _cases(rows: list[Misuse]) -> list[Case]:
    return [Case(row, mode) for row in rows for mode in row.ranks]


CASES, GAP_CASES = _cases(MISUSES), _cases(KNOWN_GAPS)


def _verdict(case: Case, r: Rank, error: BaseException | None, seconds: float) -> str:
    """'' when this rank did what the row documents, else what it did instead."""
    if error is None:
        return f"returned without raising ({seconds:.1f} s)"
    text = f"{type(error).__name__}: {error}"
    if seconds > DEADLINE_S:
        return f"raised after {seconds:.1f} s: {text[:400]}"
    if not re.search(case.row.says, str(error), re.DOTALL):
        return f"raised {text[:400]}"
    if isinstance(error, case.row.error):
        return ""
    named = rf"failed on rank 1: {case.row.error.__name__}: "
    if not r.bad and isinstance(error, ValueError) and re.search(named, str(error)):
        return ""
    return f"raised {text[:400]}"


def _run_case(case: Case, rank: int, workdir: str) -> str:
    dist.barrier()  # the default group: a rank left waiting by the previous row joins the others before the next
    timeout = GAP_TIMEOUT_S if case.row.gap else DEADLINE_S
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    r = Rank(rank, case.mode == "all" or rank == 1, group, os.path.join(workdir, re.sub(r"\W+", "_", case.id)))
    start = time.monotonic()
    error: BaseException | None = None
    try:
        case.row.act(r)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as caught:  # DCP's CheckpointException is a BaseException
        error = caught
    return _verdict(case, r, error, time.monotonic() - start)


def _cases_body(rank: int, world_size: int, ids: list[str], workdir: str) -> dict[str, str]:
    """Run the cases named ``ids`` one after another, each on a fresh group; this rank's verdict on each."""
    by_id = {case.id: case for case in CASES + GAP_CASES}
    verdicts = {case_id: _run_case(by_id[case_id], rank, workdir) for case_id in ids}
    dist.barrier()  # no rank leaves while another may still wait for it in its last row
    return verdicts


def _run(cases: list[Case], workdir: Path) -> dict[str, list[str]]:
    """Every case's problems (empty: as documented), rank by rank: the shared cases in one spawn of 2 ranks, each
    isolated case in its own."""
    problems: dict[str, list[str]] = {}

    def collect(ids: list[str]) -> None:
        verdicts = run_on_ranks(_cases_body, 2, ids, str(workdir), timeout=120)
        for case_id in ids:
            problems[case_id] = [f"rank {rank}: {v[case_id]}" for rank, v in enumerate(verdicts) if v[case_id]]

    collect([case.id for case in cases if not case.row.isolated])
    for case in (case for case in cases if case.row.isolated):
        try:
            collect([case.id])
        except RankFailure as failure:
            problems[case.id] = [str(failure).splitlines()[0]]
    return problems


@pytest.fixture(scope="module")
def problems(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    return _run(CASES + GAP_CASES, tmp_path_factory.mktemp("misuse"))


def test_the_table_covers_the_library() -> None:
    assert len(MISUSES) >= 30 and len(CASES) > len(MISUSES), "rows, and rows run both ways"
    ids = [case.id for case in CASES + GAP_CASES]
    assert len(ids) == len(set(ids)), "row names are unique"
    for row in MISUSES + KNOWN_GAPS:
        re.compile(row.says)
        assert bool(row.gap) == (row in KNOWN_GAPS), f"{row.name}: a gap is said in KNOWN_GAPS, and only there"


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_misuse_raises_clearly_on_every_rank(case: Case, problems: dict[str, list[str]]) -> None:
    found = problems[case.id]
    assert not found, f"{case.id}: expected {case.row.error.__name__} matching {case.row.says!r}\n" + "\n".join(found)


@pytest.mark.parametrize(
    "case",
    [pytest.param(case, marks=pytest.mark.xfail(strict=True, reason=case.row.gap)) for case in GAP_CASES],
    ids=[case.id for case in GAP_CASES],
)
def test_known_gap_still_fails(case: Case, problems: dict[str, list[str]]) -> None:
    found = problems[case.id]
    assert not found, f"{case.id} ({case.row.gap}):\n" + "\n".join(found)
