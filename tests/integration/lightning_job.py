"""A Lightning job that tests/integration/test_lightning.py runs as a script, the way users run one.

``python -m tests.integration.lightning_job OUTDIR`` (from the repository root) trains the tiny model of ``_tiny``
with ``Trainer(strategy="ddp", accelerator="cpu", devices=2)``: Lightning re-launches this module for rank 1, unless
a launcher already started both ranks (torchrun's variables set, as the test does).
Two LightningModules: one returns distoptim's ``ZeroRedundancyOptimizer`` (AdamW; greedy or even partition), one its
``PostLocalSGDOptimizer`` (AdamW, ``PeriodicModelAverager``, the post-local-SGD DDP hook), both with a per-step
StepLR. Each trains ``_tiny.EPOCHS`` epochs uninterrupted (a checkpoint at every epoch's end), then again from the
checkpoint written after ``RESUME_AFTER_EPOCH``; every rank writes its final parameters to
OUTDIR/{variant}-{full,resumed}-rank{r}.pt.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from distoptim import PostLocalSGDOptimizer, ZeroRedundancyOptimizer
from distoptim.averagers import PeriodicModelAverager
from distoptim.hooks import PostLocalSGDState, post_localSGD_hook
from tests.integration import _tiny

# resume from the checkpoint written after 6 of the 9 steps (for post-local SGD: between two averagings)
RESUME_AFTER_EPOCH = 1


def _with_scheduler(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=_tiny.STEP_SIZE, gamma=_tiny.GAMMA)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class ZeroModule(L.LightningModule):
    """AdamW sharded by ZeroRedundancyOptimizer. Nothing Lightning-specific is needed: Lightning's checkpointing
    calls ``consolidate_state_dict()`` on every rank of any optimizer that has one, then saves rank 0's
    ``state_dict()``; resuming gives every rank the whole dict and ``load_state_dict`` keeps each rank's shard."""

    def __init__(self, partition: str = "greedy") -> None:
        super().__init__()
        self.net = _tiny.make_model()
        self.partition = partition

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return _tiny.loss_fn(self.net(inputs), targets)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(_tiny.dataset(), batch_size=_tiny.BATCH_SIZE)  # Lightning adds a DistributedSampler

    def configure_optimizers(self) -> dict[str, Any]:
        zero = ZeroRedundancyOptimizer(
            self.parameters(),
            torch.optim.AdamW,
            partition=self.partition,
            lr=_tiny.LR,
            weight_decay=_tiny.WEIGHT_DECAY,
        )
        return _with_scheduler(zero)


class LocalSGDModule(ZeroModule):
    """Post-local SGD. Lightning registers DDP comm hooks on CUDA only, so the hook is registered in
    ``on_fit_start``, when ``trainer.strategy.model`` is the DDP model. Between averagings every rank has its own
    parameters and AdamW state, but Lightning saves rank 0's only: ``on_save_checkpoint`` (run on every rank) adds
    every rank's, with the hook's iteration count. ``on_load_checkpoint`` hands Lightning this rank's optimizer
    state; its parameters are loaded in ``on_fit_start``, because wrapping the model in DDP (after
    ``on_load_checkpoint``) broadcasts rank 0's. A resume therefore needs the same world size."""

    def __init__(self) -> None:
        super().__init__()
        self.hook_state = PostLocalSGDState(
            None, None, start_localSGD_iter=_tiny.WARMUP_STEPS, post_local_gradient_allreduce=False
        )
        self.rank_parameters: dict[str, torch.Tensor] | None = None

    def configure_optimizers(self) -> dict[str, Any]:
        local = torch.optim.AdamW(self.parameters(), lr=_tiny.LR, weight_decay=_tiny.WEIGHT_DECAY)
        averager = PeriodicModelAverager(_tiny.PERIOD, warmup_steps=_tiny.WARMUP_STEPS)
        return _with_scheduler(PostLocalSGDOptimizer(local, averager))

    def on_fit_start(self) -> None:
        if self.rank_parameters is not None:
            self.load_state_dict(self.rank_parameters)
            self.rank_parameters = None
        self.trainer.strategy.model.register_comm_hook(self.hook_state, post_localSGD_hook)  # type: ignore[union-attr]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        mine = {
            "state_dict": checkpoint["state_dict"],
            "optimizer_states": checkpoint["optimizer_states"],
            "hook_iter": self.hook_state.iter,
        }
        every_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every_rank, mine)
        checkpoint["per_rank"] = every_rank

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        every_rank = checkpoint["per_rank"]
        if len(every_rank) != dist.get_world_size():
            raise ValueError(f"checkpoint saved by {len(every_rank)} ranks, resumed on {dist.get_world_size()}")
        mine = every_rank[dist.get_rank()]
        self.rank_parameters = mine["state_dict"]
        checkpoint["optimizer_states"] = mine["optimizer_states"]
        self.hook_state.iter = mine["hook_iter"]


def _fit(module: ZeroModule, out: Path, name: str, checkpoint_dir: Path | None, resume: Path | None) -> None:
    callbacks = [] if checkpoint_dir is None else [ModelCheckpoint(checkpoint_dir, "{epoch}", save_top_k=-1)]
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=_tiny.EPOCHS,
        callbacks=callbacks,
        enable_checkpointing=checkpoint_dir is not None,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    trainer.fit(module, ckpt_path=resume)
    torch.save(_tiny.parameters(module.net), out / f"{name}-rank{trainer.global_rank}.pt")


VARIANTS: dict[str, Callable[[], ZeroModule]] = {
    "zero": ZeroModule,
    "zero-even": lambda: ZeroModule(partition="even"),
    "localsgd": LocalSGDModule,
}


def main(out: Path) -> None:
    for variant, make_module in VARIANTS.items():
        checkpoints = out / f"{variant}-checkpoints"
        _fit(make_module(), out, f"{variant}-full", checkpoints, None)
        resume = checkpoints / f"epoch={RESUME_AFTER_EPOCH}.ckpt"
        _fit(make_module(), out, f"{variant}-resumed", None, resume)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
