"""``ZeroTrainer``: Hugging Face's ``transformers.Trainer`` driving a ``ZeroRedundancyOptimizer``, its state saved
and loaded on every rank (``docs/guides/transformers.md``). This module imports ``transformers``."""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import torch
from torch import nn

try:
    from transformers import Trainer
    from transformers.trainer import SCHEDULER_NAME
except ImportError as error:  # pragma: no cover - exercised only where transformers is missing
    raise ImportError(
        "distoptim.integrations.transformers needs Hugging Face transformers: pip install transformers"
    ) from error

from distoptim import checkpoint
from distoptim.comm import agreement
from distoptim.sharded_data_parallel.wrapper import ShardedDataParallel
from distoptim.zero.optimizer import ZeroRedundancyOptimizer

__all__ = ["SHARDS_DIR", "ZeroTrainer"]

SHARDS_DIR = "optimizer_shards"
"""The sharded optimizer state's directory in a Trainer checkpoint (its name contains "optimizer", so a plain
Trainer resuming from it fails loudly)."""

CHECKPOINT_FORMATS = ("sharded", "consolidated")
REDUCE_TO_OWNERS_DEPRECATED = (
    "ZeroTrainer(reduce_to_owners=True) is deprecated and keeps DDP's default all-reduce: use "
    "ZeroTrainer(sharded_data_parallel=True) (distoptim.ShardedDataParallel) for ZeRO-2"
)


class ZeroTrainer(Trainer):
    """``transformers.Trainer`` that can step, checkpoint and resume a ``ZeroRedundancyOptimizer``; pass the optimizer
    as for any Trainer and launch every rank (``docs/guides/transformers.md`` has an example).

    Args:
        reduce_to_owners: deprecated (a ``FutureWarning``; DDP's default all-reduce is kept). Default False.
        sharded_data_parallel: wrap the model in ``distoptim.ShardedDataParallel`` (``True``, or a dict of its
            keyword arguments) instead of Accelerate's DDP; default False. bf16/fp16 and torch_compile are refused.
        optimizer_checkpoint: ``"sharded"`` (default): every rank writes its shard into ``optimizer_shards/``;
            ``"consolidated"``: rank 0 writes ``optimizer.pt`` in ``torch.optim``'s format. A resume loads either.
        *args, **kwargs: ``transformers.Trainer``'s.
    """

    def __init__(
        self,
        *args: Any,
        reduce_to_owners: bool = False,
        optimizer_checkpoint: str = "sharded",
        sharded_data_parallel: bool | dict[str, Any] = False,
        **kwargs: Any,
    ) -> None:
        if optimizer_checkpoint not in CHECKPOINT_FORMATS:
            raise ValueError(f"optimizer_checkpoint must be one of {CHECKPOINT_FORMATS}, got {optimizer_checkpoint!r}")
        if sharded_data_parallel and reduce_to_owners:
            raise ValueError(
                "reduce_to_owners=True (deprecated) keeps DDP, sharded_data_parallel replaces it: pass "
                "sharded_data_parallel only"
            )
        if reduce_to_owners:
            warnings.warn(REDUCE_TO_OWNERS_DEPRECATED, FutureWarning, stacklevel=2)
        super().__init__(*args, **kwargs)
        if sharded_data_parallel and (self.args.bf16 or self.args.fp16 or self.args.torch_compile):
            raise ValueError(
                "sharded_data_parallel bypasses Accelerate's model preparation, which is what applies bf16/fp16 "
                "autocast and torch_compile: cast the model to bf16 yourself (with master_dtype=torch.float32 on the "
                "ZeroRedundancyOptimizer), or leave sharded_data_parallel off"
            )
        self.sharded_data_parallel = {} if sharded_data_parallel is True else sharded_data_parallel or None
        self._sharded: ShardedDataParallel | None = None
        if optimizer_checkpoint == "consolidated" and self.args.save_on_each_node:
            raise ValueError(
                "optimizer_checkpoint='consolidated' gathers the optimizer state onto rank 0 only, so it cannot be "
                "saved on each node (save_on_each_node=True): use optimizer_checkpoint='sharded' on a file system "
                "every node sees, or save_on_each_node=False"
            )
        self.reduce_to_owners = reduce_to_owners
        self.optimizer_checkpoint = optimizer_checkpoint

    def _zero(self) -> ZeroRedundancyOptimizer | None:
        """The ZeroRedundancyOptimizer this Trainer steps (inside Accelerate's wrapper once prepared), or None."""
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        return optimizer if isinstance(optimizer, ZeroRedundancyOptimizer) else None

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer; a ZeRO one prepared here without device placement (it calls ``state_dict()``)."""
        optimizer = super().create_optimizer(model)
        zero = self._zero()
        if zero is None:
            return optimizer
        if zero.overlap_stepper is not None:
            raise ValueError(
                "a ZeroRedundancyOptimizer(overlap_with_ddp=True) steps inside DDP's backward, before the Trainer "
                "clips the gradient and calls step(): build it with overlap_with_ddp=False (sharded_data_parallel=True "
                "for ZeRO-2)"
            )
        if optimizer is zero:
            optimizer = self.optimizer = self.accelerator.prepare(zero, device_placement=[False])
        return optimizer

    def _clip_grad_norm(self, model: nn.Module) -> Any:
        """Clip to ``args.max_grad_norm`` from each rank's owned gradient (one scalar all-reduce)."""
        zero = self._zero()
        if zero is None:
            return super()._clip_grad_norm(model)  # type: ignore[no-untyped-call]
        self.accelerator.unscale_gradients()
        return zero.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        """The gradient norm the Trainer logs, measured as ``_clip_grad_norm`` does when it did not run."""
        zero = self._zero()
        if zero is None or grad_norm is not None:
            return super()._get_grad_norm(model, grad_norm)  # type: ignore[no-untyped-call]
        self.accelerator.unscale_gradients()
        return zero.clip_grad_norm_(math.inf)

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        """With ``sharded_data_parallel``, training wraps the model in ``ShardedDataParallel`` (once)."""
        if self.sharded_data_parallel is None or not training:
            wrapped: nn.Module = super()._wrap_model(model, training, dataloader)
            return wrapped
        if self._sharded is None:
            zero = self._zero()
            if zero is None:
                raise ValueError(
                    "ZeroTrainer(sharded_data_parallel=...) needs a distoptim ZeroRedundancyOptimizer (optimizers=... "
                    f"or optimizer_cls_and_kwargs=...), got {type(self.optimizer).__name__}"
                )
            assert isinstance(self.model, nn.Module)
            self._sharded = ShardedDataParallel(self.model, zero, **self.sharded_data_parallel)
        return self._sharded

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train``, returning with the last step's parameter sync landed."""
        result = super().train(*args, **kwargs)
        if self._sharded is not None:
            self._sharded.sync_finished()
        return result

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's, once the parameter sync that ``ShardedDataParallel`` overlaps with the next forward landed."""
        if self._sharded is not None:
            self._sharded._land_sync()
        return super().evaluation_loop(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The Trainer's, once the parameter sync that ``ShardedDataParallel`` overlaps with the next forward landed."""
        if self._sharded is not None:
            self._sharded._land_sync()
        super().save_model(output_dir, _internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Every rank saves its shard (or sends it to rank 0, which writes ``optimizer.pt``); rank 0 the scheduler."""
        zero = self._zero()
        if zero is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        if self.optimizer_checkpoint == "consolidated":
            zero.consolidate_state_dict(to=0)  # the Trainer then writes rank 0's state_dict()
            return super()._save_optimizer_and_scheduler(output_dir)
        shards = os.path.join(output_dir, SHARDS_DIR)
        checkpoint.save({"optim": zero.sharded_state_dict()}, shards, process_group=zero.process_group)
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        return None

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        """Load the shards every rank saved, or ``optimizer.pt`` on every rank (each keeps its shard); the scheduler."""
        zero = self._zero()
        if zero is None or checkpoint_dir is None:
            return super()._load_optimizer_and_scheduler(checkpoint_dir)
        shards = os.path.join(checkpoint_dir, SHARDS_DIR)
        has_shards = agreement.run_agreed(  # every rank loads the shards, or none: they load them together
            lambda: os.path.isdir(shards),
            zero.process_group,
            f"looking for the optimizer shards in {shards}",
            then_agree_on=lambda found: {"whether the directory exists: {}": found},
            fix="resume from a checkpoint directory that every rank sees",
        )
        if not has_shards:
            return super()._load_optimizer_and_scheduler(checkpoint_dir)
        state = {"optim": zero.sharded_state_dict()}
        checkpoint.load(state, shards, process_group=zero.process_group)
        zero.load_sharded_state_dict(state["optim"])
        scheduler = os.path.join(checkpoint_dir, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
        return None
