"""distoptim inside Hugging Face Accelerate, on 2 CPU ranks (gloo): what works, and the pattern for checkpoints.

- ``accelerator.prepare(model, zero, loader, device_placement=[True, False, True])`` trains and equals a plain AdamW
  on the averaged gradients. With the default device placement ``prepare`` calls the optimizer's ``state_dict()`` on
  every rank (to move its state to the device), which a ``ZeroRedundancyOptimizer`` has only where it was
  consolidated: it raises, as torch's own ``ZeroRedundancyOptimizer`` does.
- ``accelerator.save_state`` calls every prepared optimizer's ``state_dict()`` on every rank (and writes the main
  process's), so it cannot save a prepared ZeRO either (consolidating onto every rank would put the whole state on
  each, which is what ZeRO avoids). The pattern that works: leave the ZeRO out of ``prepare``, let ``save_state`` /
  ``load_state`` carry the model, the scheduler (``register_for_checkpointing``) and the RNG states, and save the
  optimizer next to them with ``torch.distributed.checkpoint`` (``zero.sharded_state_dict()`` /
  ``load_sharded_state_dict``): each rank writes and reads its own shard. The resumed run equals the uninterrupted
  one bitwise.

The ranks come from tests/_dist.run_on_ranks: Accelerate finds the launcher's variables and the initialised group.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from distoptim import ZeroRedundancyOptimizer
from tests._dist import run_on_ranks
from tests.integration import _tiny

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is None,
    reason="accelerate is not installed (pip install -r requirements-dev.txt installs it)",
)

SAVE_AFTER_EPOCH = 1  # of _tiny.EPOCHS, 3 steps each


def _zero(model: torch.nn.Module) -> tuple[ZeroRedundancyOptimizer, Any]:
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=_tiny.LR, weight_decay=_tiny.WEIGHT_DECAY)
    return zero, torch.optim.lr_scheduler.StepLR(zero, _tiny.STEP_SIZE, _tiny.GAMMA)


def _train_epochs(accelerator: Any, model: Any, zero: Any, scheduler: Any, loader: Any, epochs: range) -> None:
    for _ in epochs:
        for inputs, targets in loader:
            zero.zero_grad()
            accelerator.backward(_tiny.loss_fn(model(inputs), targets))
            zero.step()
            scheduler.step()


def _reference(world_size: int) -> list[Tensor]:
    """AdamW + StepLR on the gradient averaged over the ranks' batches: Accelerate gives rank r batches r,
    r + world_size, ... of the loader's (no shuffling), so step i averages batches i * world_size + r."""
    model = _tiny.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=_tiny.LR, weight_decay=_tiny.WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, _tiny.STEP_SIZE, _tiny.GAMMA)
    batches = list(DataLoader(_tiny.dataset(), batch_size=_tiny.BATCH_SIZE))
    for _ in range(_tiny.EPOCHS):
        for first in range(0, len(batches), world_size):
            optimizer.zero_grad()
            losses = [_tiny.loss_fn(model(inputs), targets) for inputs, targets in batches[first : first + world_size]]
            torch.stack(losses).mean().backward()
            optimizer.step()
            scheduler.step()
    return _tiny.parameters(model)


def _prepare_raises_like_torchs_zero(accelerator_class: Any) -> None:
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    for zero_class in (ZeroRedundancyOptimizer, TorchZero):
        model = _tiny.make_model()
        zero = zero_class(model.parameters(), torch.optim.AdamW, lr=_tiny.LR)
        with pytest.raises(RuntimeError, match="consolidate_state_dict"):
            accelerator_class(cpu=True).prepare(model, zero)


def _accelerate_body(rank: int, world_size: int, workdir: str) -> None:
    import torch.distributed.checkpoint as dcp
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    _prepare_raises_like_torchs_zero(Accelerator)
    expected = _reference(world_size)

    # 1. the ZeRO prepared with the model and the loader (no device placement for it): trains as the reference
    accelerator = Accelerator(cpu=True)
    assert accelerator.distributed_type == DistributedType.MULTI_CPU and accelerator.num_processes == world_size
    model = _tiny.make_model()
    zero, scheduler = _zero(model)
    loader = DataLoader(_tiny.dataset(), batch_size=_tiny.BATCH_SIZE)
    model, prepared_zero, loader = accelerator.prepare(model, zero, loader, device_placement=[True, False, True])
    _train_epochs(accelerator, model, prepared_zero, scheduler, loader, range(_tiny.EPOCHS))
    _assert_close(_tiny.parameters(model), expected, "prepared ZeRO vs reference", 1e-5)
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        accelerator.save_state(f"{workdir}/prepared")  # every rank asks the ZeRO for its state_dict()

    # 2. the checkpoint pattern: save_state for what Accelerate handles, DCP for the ZeRO's shards
    finals = []
    for resume in (False, True):
        accelerator = Accelerator(cpu=True)
        model = _tiny.make_model(seed=1 if resume else 0)  # a resume must not depend on the initialisation
        zero, scheduler = _zero(model)
        loader = DataLoader(_tiny.dataset(), batch_size=_tiny.BATCH_SIZE)
        model, loader = accelerator.prepare(model, loader)
        accelerator.register_for_checkpointing(scheduler)
        checkpoint = f"{workdir}/checkpoint"
        first_epoch = 0
        if resume:
            accelerator.load_state(checkpoint)
            state = {"optim": zero.sharded_state_dict()}
            dcp.load(state, checkpoint_id=f"{checkpoint}/zero")
            zero.load_sharded_state_dict(state["optim"])
            first_epoch = SAVE_AFTER_EPOCH + 1
        for epoch in range(first_epoch, _tiny.EPOCHS):
            _train_epochs(accelerator, model, zero, scheduler, loader, range(epoch, epoch + 1))
            if not resume and epoch == SAVE_AFTER_EPOCH:
                accelerator.save_state(checkpoint)
                dcp.save({"optim": zero.sharded_state_dict()}, checkpoint_id=f"{checkpoint}/zero")
        finals.append(_tiny.parameters(model))
    _assert_close(finals[0], expected, "uninterrupted vs reference", 1e-5)
    _assert_close(finals[1], finals[0], "resumed vs uninterrupted", 0.0)
    assert len(list(Path(checkpoint, "zero").glob("*.distcp"))) == world_size, "a shard file per rank"


def _assert_close(actual: list[Tensor], expected: list[Tensor], what: str, tolerance: float) -> None:
    assert len(actual) == len(expected), what
    for index, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(
            a, e, rtol=tolerance, atol=tolerance, msg=lambda m, i=index: f"{what}, parameter {i}: {m}"
        )


def test_accelerate_trains_a_prepared_zero_and_resumes_through_save_state_and_dcp(tmp_path: Path) -> None:
    run_on_ranks(_accelerate_body, 2, str(tmp_path), timeout=180)
