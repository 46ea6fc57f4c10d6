"""distoptim inside Hugging Face ``transformers.Trainer`` on 2 CPU ranks started as torchrun starts them (gloo).

The plain Trainer rejects a ``ZeroRedundancyOptimizer`` (Accelerate's ``prepare`` asks every rank for its
``state_dict()``). ``distoptim.integrations.transformers.ZeroTrainer`` trains with one, as ZeRO-1 (greedy, passed
as ``optimizers=(zero, scheduler)``), with the even partition, with the deprecated ``reduce_to_owners=True`` and
under ``ShardedDataParallel`` (built by the Trainer through ``optimizer_cls_and_kwargs``), equal to the plain
Trainer with torch's AdamW under DDP; a checkpoint written mid-run (sharded, or consolidated into ``optimizer.pt``)
resumes in new processes to the uninterrupted run's parameters and optimizer state, bitwise.

The job is ``transformers_job.py``, run twice (train, then resume) with both ranks at once.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration._launch import run_module_on_ranks

# find_spec, not importorskip: importing transformers here would cost this process seconds for nothing
pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("transformers") is None,
        reason="transformers is not installed (pip install -r requirements-dev.txt installs it)",
    ),
    pytest.mark.timeout(600),  # the module's job (two launches) runs in the first test's setup
]

TIMEOUT_S = 240  # per launch; a hung rank (the plain Trainer saving a ZeRO, say) fails the test at this point
WORLD_SIZE = 2
JOB = "tests.integration.transformers_job"
SAVE_STEP = 5  # transformers_job.SAVE_STEP
MODES = {
    "zero": "reference-user",
    "even": "reference-trainer",
    "zero2": "reference-trainer",
    "sdp": "reference-trainer",
}


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Train (with a checkpoint), then resume in new processes; the output directory."""
    out = tmp_path_factory.mktemp("transformers")
    run_module_on_ranks(JOB, [str(out), "full"], WORLD_SIZE, TIMEOUT_S)
    run_module_on_ranks(JOB, [str(out), "resume"], WORLD_SIZE, TIMEOUT_S)
    return out


def _results(job: Path, run: str) -> list[dict[str, Any]]:
    return [torch.load(job / f"{run}-rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]


def _assert_same(actual: Any, expected: Any, where: str) -> None:
    """Equal bitwise (tensors: values and dtype), recursively through dicts and lists."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, where
        assert torch.equal(actual, expected), f"{where}: max difference {(actual - expected).abs().max().item()}"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and sorted(actual) == sorted(expected), f"{where}: keys differ"
        for key in expected:
            _assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: lengths differ"
        for index, (a, e) in enumerate(zip(actual, expected)):
            _assert_same(a, e, f"{where}[{index}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def _errors(job: Path, rank: int) -> list[str]:
    """What the job recorded: the plain Trainer's error with a ZeRO optimizer, then ZeroTrainer's for misuse."""
    return (job / f"errors-rank{rank}.txt").read_text().split("\n")


def test_the_plain_trainer_rejects_a_zero_optimizer(job: Path) -> None:
    """The premise: without the integration a ZeRO optimizer fails in ``prepare``, on every rank alike."""
    for rank in range(WORLD_SIZE):
        error = _errors(job, rank)[0]
        assert "consolidate_state_dict" in error, f"rank {rank}: the plain Trainer did not fail as expected: {error!r}"


def test_settings_zero_trainer_cannot_honour_raise_on_every_rank(job: Path) -> None:
    expected = ["optimizer_checkpoint must be one of", "pass sharded_data_parallel only", "overlap_with_ddp"]
    for rank in range(WORLD_SIZE):
        errors = _errors(job, rank)[1:]
        assert len(errors) == len(expected) and all(e in error for e, error in zip(expected, errors)), errors


@pytest.mark.parametrize("mode", MODES)
def test_resume_from_a_trainer_checkpoint_is_bitwise(job: Path, mode: str) -> None:
    full, resumed = _results(job, f"{mode}-full"), _results(job, f"{mode}-resumed")
    for rank in range(WORLD_SIZE):
        _assert_same(resumed[rank]["parameters"], full[rank]["parameters"], f"{mode} rank {rank} parameters")
    _assert_same(resumed[0]["optimizer"], full[0]["optimizer"], f"{mode} optimizer state")
    assert all(int(state["step"]) == 8 for state in full[0]["optimizer"]["state"].values())
    # the log history: the checkpoint's (steps 1-5), then the same gradient norms measured after the resume
    assert len(full[0]["grad_norms"]) == 8 and resumed[0]["grad_norms"] == full[0]["grad_norms"]
    hook = {"sdp": "ShardedDataParallel"}.get(mode)  # reduce_to_owners=True (deprecated) leaves DDP's default
    assert [r["comm_hook"] for r in full + resumed] == [hook] * 2 * WORLD_SIZE


@pytest.mark.parametrize("mode", MODES)
def test_zero_trainer_trains_as_ddp_with_torch_adamw(job: Path, mode: str) -> None:
    """Parameters and logged (pre-clipping) gradient norms equal the plain Trainer's with AdamW; clipping bit."""
    full, reference = _results(job, f"{mode}-full"), _results(job, MODES[mode])
    for rank in range(WORLD_SIZE):
        for index, (actual, expected) in enumerate(zip(full[rank]["parameters"], reference[rank]["parameters"])):
            # not bitwise: the reduction to owners sums in another order, ZeRO's clipping norm in float32 per shard
            where = f"{mode} rank {rank} parameter {index}"
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=lambda m, w=where: f"{w}: {m}")
    norms, expected_norms = full[0]["grad_norms"], reference[0]["grad_norms"]
    assert len(norms) == 8
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(expected_norms), rtol=1e-5, atol=0)
    assert min(norms) > 0.3, "clipping (max_grad_norm=0.3) did not bite at every step"


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_holds_the_optimizer_state_as_configured(job: Path, mode: str) -> None:
    checkpoint = job / mode / f"checkpoint-{SAVE_STEP}"
    assert (checkpoint / "scheduler.pt").is_file()
    if mode == "even":  # consolidated: rank 0 wrote torch.optim's format, with every parameter's state
        saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
        assert sorted(saved["state"]) == list(range(len(_results(job, "even-full")[0]["parameters"])))
        assert all(int(state["step"]) == SAVE_STEP for state in saved["state"].values())
        assert not (checkpoint / "optimizer_shards").exists()
    else:  # sharded: one file per rank, nothing gathered
        assert len(list((checkpoint / "optimizer_shards").glob("*.distcp"))) == WORLD_SIZE
        assert not (checkpoint / "optimizer.pt").exists()


def test_importing_distoptim_does_not_import_transformers() -> None:
    """Only the integration module imports transformers, and nothing in the package imports that module."""
    src = Path(__file__).resolve().parents[2] / "src" / "distoptim"
    integration = src / "integrations" / "transformers.py"
    importers = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            hits = [n for n in names if n.split(".")[0] == "transformers" or n.endswith("integrations.transformers")]
            if hits and path != integration:
                importers.append(f"{path.relative_to(src)}: {hits}")
    assert not importers, f"modules importing transformers or its integration: {importers}"
