"""What ``ShardedDataParallel`` checks before it builds anything, and what the ranks must agree on."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from distoptim._text import few
from distoptim.comm import agreement as _agreement
from distoptim.comm import p2p
from distoptim.comm.groups import attached, attached_everywhere
from distoptim.zero import validation
from distoptim.zero.join import JOIN_WITH_SDP

if TYPE_CHECKING:
    from distoptim.zero.optimizer import ZeroRedundancyOptimizer

__all__ = [
    "FOREIGN_MARKER",
    "P2P_APART",
    "POISONED",
    "SECOND_GRADIENT",
    "UNFINISHED",
    "UNREDUCED",
    "StaticGraph",
    "check_current",
    "check_messages_alike",
    "check_wrapping",
    "claim_groups",
    "fingerprint",
    "others_live",
]

POISONED = (
    "ShardedDataParallel: a backward raised after some of its gradient reductions were launched; the ranks' "
    "reductions no longer pair up (DDP's reducer is left the same way). Restart from a checkpoint: build the model, "
    "the optimizer and the wrapper again (on a new process group where the ranks launched different reductions)"
)
P2P_APART = (
    "they differ after a backward that raised midway on some ranks only: wrap on a new process group "
    "(torch.distributed.new_group) or restart the processes"
)
UNFINISHED = (
    "ShardedDataParallel: the last backward raised before it finished, so its gradient is partly reduced and cannot "
    "be stepped or added to. Call zero_grad() (it drops that gradient) before the next forward and step"
)
FOREIGN_MARKER = (
    "ShardedDataParallel: a parameter's .grad holds a marker (a gradient without values) that is not the one this "
    "store put there last: copied from another parameter, or kept from before a zero_grad() or a later backward; the "
    "gradient it stood for is gone. Set .grad to a full tensor of your own, or to None"
)
UNREDUCED = (
    "ShardedDataParallel: zero.step() found gradients that backward passes under model.no_sync() accumulated and no "
    "backward outside no_sync() reduced (each rank's own, unaveraged). Run the last micro-batch's backward outside "
    "no_sync(), or call zero.zero_grad() to drop them"
)
SECOND_GRADIENT = (
    "ShardedDataParallel: parameter {index} of the optimizer received a second gradient in one backward, after its "
    "first went into its bucket (reentrant activation checkpointing, checkpoint(..., use_reentrant=True), with the "
    "parameter also used outside the checkpoint does this). Use checkpoint(..., use_reentrant=False), or use the "
    "parameter on one side only"
)

_NEWEST = "newest ShardedDataParallel"  # under comm.groups.attached: a group's newest wrapper, weakly


class _Newest:
    """A process group's newest wrapper, held weakly (a finished wrapper may live on in a reference cycle)."""

    def __init__(self) -> None:
        self.get: Callable[[], Any] = lambda: None  # then a weak reference to it


def check_wrapping(module: nn.Module, zero: ZeroRedundancyOptimizer, bucket_cap_mb: Any, reduce_dtype: Any) -> None:
    """What must hold on this rank before anything is built (the caller agrees on it across ranks)."""
    if zero.overlap_stepper is not None:
        raise ValueError(
            "ShardedDataParallel reduces the gradients itself and zero.step() steps after the backward: build the "
            "ZeroRedundancyOptimizer without overlap_with_ddp (overlap_param_sync=True overlaps the parameter sync "
            "with the next forward instead)"
        )
    if zero.gradient_source is not None:
        raise ValueError("this ZeroRedundancyOptimizer already belongs to a ShardedDataParallel: wrap the model once")
    if zero.joins.open:  # its hook, built with the Join, would step the shard without the buckets' reductions
        raise NotImplementedError(JOIN_WITH_SDP)
    validation.refuse_sparse_gradients(module, "ShardedDataParallel")
    if (
        isinstance(bucket_cap_mb, bool)
        or not isinstance(bucket_cap_mb, (int, float))
        or not 0 < bucket_cap_mb * 2**20 < math.inf  # in bytes: a finite int (DDP's int(bucket_cap_mb * 2**20))
    ):
        raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}")
    if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point):
        raise ValueError(f"reduce_dtype must be a floating-point torch.dtype or None, got {reduce_dtype!r}")
    extra, missing = validation.unmatched_parameters(module.named_parameters(), zero)
    parts = [f"it does not hold the module's {few(extra)}"] if extra else []
    parts += [f"the module has no {few(missing)}"] if missing else []
    if parts:
        raise ValueError(
            f"the module's trainable parameters must be exactly the ZeroRedundancyOptimizer's: {'; '.join(parts)}. "
            "Build ZeRO over module.parameters() (freeze what it should not train)"
        )


def claim_groups(wrapper: Any) -> list[Any]:
    """``wrapper`` is now its groups' wrapper; returns the older ones still alive (they refuse to run)."""
    older: list[Any] = []
    for group in wrapper.zero.agreement_groups:
        newest = attached(group, _NEWEST, _Newest)
        previous = newest.get()
        if previous is not None and previous is not wrapper and all(previous is not o for o in older):
            older.append(previous)
        newest.get = weakref.ref(wrapper)
    return older


def check_current(wrapper: Any) -> None:
    """Refuse a forward or backward through a superseded wrapper (two on one group could mix their sums). Local."""
    if any(attached(group, _NEWEST, _Newest).get() is not wrapper for group in wrapper.zero.agreement_groups):
        raise RuntimeError(
            "ShardedDataParallel: a newer ShardedDataParallel was built on this model's process group (or "
            "replicate group), and one group serves one wrapper. Give each wrapped model's optimizer a group of "
            "its own: ZeroRedundancyOptimizer(..., process_group=dist.new_group())"
        )


def others_live(wrapper: Any) -> bool:
    """Whether a wrapper on other groups lives beside ``wrapper`` (one backward may reach both)."""
    return any(newest.get() not in (None, wrapper) for newest in attached_everywhere(_NEWEST))


def fingerprint(module: nn.Module, settings: dict[str, Any]) -> _agreement.Fingerprint:
    """What every rank must agree on before wrapping: the settings, each parameter's and buffer's layout."""
    entries: _agreement.Fingerprint = {f"setting {key} {{}}": str(value) for key, value in settings.items()}
    for name, p in module.named_parameters():
        layout = (tuple(p.shape), str(p.dtype), p.requires_grad, p.stride())
        entries[f"parameter {name!r}: (shape, dtype, requires_grad, strides) {{}}"] = layout
    for name, buffer in module.named_buffers():
        entries[f"buffer {name!r}: (shape, dtype) {{}}"] = (tuple(buffer.shape), str(buffer.dtype))
    return entries


def check_messages_alike(groups: Sequence[Any], everywhere: Any) -> None:
    """Each group's point-to-point reductions and syncs started, alike over that group's own ranks (apart, this
    wrapper's would pair with the stale messages of an earlier backward that raised); with several groups, a
    refusal is then agreed over ``everywhere``, so that the other groups' ranks raise rather than wait."""
    checked, refused = [g for g in groups if g is not None], None
    for group in checked:
        entry: _agreement.Fingerprint = {
            "reductions and syncs started point to point on this group {}": p2p.started(group)
        }
        try:
            _agreement.agree_across_ranks(entry, group, "ShardedDataParallel construction", P2P_APART)
        except ValueError as error:
            refused = refused or error
    if len(checked) > 1:
        _agreement.run_agreed(lambda: _raise(refused), everywhere, "ShardedDataParallel construction", (ValueError,))
    elif refused is not None:
        raise refused


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error


class StaticGraph:
    """``static_graph=True``: the parameters some rank used in the first backward (of those placed then), which later
    backwards take as agreed (``expected``: those still trainable at their end) until the next agreement checks them
    against the ranks' flags. A step before any backward sets no pattern; a re-placement drops it (the next backward
    sets it again), never a pending check."""

    def __init__(self) -> None:
        self.pattern: dict[int, bool] | None = None
        self.expected: dict[int, bool] | None = None  # a predicted backward's, until an agreement checks it

    @property
    def predicted(self) -> bool:
        return self.expected is not None

    def predict(self, params: Sequence[torch.Tensor]) -> None:
        """A backward's end: its parameters are the pattern's still trainable (and any a predicted one held)."""
        assert self.pattern is not None
        held = self.expected or {}
        self.expected = {
            i: held.get(i, False) or (used and params[i].requires_grad) for i, used in self.pattern.items()
        }

    def used(self, index: int) -> bool:
        return self.expected is not None and self.expected.get(index, False)

    def agreed(self, everywhere: Sequence[bool], placed: Sequence[int], backward: bool) -> None:
        """The ranks' agreed flags: the first backward's become the pattern; a predicted one must have matched it."""
        changed = [index for index, used in (self.expected or {}).items() if bool(everywhere[index]) != used]
        if changed:  # (the expectation stays: a step after a caught error raises again, never steps on zeros)
            raise ValueError(
                f"ShardedDataParallel(static_graph=True): parameters {changed[:8]} of the optimizer were used by "
                "some rank in the first backward and by none since, or the other way round. Build the wrapper "
                "without static_graph=True, which agrees on the parameters used at the end of each backward"
            )
        self.expected = None
        if self.pattern is None and backward:
            self.pattern = {index: bool(everywhere[index]) for index in placed}
