"""distoptim inside PyTorch Lightning: ``Trainer(strategy="ddp", accelerator="cpu", devices=2)`` trains a
LightningModule whose ``configure_optimizers`` returns ``ZeroRedundancyOptimizer`` (AdamW + StepLR) or
``PostLocalSGDOptimizer``; a Lightning checkpoint written mid-run resumes to the uninterrupted run's parameters,
bitwise, and both runs equal a plain-torch reference computed here.

The job is a script (``lightning_job.py``), started here as torchrun would start it: both ranks at once, with the
launcher's environment variables, which Lightning's "ddp" strategy joins instead of re-launching the script for
rank 1 itself (run alone, ``python -m tests.integration.lightning_job OUTDIR`` does that). Both ranks importing
Lightning at once rather than one after the other saves several seconds on 2 cores.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import Tensor

from tests.integration import _tiny
from tests.integration._launch import run_module_on_ranks

# find_spec, not importorskip: importing lightning here would cost this process seconds for nothing
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None,
    reason="lightning is not installed (pip install -r requirements-dev.txt installs it)",
)

TIMEOUT_S = 240
WORLD_SIZE = 2


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run lightning_job.py once for the whole module; its output directory."""
    out = tmp_path_factory.mktemp("lightning")
    run_module_on_ranks("tests.integration.lightning_job", [str(out)], WORLD_SIZE, TIMEOUT_S)
    return out


def _final(job: Path, variant: str, run: str) -> list[list[Tensor]]:
    return [torch.load(job / f"{variant}-{run}-rank{rank}.pt") for rank in range(WORLD_SIZE)]


def _reference(local_sgd: bool) -> list[list[Tensor]]:
    """Each rank's final parameters, computed in one process: a model and AdamW + StepLR per rank, gradients
    averaged over the ranks (all steps, or during the warm-up only), parameters averaged on the averager's
    schedule when ``local_sgd``."""
    models = [_tiny.make_model() for _ in range(WORLD_SIZE)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=_tiny.LR, weight_decay=_tiny.WEIGHT_DECAY) for m in models]
    schedulers = [torch.optim.lr_scheduler.StepLR(o, _tiny.STEP_SIZE, _tiny.GAMMA) for o in optimizers]
    for step, batches in enumerate(_tiny.rank_batches(WORLD_SIZE, _tiny.EPOCHS)):
        for model, (inputs, targets) in zip(models, batches):
            model.zero_grad()
            _tiny.loss_fn(model(inputs), targets).backward()
        if not local_sgd or step < _tiny.WARMUP_STEPS:
            for params in zip(*(m.parameters() for m in models)):
                mean = torch.stack([p.grad for p in params]).mean(0)
                for param in params:
                    param.grad = mean.clone()
        for optimizer, scheduler in zip(optimizers, schedulers):
            optimizer.step()
            scheduler.step()
        if local_sgd and step >= _tiny.WARMUP_STEPS and (step - _tiny.WARMUP_STEPS) % _tiny.PERIOD == 0:
            with torch.no_grad():
                for params in zip(*(m.parameters() for m in models)):
                    mean = torch.stack(params).mean(0)
                    for param in params:
                        param.copy_(mean)
    return [_tiny.parameters(m) for m in models]


def _assert_equal(actual: list[Tensor], expected: list[Tensor], what: str, tolerance: float = 0.0) -> None:
    assert len(actual) == len(expected), what
    for index, (a, e) in enumerate(zip(actual, expected)):
        torch.testing.assert_close(
            a, e, rtol=tolerance, atol=tolerance, msg=lambda m, i=index: f"{what}, parameter {i}: {m}"
        )


VARIANTS = ["zero", "zero-even", "localsgd"]  # even: split parameters, stepped through step(closure)


@pytest.mark.parametrize("variant", VARIANTS)
def test_resume_from_a_lightning_checkpoint_is_bitwise(job: Path, variant: str) -> None:
    full, resumed = _final(job, variant, "full"), _final(job, variant, "resumed")
    for rank in range(WORLD_SIZE):
        _assert_equal(resumed[rank], full[rank], f"{variant} rank {rank}: resumed vs uninterrupted")


@pytest.mark.parametrize("variant", VARIANTS)
def test_lightning_training_matches_a_plain_torch_reference(job: Path, variant: str) -> None:
    expected = _reference(local_sgd=variant == "localsgd")
    full = _final(job, variant, "full")
    for rank in range(WORLD_SIZE):
        # not bitwise: DDP's all-reduce averages in another order than torch.stack(...).mean
        _assert_equal(full[rank], expected[rank], f"{variant} rank {rank}: Lightning vs reference", 1e-5)
    if variant == "localsgd":  # the hook really stopped the gradient all-reduce: local steps left ranks apart
        assert not torch.allclose(full[0][0], full[1][0], atol=1e-4), "post-local SGD: the ranks did not diverge"
        data_parallel = _reference(local_sgd=False)[0]
        assert not torch.allclose(full[0][0], data_parallel[0], atol=1e-4), "post-local SGD trained as plain DDP"


@pytest.mark.parametrize("variant", ["zero", "zero-even"])
def test_lightning_checkpoint_holds_the_consolidated_zero_state(job: Path, variant: str) -> None:
    """Lightning consolidated the shards: rank 0's checkpoint has AdamW state for every parameter, not its shard."""
    checkpoint = torch.load(job / f"{variant}-checkpoints" / "epoch=1.ckpt", weights_only=False)
    optimizer_state = checkpoint["optimizer_states"][0]
    count = len(_tiny.parameters(_tiny.make_model()))
    assert sorted(optimizer_state["state"]) == list(range(count))
    assert [group["params"] for group in optimizer_state["param_groups"]] == [list(range(count))]
    assert all(int(state["step"]) == 6 for state in optimizer_state["state"].values())
