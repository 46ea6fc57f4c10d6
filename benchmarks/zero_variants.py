"""The variants the ZeRO benchmark runs: one table entry each, so that adding one is adding a row.

The DDP-wrapped variants (``family="ddp"``, the default set) get the same DDP-wrapped GPT-shaped model; their
builder returns the optimizer the timed loop steps, and the loop is forward, ``loss.backward()`` (DDP reduces the
gradients during it) and ``optimizer.step()``. A variant whose gradients are reduced by something other than DDP's
built-in C++ all-reduce (a comm hook, which calls the Python collectives and is therefore counted directly) sets
``ddp_cpp_allreduce=False``; one whose optimizer is stepped inside the backward by such a hook
(``overlap_with_ddp=True``) sets ``steps_in_backward=True`` and the loop does not call ``step()`` (the timed
backward then holds reduction, step and sync). One that trains a low-precision model (``dtype``: bf16 with fp32
master weights) gets the model cast before DDP wraps it. The peers (FSDP2, DeepSpeed) and distoptim's
``ShardedDataParallel`` wrap the model themselves: ``peer_variants.py``. Muon + AdamW, as each library runs it
(``bench_muon.py``'s rows): ``muon_variants.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from harness import Builder, Variant, ddp_setup
from muon_variants import MUON_VARIANTS
from peer_variants import PEER_VARIANTS
from torch import Tensor
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
from torch.nn.parallel import DistributedDataParallel
from torch.optim import AdamW, Optimizer

from distoptim import ZeroRedundancyOptimizer
from distoptim.hooks import allreduce_hook, hook_with_zero_step, hook_with_zero_step_interleaved, reduce_to_owners_hook

__all__ = ["CORE", "MUON", "PEERS", "VARIANTS", "Variant"]


def _adamw(ddp: DistributedDataParallel, params: Iterable[Tensor], kwargs: dict[str, Any]) -> Optimizer:
    return AdamW(params, **kwargs)


def _torch_zero(bucket_view: bool) -> Builder:
    def build(ddp: DistributedDataParallel, params: Iterable[Tensor], kwargs: dict[str, Any]) -> Optimizer:
        return TorchZeRO(params, optimizer_class=AdamW, parameters_as_bucket_view=bucket_view, **kwargs)

    return build


def _our_zero(bucket_view: bool, partition: str = "greedy", master_dtype: torch.dtype | None = None) -> Builder:
    def build(ddp: DistributedDataParallel, params: Iterable[Tensor], kwargs: dict[str, Any]) -> Optimizer:
        return ZeroRedundancyOptimizer(
            params,
            optimizer_class=AdamW,
            parameters_as_bucket_view=bucket_view,
            partition=partition,
            master_dtype=master_dtype,
            **kwargs,
        )

    return build


def _our_zero2(partition: str, stepping: Any = None) -> Builder:
    """Gradients reduced to their owners (ZeRO-2), bucket views; stepped after the backward or by ``stepping``."""

    def build(ddp: DistributedDataParallel, params: Iterable[Tensor], kwargs: dict[str, Any]) -> Optimizer:
        zero = ZeroRedundancyOptimizer(
            params,
            optimizer_class=AdamW,
            parameters_as_bucket_view=True,
            overlap_with_ddp=stepping is not None,
            partition=partition,
            **kwargs,
        )
        hook = (
            reduce_to_owners_hook
            if stepping is None
            else stepping(reduce_to_owners_hook, ddp, zero, step_from_first_backward=True)
        )
        ddp.register_comm_hook(zero, hook)
        return zero

    return build


def _our_overlap(interleaved: bool) -> Builder:
    hook = hook_with_zero_step_interleaved if interleaved else hook_with_zero_step

    def build(ddp: DistributedDataParallel, params: Iterable[Tensor], kwargs: dict[str, Any]) -> Optimizer:
        zero = ZeroRedundancyOptimizer(params, optimizer_class=AdamW, overlap_with_ddp=True, **kwargs)
        ddp.register_comm_hook(None, hook(allreduce_hook, ddp, zero, step_from_first_backward=True))
        return zero

    return build


def _ddp(name: str, impl: str, setting: str, build: Builder, local: Any = lambda o: o, **options: Any) -> Variant:
    return Variant(name, impl, setting, ddp_setup(build, local), **options)


CORE: dict[str, Variant] = {
    variant.name: variant
    for variant in [
        _ddp("ddp-adamw", "baseline", "unsharded", _adamw),
        _ddp("torch-zero", "torch", "bucket_view=False", _torch_zero(False), local=lambda z: z.optim),
        _ddp("torch-zero-bucket", "torch", "bucket_view=True", _torch_zero(True), local=lambda z: z.optim),
        _ddp("distoptim-zero", "distoptim", "bucket_view=False", _our_zero(False), local=lambda z: z.local_optimizer),
        _ddp(
            "distoptim-zero-bucket", "distoptim", "bucket_view=True", _our_zero(True), local=lambda z: z.local_optimizer
        ),
        # Overlap: the step runs inside DDP's backward. Torch's overlap refuses gloo, so these are unpaired.
        _ddp(
            "distoptim-overlap",
            "overlap",
            "hook_with_zero_step",
            _our_overlap(False),
            local=lambda z: z.local_optimizer,
            ddp_cpp_allreduce=False,
            steps_in_backward=True,
        ),
        _ddp(
            "distoptim-overlap-interleaved",
            "overlap",
            "hook_with_zero_step_interleaved",
            _our_overlap(True),
            local=lambda z: z.local_optimizer,
            ddp_cpp_allreduce=False,
            steps_in_backward=True,
        ),
        # The even partition, and ZeRO-2: gradients reduced to their owners inside the backward (reduce_to_owners_hook).
        _ddp(
            "distoptim-even-bucket",
            "even",
            "even, bucket_view=True",
            _our_zero(True, "even"),
            local=lambda z: z.local_optimizer,
        ),
        _ddp(
            "zero2-greedy-bucket",
            "zero2",
            "greedy, to owners",
            _our_zero2("greedy"),
            local=lambda z: z.local_optimizer,
            ddp_cpp_allreduce=False,
        ),
        _ddp(
            "zero2-even-bucket",
            "zero2",
            "even, to owners",
            _our_zero2("even"),
            local=lambda z: z.local_optimizer,
            ddp_cpp_allreduce=False,
        ),
        _ddp(
            "zero2-even-interleaved",
            "zero2",
            "even, to owners, interleaved",
            _our_zero2("even", hook_with_zero_step_interleaved),
            local=lambda z: z.local_optimizer,
            ddp_cpp_allreduce=False,
            steps_in_backward=True,
        ),
        # Master weights: a bf16 model (half the parameter, gradient and sync bytes), AdamW on fp32 copies of the
        # owned fragments. Its backward runs in bf16, so its time is not the fp32 variants' compute.
        _ddp(
            "distoptim-master-bf16",
            "master",
            "even, bucket_view=True, bf16 + fp32 master",
            _our_zero(True, "even", torch.float32),
            local=lambda z: z.local_optimizer,
            dtype=torch.bfloat16,
        ),
    ]
}
PEERS: dict[str, Variant] = {variant.name: variant for variant in PEER_VARIANTS}
MUON: dict[str, Variant] = {variant.name: variant for variant in MUON_VARIANTS}  # bench_muon.py's rows
VARIANTS: dict[str, Variant] = CORE | PEERS | MUON
