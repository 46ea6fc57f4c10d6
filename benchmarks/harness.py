"""What the benchmark's timed loop drives for one variant on one rank, and how a variant builds it.

A ``Variant`` is a row of the benchmark (``zero_variants.VARIANTS``): ``setup(model, adamw_kwargs)`` wraps the
freshly built fp32 (or ``dtype``) model and makes the optimizer, returning a ``Harness``. The loop then calls, per
iteration, ``zero_grad()``, ``forward(inputs, targets)`` (the loss), ``backward(loss)`` and ``step()``. A harness
also says where its tensors are (``tensors()``: parameters, gradients, optimizer state, master copies, by the
wrapper's own data structures) so that the memory census can name what it counts.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

__all__ = ["Builder", "Harness", "Variant", "ddp_setup", "optimizer_state_tensors"]

Builder = Callable[[DistributedDataParallel, Iterable[Tensor], dict[str, Any]], Optimizer]


def optimizer_state_tensors(optimizer: Optimizer) -> list[Tensor]:
    """The tensors in ``optimizer.state`` (for AdamW: exp_avg, exp_avg_sq and step of each parameter)."""
    return [v for entry in optimizer.state.values() for v in entry.values() if isinstance(v, Tensor)]


@dataclass
class Harness:
    """One rank's model wrapper and optimizer, as the loop drives them.

    ``local_optimizer`` holds this rank's state; ``tensors()`` names the tensors of each memory category
    (``params``, ``grads``, ``state``, ``master``) and ``cpp_buffers()`` the storages held in C++ (DDP's gradient
    buckets), address -> bytes, with made-up negative addresses where the real ones cannot be seen. ``no_sync`` is
    a context for a backward without gradient reduction (the compute alone), None where the loop cannot use one.
    """

    model: nn.Module
    optimizer: Any
    local_optimizer: Optimizer
    tensors: Callable[[], dict[str, list[Tensor]]]
    backward: Callable[[Tensor], None] = lambda loss: loss.backward()
    no_sync: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
    cpp_buffers: Callable[[], dict[int, int]] = dict

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def forward(self, inputs: Tensor, targets: Tensor) -> Tensor:
        loss: Tensor = self.model(inputs, targets)
        return loss

    def step(self) -> None:
        self.optimizer.step()


Setup = Callable[[nn.Module, dict[str, Any]], Harness]


@dataclass(frozen=True)
class Variant:
    """A row of the benchmark: ``setup(model, adamw_kwargs)`` makes its ``Harness``.

    ``impl`` and ``setting`` pair variants for the closing comparison: distoptim's and torch's with the same
    ``setting`` are compared (time, bytes); ``impl="baseline"`` is not paired. ``family``: ``"ddp"`` (DDP-wrapped:
    the default set), ``"peer"`` (another library's sharded data parallelism: FSDP2, DeepSpeed) or ``"sdp"``
    (distoptim's ``ShardedDataParallel``). ``missing()`` says why the variant cannot run here (a library not
    installed, an API not yet there), or None; ``prepare()`` imports what it needs before memory is measured.
    ``counts_bytes``: whether the byte counter sees all its collectives (False: the bytes are not reported).
    """

    name: str
    impl: str
    setting: str
    setup: Setup
    ddp_cpp_allreduce: bool = True
    steps_in_backward: bool = False
    dtype: torch.dtype = torch.float32
    family: str = "ddp"
    counts_bytes: bool = True
    missing: Callable[[], str | None] = lambda: None
    prepare: Callable[[], None] = lambda: None


class _BucketRecorder:
    """DDP's gradient buckets, address -> bytes. DDP keeps them in C++; a comm hook sees them (and may keep Python
    views of them, which the census must not count twice), so a hook registered on the model is wrapped to record
    the buckets of the latest backward. Without a hook, only their sizes are known (DDP's logging data). The
    wrapper holds neither DDP nor this recorder: DDP's reducer holds the wrapper in C++, where a cycle back to DDP
    would never be collected."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.ddp = weakref.ref(ddp)
        self.seen: dict[int, int] = {}
        self.hooked = False
        register, seen = ddp.register_comm_hook, self.seen

        def register_recording(state: object, hook: Callable[[Any, Any], Any]) -> None:
            def recording(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations, if any
                if bucket.index() == 0:
                    seen.clear()  # DDP rebuilds its buckets after the first backward
                storage = bucket.buffer().untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
                return hook(state, bucket)

            self.hooked = True
            register(state, recording)

        ddp.register_comm_hook = register_recording  # type: ignore[method-assign]

    def buffers(self) -> dict[int, int]:
        ddp = self.ddp()
        if self.hooked or ddp is None:
            return dict(self.seen)
        data = ddp._get_ddp_logging_data()
        if data.get("gradient_as_bucket_view"):
            return {}
        sizes = [int(size) for size in str(data.get("bucket_sizes", "")).split(",") if size.strip()]
        return {-1 - index: size for index, size in enumerate(sizes)}


def ddp_setup(build: Builder, local: Callable[[Any], Optimizer] = lambda optimizer: optimizer) -> Setup:
    """A DDP-wrapped variant: ``build(ddp_model, params, adamw_kwargs)`` makes the optimizer, ``local`` finds the
    optimizer that holds this rank's state."""

    def setup(model: nn.Module, kwargs: dict[str, Any]) -> Harness:
        ddp = DistributedDataParallel(model)
        buckets = _BucketRecorder(ddp)
        params = list(model.parameters())
        optimizer = build(ddp, params, kwargs)
        local_optimizer = local(optimizer)

        def tensors() -> dict[str, list[Tensor]]:
            return {
                "params": params,
                "grads": [p.grad for p in params if p.grad is not None],
                "state": optimizer_state_tensors(local_optimizer),
                "master": [t.tensor for t in getattr(getattr(optimizer, "local_shard", None), "masters", [])],
            }

        return Harness(
            model=ddp,
            optimizer=optimizer,
            local_optimizer=local_optimizer,
            tensors=tensors,
            no_sync=ddp.no_sync,
            cpp_buffers=buckets.buffers,
        )

    return setup
