"""The peers beside the DDP-wrapped variants: FSDP2, DeepSpeed's ZeRO engine, and distoptim's ShardedDataParallel.

Each wraps the same freshly built GPT-shaped model itself (no DDP) and steps ``torch.optim.AdamW``:

- ``fsdp2-zero2`` / ``fsdp2-zero3``: ``torch.distributed.fsdp.fully_shard`` on every transformer block and on the
  root, ``reshard_after_forward=False`` (parameters gathered once per iteration: ZeRO-2's memory) or ``True``
  (gathered again for the backward: ZeRO-3), AdamW over the DTensor shards.
- ``deepspeed-zero1`` / ``deepspeed-zero2``: ``deepspeed.initialize`` with ``zero_optimization`` stage 1 or 2,
  fp32 (no fp16/bf16 section), torch's AdamW as the client optimizer, DeepSpeed's defaults otherwise. On the CPU
  (``DS_ACCELERATOR=cpu``) DeepSpeed would JIT-compile a shared-memory all-reduce op when its communication backend
  starts; it serves only inference all-reduces, so it is switched off and nothing is compiled: training runs on
  gloo like every other variant. Absent when deepspeed is not installed (``pip install -e '.[peers]'``).
- ``sdp`` / ``sdp-overlap``: ``distoptim.ShardedDataParallel(model, zero, overlap_param_sync=...)`` with
  ``zero = ZeroRedundancyOptimizer(params, AdamW, partition="even", parameters_as_bucket_view=True)``; absent
  ("not available") until ``distoptim.ShardedDataParallel`` exists.

FSDP2 and DeepSpeed are built for GPUs (NCCL, CUDA streams, fused kernels); here they run on CPU and gloo, and the
report says so next to their figures. Their collectives are not all routed through the byte counter's functions
(DeepSpeed keeps references to torch's; FSDP2 calls some through internal paths), so no bytes are reported for them.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

from harness import Harness, Variant, optimizer_state_tensors
from torch import Tensor, nn
from torch.optim import AdamW

__all__ = ["PEER_VARIANTS"]


def _fsdp2(reshard_after_forward: bool) -> Any:
    def setup(model: nn.Module, kwargs: dict[str, Any]) -> Harness:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:  # type: ignore[union-attr]  # the GPT's transformer blocks
            fully_shard(block, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        params = list(model.parameters())  # DTensors: this rank's shard of each parameter
        optimizer = AdamW(params, **kwargs)

        def tensors() -> dict[str, list[Tensor]]:
            return {
                "params": params,
                "grads": [p.grad for p in params if p.grad is not None],
                "state": optimizer_state_tensors(optimizer),
            }

        return Harness(model=model, optimizer=optimizer, local_optimizer=optimizer, tensors=tensors)

    return setup


def _deepspeed_missing() -> str | None:
    return None if importlib.util.find_spec("deepspeed") is not None else "not installed: deepspeed"


def _deepspeed_prepare() -> None:
    """Import deepspeed for the CPU, quietly, with no op to compile (before memory is measured)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops

    # Read by its communication backend to decide whether to build the shared-memory all-reduce op; setting it
    # also skips probing every op (which runs compiler subprocesses).
    deepspeed.ops.__compatible_ops__ = {}
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.utils.logger.setLevel(logging.WARNING)


def deepspeed_harness(engine: Any, zero: Any) -> Harness:
    """A DeepSpeed engine and its ZeRO optimizer as a Harness: the tensors its memory census counts, by kind."""
    params = list(engine.module.parameters())

    def tensors() -> dict[str, Any]:
        fp32 = list(zero.single_partition_of_fp32_groups)  # its master copy of the owned partition
        return {
            "params": [params, zero.bit16_groups_flat],  # the parameters are views into the flat groups
            "grads": [
                [p.grad for p in params],
                getattr(zero, "averaged_gradients", {}),
                getattr(zero, "grads_in_partition", None),
                [t.grad for t in fp32],
            ],
            "state": optimizer_state_tensors(zero.optimizer),
            "master": fp32,
        }

    return Harness(
        model=engine, optimizer=engine, local_optimizer=zero.optimizer, tensors=tensors, backward=engine.backward
    )


def _deepspeed(stage: int) -> Any:
    def setup(model: nn.Module, kwargs: dict[str, Any]) -> Harness:
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": 1,  # unused: the loop feeds the batch itself
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage},
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        client = AdamW(model.parameters(), **kwargs)
        engine, zero, *_ = deepspeed.initialize(model=model, optimizer=client, config=config, dist_init_required=False)
        return deepspeed_harness(engine, zero)

    return setup


def _sdp_missing() -> str | None:
    import distoptim

    return None if hasattr(distoptim, "ShardedDataParallel") else "not available: distoptim.ShardedDataParallel"


def _sdp(overlap_param_sync: bool) -> Any:
    def setup(model: nn.Module, kwargs: dict[str, Any]) -> Harness:
        import distoptim

        params = list(model.parameters())
        zero = distoptim.ZeroRedundancyOptimizer(
            params, AdamW, partition="even", parameters_as_bucket_view=True, **kwargs
        )
        sdp = distoptim.ShardedDataParallel(model, zero, overlap_param_sync=overlap_param_sync)  # type: ignore[attr-defined]

        def tensors() -> dict[str, list[Tensor]]:
            local = [t for group in zero.local_optimizer.param_groups for t in group["params"]]
            return {
                "params": params,
                "grads": [t.grad for t in params + local if t.grad is not None],  # owned gradients, where kept
                "state": optimizer_state_tensors(zero.local_optimizer),
            }

        return Harness(model=sdp, optimizer=zero, local_optimizer=zero.local_optimizer, tensors=tensors)

    return setup


PEER_VARIANTS = [
    Variant(
        "sdp",
        "sdp",
        "ShardedDataParallel, even, bucket_view=True",
        _sdp(False),
        ddp_cpp_allreduce=False,
        family="sdp",
        missing=_sdp_missing,
    ),
    Variant(
        "sdp-overlap",
        "sdp",
        "ShardedDataParallel, overlap_param_sync=True",
        _sdp(True),
        ddp_cpp_allreduce=False,
        family="sdp",
        missing=_sdp_missing,
    ),
    Variant(
        "fsdp2-zero2",
        "fsdp2",
        "fully_shard, reshard_after_forward=False",
        _fsdp2(False),
        ddp_cpp_allreduce=False,
        family="peer",
        counts_bytes=False,
    ),
    Variant(
        "fsdp2-zero3",
        "fsdp2",
        "fully_shard, reshard_after_forward=True",
        _fsdp2(True),
        ddp_cpp_allreduce=False,
        family="peer",
        counts_bytes=False,
    ),
    Variant(
        "deepspeed-zero1",
        "deepspeed",
        "zero_optimization stage 1, fp32",
        _deepspeed(1),
        ddp_cpp_allreduce=False,
        family="peer",
        counts_bytes=False,
        missing=_deepspeed_missing,
        prepare=_deepspeed_prepare,
    ),
    Variant(
        "deepspeed-zero2",
        "deepspeed",
        "zero_optimization stage 2, fp32",
        _deepspeed(2),
        ddp_cpp_allreduce=False,
        family="peer",
        counts_bytes=False,
        missing=_deepspeed_missing,
        prepare=_deepspeed_prepare,
    ),
]
