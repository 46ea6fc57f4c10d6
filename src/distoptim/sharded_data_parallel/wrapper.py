"""``ShardedDataParallel``: DDP's job done for a ``ZeroRedundancyOptimizer``, with the gradient sharded in memory."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from distoptim._backward import in_backward
from distoptim._flat import flat_view, is_dense, pack, unpack_
from distoptim.comm import agreement as _agreement
from distoptim.comm import collectives as comm
from distoptim.sharded_data_parallel import checks
from distoptim.sharded_data_parallel.buckets import BucketCaps, BucketPlan, plan_buckets
from distoptim.sharded_data_parallel.gradients import OwnedGradients
from distoptim.sharded_data_parallel.sync import BucketedSync
from distoptim.zero.join import JOIN_WITH_SDP
from distoptim.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["ShardedDataParallel"]


class ShardedDataParallel(nn.Module):
    """Data parallelism for a model stepped by a ``ZeroRedundancyOptimizer``, holding 1/N of the gradient per rank.

    Use it instead of ``DistributedDataParallel``: gradients are reduced to their owners inside the backward and
    kept there (``.grad`` holds a marker). The contract: the SDP guide.

    Args:
        module: the model; its trainable parameters must be exactly ``zero``'s.
        zero: its ``ZeroRedundancyOptimizer``, without ``overlap_with_ddp``, with no optimizer state yet.
        bucket_cap_mb: the most a gradient bucket holds, in MiB (default 25).
        broadcast_buffers: broadcast rank 0's buffers before each forward, as DDP does (default True).
        reduce_dtype: the dtype gradients are reduced and kept in (default: the parameters').
        overlap_param_sync: leave the parameter sync in flight after ``step()`` for the next forward (default False).
        static_graph: every backward uses the same parameters (DDP's promise), agreed once (default False).

    Raises:
        TypeError: ``module`` is not a module, or ``zero`` not a ``ZeroRedundancyOptimizer``.
        ValueError: on every rank: ``module``'s and ``zero``'s parameters, or the ranks' models differ; a bad setting.
        RuntimeError: ``zero`` has state to re-cut; later, after a raised backward, or an older wrapper.

    Example:
        ```python
        model = distoptim.ShardedDataParallel(model, zero)     # instead of DDP(model)
        loss_fn(model(batch)).backward()                      # then zero.step()
        ```
    """

    _pre_hooked = False  # whether the user registered a forward pre-hook on the wrapper itself

    def __init__(
        self,
        module: nn.Module,
        zero: ZeroRedundancyOptimizer,
        *,
        bucket_cap_mb: float = 25.0,
        broadcast_buffers: bool = True,
        reduce_dtype: torch.dtype | None = None,
        overlap_param_sync: bool = False,
        static_graph: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"ShardedDataParallel wraps an nn.Module, got {type(module).__name__}")
        if not isinstance(zero, ZeroRedundancyOptimizer):
            raise TypeError(
                f"ShardedDataParallel needs the ZeroRedundancyOptimizer of the model, got {type(zero).__name__}"
            )
        settings: dict[str, Any] = {"bucket_cap_mb": bucket_cap_mb, "broadcast_buffers": broadcast_buffers}
        settings |= {"reduce_dtype": str(reduce_dtype), "overlap_param_sync": overlap_param_sync}
        settings |= {"static_graph": static_graph}
        _agreement.run_agreed(
            lambda: checks.check_wrapping(module, zero, bucket_cap_mb, reduce_dtype),
            zero.agreement_groups,
            "ShardedDataParallel construction",
            then_agree_on=lambda _: checks.fingerprint(module, settings),
        )
        checks.check_messages_alike([zero.process_group, zero.replicate_group], zero.agreement_groups)
        self.module, self.zero = module, zero
        self.broadcast_buffers, self.reduce_dtype = broadcast_buffers, reduce_dtype
        self.overlap_param_sync, self.static_graph = overlap_param_sync, static_graph
        self._cap_bytes = cap_bytes = int(bucket_cap_mb * 2**20)
        self._caps = BucketCaps(cap_bytes, reduce_dtype)  # any (device, dtype), one added later too
        zero.land_sync()
        _broadcast_from_first([*module.parameters(), *module.buffers()], zero.agreement_groups, cap_bytes)
        zero.use_regions(self._caps)
        self._buckets: list[BucketPlan] = []
        self.gradients: OwnedGradients | None = None
        self._bucketed: BucketedSync | None = None  # the parameter sync, bucket by bucket (the gradients' sync)
        self._handles: dict[int, list[Any]] = {}  # id(parameter) -> its hooks' handles
        self._sync_buffers_next = True
        self._landers: list[Any] = []  # the state-dict pre-hooks' handles (registered again when the buckets change)
        superseded = checks.claim_groups(self)
        self._rebuild()
        for older in superseded:  # the model wrapped again: its backward is this wrapper's alone
            older._let_go_of(self)

    # ---------------------------------------------------------------------------------------- building
    def _rebuild(self) -> None:
        """(Re)build the buckets, the owned gradient and the bucketed sync over ``zero``'s current plan."""
        zero = self.zero
        self._buckets = plan_buckets(zero.plan, self._caps, self._buckets)
        sync = BucketedSync(zero.placed_sync, self._buckets, zero.plan, zero.global_params, self.overlap_param_sync)
        self._bucketed = sync
        if self.gradients is None:
            self.gradients = OwnedGradients(self, self._buckets, sync, self._rebuild)
        else:
            self.gradients.replan(self._buckets, sync)
        gradients = self.gradients
        zero.attach_gradient_source(gradients)
        for param in zero.global_params:  # each hook one call into the store (the same store after a replan)
            if param.requires_grad and id(param) not in self._handles:
                self._handles[id(param)] = [
                    param.register_post_accumulate_grad_hook(gradients.on_grad),  # type: ignore[no-untyped-call]
                    param.register_hook(partial(gradients.before_gradient, weakref.ref(param))),  # type: ignore[no-untyped-call]
                ]
        if self.overlap_param_sync:
            self._register_landing_hooks(sync)

    def _let_go_of(self, newer: ShardedDataParallel) -> None:
        """Superseded by ``newer``: remove this wrapper's hooks from the parameters ``newer`` hooks too."""
        for key in self._handles.keys() & newer._handles.keys():
            for handle in self._handles.pop(key):
                handle.remove()
        if newer.module is self.module:
            for handle in self._landers:
                handle.remove()
            self._landers = []

    def _register_landing_hooks(self, sync: BucketedSync) -> None:
        """Before each submodule's forward, land the buckets of its subtree's parameters (the root's: its own only);
        before the wrapper's, once the user registered a pre-hook on it, everything."""
        for handle in self._landers:
            handle.remove()
        self._landers, zero = [], self.zero
        for submodule in self.module.modules():
            params = _held_directly(submodule) if submodule is self.module else submodule.parameters()
            last = sync.last_unit(params)
            if last >= 0:
                sync.landing[submodule] = last
                # model.module.state_dict(), DDP's saving idiom, reads every parameter: it waits for all of them
                self._landers.append(submodule.register_state_dict_pre_hook(lambda *_: zero.land_sync()))  # type: ignore[no-untyped-call]
        if self._pre_hooked:
            sync.landing[self] = len(sync.units)

    def register_forward_pre_hook(self, hook: Any, *, prepend: bool = False, with_kwargs: bool = False) -> Any:
        """``nn.Module.register_forward_pre_hook``; with ``overlap_param_sync`` the whole sync lands before it runs.

        Args:
            hook: the pre-hook.
            prepend: run it before the wrapper's other pre-hooks (default False).
            with_kwargs: pass it the keyword arguments too (default False).
        """
        self._pre_hooked = True
        if self._bucketed is not None and self.overlap_param_sync:
            self._register_landing_hooks(self._bucketed)
        return super().register_forward_pre_hook(hook, prepend=prepend, with_kwargs=with_kwargs)

    # ------------------------------------------------------------------------------------------ training
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward, after broadcasting rank 0's buffers when DDP would.

        Args:
            *args: the module's positional arguments.
            **kwargs: the module's keyword arguments.
        """
        assert self.gradients is not None
        if not in_backward():  # a recomputing checkpoint runs forwards inside the backward
            self.gradients.check_finished()
            checks.check_current(self)
        if self.broadcast_buffers and self._sync_buffers_next:
            _broadcast_from_first(self.module.buffers(), self.zero.agreement_groups, self._cap_bytes)
        output = self.module(*args, **kwargs)
        self.zero.land_sync()  # the rest (modules the forward did not run): the loss may read them (weight decay)
        self._sync_buffers_next = torch.is_grad_enabled() and not self.gradients.no_sync
        return output

    def join_hook(self, **kwargs: Any) -> Any:
        """Refuse ``Join`` (uneven inputs) where it is built, not at a backward: ``NotImplementedError`` on every rank.

        Args:
            **kwargs: ``Join``'s keyword arguments (none are used).
        """
        raise NotImplementedError(JOIN_WITH_SDP)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate the local gradient in ``.grad``; the next one outside reduces it."""
        assert self.gradients is not None
        previous, self.gradients.no_sync = self.gradients.no_sync, True
        try:
            yield
        finally:
            self.gradients.no_sync = previous

    def sync_finished(self) -> None:
        """Wait for the parameter sync still in flight (``overlap_param_sync``). Local; raises here if this rank owns
        parameters written while their sync was in flight."""
        self.zero.sync_finished()

    def _land_sync(self) -> None:
        """``sync_finished`` without its local check (one rank raising would leave the others waiting)."""
        self.zero.land_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the owned gradient (as ``zero.zero_grad()`` does) and any ``.grad`` (left by ``no_sync``).

        Args:
            set_to_none: set each ``.grad`` to None rather than to zeros (default True).
        """
        assert self.gradients is not None
        self.gradients.clear(set_to_none)  # first, as zero.zero_grad(): it drops what a raised backward left
        super().zero_grad(set_to_none)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self._land_sync()  # to(), float() ... copy parameters: never one whose sync is still in flight
        return super()._apply(fn, *args, **kwargs)  # type: ignore[no-untyped-call]

    # ------------------------------------------------------------------ what reads parameters waits first
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """``nn.Module.state_dict`` (keys prefixed ``module.``, as DDP's), once the parameter sync has landed.

        Args:
            *args: ``nn.Module.state_dict``'s positional arguments.
            **kwargs: its keyword arguments.
        """
        self._land_sync()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """``nn.Module.load_state_dict``, once the parameter sync has landed (it would overwrite what is loaded).

        Args:
            *args: ``nn.Module.load_state_dict``'s positional arguments.
            **kwargs: its keyword arguments.
        """
        self._land_sync()
        return super().load_state_dict(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """``nn.Module.parameters``, once the parameter sync has landed.

        Args:
            recurse: include the submodules' parameters (default True).
        """
        self._land_sync()
        return super().parameters(recurse)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        """``nn.Module.named_parameters``, once the parameter sync has landed.

        Args:
            *args: ``nn.Module.named_parameters``'s positional arguments.
            **kwargs: its keyword arguments.
        """
        self._land_sync()
        return super().named_parameters(*args, **kwargs)


def _held_directly(module: nn.Module) -> Iterator[Tensor]:
    """``module``'s own parameters and those of the parameter containers under it (never called themselves)."""
    yield from module.parameters(recurse=False)
    for child in module.children():
        if isinstance(child, (nn.ParameterDict, nn.ParameterList)):
            yield from _held_directly(child)


def _broadcast_from_first(tensors: Iterable[Tensor], groups: Sequence[comm.Group], cap_bytes: int) -> None:
    """Every rank's ``tensors`` made the first rank's, group by group (the replicas first), packed per (device,
    dtype) in batches of at most ``cap_bytes`` (a larger dense tensor in place): never a second copy of the model."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for tensor in tensors:
        if tensor.numel():
            by_kind.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    with torch.no_grad():
        for same_kind in by_kind.values():
            for batch in _batches(same_kind, cap_bytes):
                alone = len(batch) == 1 and is_dense(batch[0])
                flat = flat_view(batch[0]) if alone else pack(batch)
                for group in reversed(groups):
                    comm.broadcast_slices(flat, [(0, 0, flat.numel())], group)
                if not alone:
                    unpack_(flat, batch)


def _batches(tensors: Sequence[Tensor], cap_bytes: int) -> Iterator[list[Tensor]]:
    """``tensors`` in order, in runs of at most ``cap_bytes`` (a larger tensor alone)."""
    batch: list[Tensor] = []
    filled = 0
    for tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if batch and filled + size > cap_bytes:
            yield batch
            batch, filled = [], 0
        batch.append(tensor)
        filled += size
    if batch:
        yield batch
