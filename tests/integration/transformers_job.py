"""A ``transformers.Trainer`` job that tests/integration/test_transformers.py starts as torchrun would, twice:

``python -m tests.integration.transformers_job OUTDIR full`` (every rank) first records what the plain Trainer
raises given a ``ZeroRedundancyOptimizer`` and what ZeroTrainer raises for settings it rejects, then trains a tiny
GPT-2 (built from a config: nothing is downloaded) for ``STEPS`` optimizer steps with each of ``MODES`` (a
checkpoint after ``SAVE_STEP``) and with the plain Trainer and torch's AdamW under DDP (the references);
``... OUTDIR resume`` resumes each mode from its checkpoint in these new processes. Every run writes
OUTDIR/{run}-rank{r}.pt: the final parameters, the consolidated optimizer state (ZeRO runs), the gradient norms the
Trainer logged and the DDP model's communication hook.

All runs share the data, the arguments (AdamW with weight decay, clipping that bites, gradient accumulation, a
linear schedule unless the user passes one) and no dropout, so that they differ only in the optimizer.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer
from distoptim.integrations.transformers import ZeroTrainer

VOCAB, SEQUENCE, BATCH, ACCUMULATION, EPOCHS = 64, 16, 4, 2, 2
STEPS_PER_EPOCH = 4
SAMPLES = 2 * BATCH * ACCUMULATION * STEPS_PER_EPOCH  # 2 ranks
STEPS = EPOCHS * STEPS_PER_EPOCH
SAVE_STEP = 5  # mid-epoch: the resume skips the epoch's first batches and restores the RNG states
LR, WEIGHT_DECAY, MAX_GRAD_NORM = 3e-3, 0.1, 0.3  # gradient norms are 0.45 to 0.7: clipping bites every step

# mode -> (ZeroRedundancyOptimizer's keyword arguments, ZeroTrainer's); "zero" builds its ZeRO and scheduler itself
MODES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "zero": ({}, {}),  # ZeRO-1, greedy partition, optimizers=(zero, StepLR); sharded checkpoint
    # built by the Trainer (optimizer_cls_and_kwargs) from here on; parameters split across ranks, optimizer.pt
    "even": ({"partition": "even"}, {"optimizer_checkpoint": "consolidated"}),
    # reduce_to_owners=True, deprecated: a FutureWarning, DDP's default all-reduce; parameters as views of flat buffers
    "zero2": ({"parameters_as_bucket_view": True}, {"reduce_to_owners": True}),
    # ShardedDataParallel instead of DDP: 1/N of the gradient per rank, several buckets, the sync overlapped
    "sdp": (
        {"partition": "even", "parameters_as_bucket_view": True},
        {"sharded_data_parallel": {"bucket_cap_mb": 0.05}},
    ),
}


class TokenDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random token sequences, the same in every process; the labels are the inputs (causal LM)."""

    def __init__(self) -> None:
        self.tokens = torch.randint(0, VOCAB, (SAMPLES, SEQUENCE), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def make_model(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQUENCE, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def arguments(out: Path, run: str, save: bool) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(out / run),
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATION,
        num_train_epochs=EPOCHS,
        learning_rate=LR,
        warmup_steps=2,  # the default linear schedule's warm-up: its first step at lr 0, set after ZeRO was built
        weight_decay=WEIGHT_DECAY,
        max_grad_norm=MAX_GRAD_NORM,
        save_strategy="steps" if save else "no",
        save_steps=SAVE_STEP,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        log_level="warning",
    )


def user_optimizer(optimizer_class: type[torch.optim.Optimizer], model: torch.nn.Module) -> tuple[Any, Any]:
    """What a user passes as ``optimizers=``: an optimizer over all parameters, and a scheduler of theirs."""
    if optimizer_class is ZeroRedundancyOptimizer:
        optimizer: Any = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY
        )
    else:
        optimizer = optimizer_class(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


def zero_trainer(mode: str, out: Path, run: str, seed: int, save: bool) -> ZeroTrainer:
    model, (zero_options, trainer_options) = make_model(seed), MODES[mode]
    common = {"model": model, "args": arguments(out, run, save), "train_dataset": TokenDataset()}
    if mode == "zero":
        return ZeroTrainer(**common, optimizers=user_optimizer(ZeroRedundancyOptimizer, model))
    built = (ZeroRedundancyOptimizer, {"optimizer_class": torch.optim.AdamW, "lr": LR, **zero_options})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = ZeroTrainer(**common, optimizer_cls_and_kwargs=built, **trainer_options)
    deprecated = [w for w in caught if issubclass(w.category, FutureWarning) and "reduce_to_owners" in str(w.message)]
    assert len(deprecated) == (mode == "zero2"), [str(w.message) for w in caught]
    return trainer


def record(trainer: Trainer, out: Path, run: str) -> None:
    """Write this rank's final parameters, the logged gradient norms and (ZeRO) the consolidated optimizer state."""
    result: dict[str, Any] = {
        "parameters": [p.detach().clone() for p in trainer.model.parameters()],
        "grad_norms": [float(entry["grad_norm"]) for entry in trainer.state.log_history if "grad_norm" in entry],
        "comm_hook": _comm_hook(trainer.model_wrapped),
    }
    if isinstance(trainer, ZeroTrainer):
        zero = trainer._zero()
        assert zero is not None
        zero.consolidate_state_dict(to=0)
        result["optimizer"] = zero.state_dict() if dist.get_rank() == 0 else None
    torch.save(result, out / f"{run}-rank{dist.get_rank()}.pt")


def _comm_hook(wrapped: Any) -> str | None:
    """The DDP model's comm hook, by name; ``ShardedDataParallel`` for a model it wraps instead of DDP."""
    if isinstance(wrapped, ShardedDataParallel):
        return "ShardedDataParallel"
    hook: str | None = wrapped._get_ddp_logging_data().get("comm_hook")
    return hook


def plain_trainer_error(out: Path) -> str:
    """What the plain Trainer raises (on every rank) given a ZeRO optimizer; empty if it trains."""
    model = make_model(0)
    trainer = Trainer(
        model=model,
        args=arguments(out, "plain-zero", save=False),
        train_dataset=TokenDataset(),
        optimizers=user_optimizer(ZeroRedundancyOptimizer, model),
    )
    try:
        trainer.train()
    except RuntimeError as error:
        return str(error)
    return ""


def misuse_errors(out: Path) -> list[str]:
    """What ZeroTrainer raises for settings it cannot honour (on every rank, before any collective)."""
    common = {"args": arguments(out, "misuse", save=False), "train_dataset": TokenDataset()}
    overlap = {"optimizer_class": torch.optim.AdamW, "lr": LR, "overlap_with_ddp": True}
    attempts = [
        lambda: ZeroTrainer(model=make_model(0), optimizer_checkpoint="sharded-please", **common),
        lambda: ZeroTrainer(model=make_model(0), reduce_to_owners=True, sharded_data_parallel=True, **common),
        lambda: ZeroTrainer(
            model=make_model(0), optimizer_cls_and_kwargs=(ZeroRedundancyOptimizer, overlap), **common
        ).train(),
    ]
    errors = []
    for attempt in attempts:
        try:
            attempt()
            errors.append("")
        except ValueError as error:
            errors.append(str(error))
    return errors


def full(out: Path) -> None:
    errors = [plain_trainer_error(out), *misuse_errors(out)]
    (out / f"errors-rank{dist.get_rank()}.txt").write_text("\n".join(errors))
    model = make_model(0)  # references: DDP + torch's AdamW, built by the user (as "zero") and by the Trainer
    reference = Trainer(
        model=model,
        args=arguments(out, "reference-user", save=False),
        train_dataset=TokenDataset(),
        optimizers=user_optimizer(torch.optim.AdamW, model),
    )
    reference.train()
    record(reference, out, "reference-user")
    reference = Trainer(
        model=make_model(0),
        args=arguments(out, "reference-trainer", save=False),
        train_dataset=TokenDataset(),
        optimizer_cls_and_kwargs=(torch.optim.AdamW, {"lr": LR}),
    )
    reference.train()
    record(reference, out, "reference-trainer")
    for mode in MODES:
        trainer = zero_trainer(mode, out, mode, seed=0, save=True)
        trainer.train()
        record(trainer, out, f"{mode}-full")


def resume(out: Path) -> None:
    for mode in MODES:
        trainer = zero_trainer(mode, out, f"{mode}-resumed", seed=1, save=False)  # the checkpoint's, not seed 1's
        trainer.train(resume_from_checkpoint=str(out / mode / f"checkpoint-{SAVE_STEP}"))
        record(trainer, out, f"{mode}-resumed")


if __name__ == "__main__":
    {"full": full, "resume": resume}[sys.argv[2]](Path(sys.argv[1]))
