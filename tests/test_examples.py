"""The scripts in examples/ run as a user runs them (a subprocess, small sizes) and train what they claim: every
rank ends with the same parameters, equal (to rounding) to a single-process reference of the same training that
this test computes with torch.optim on the example's own model and data."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from tests._examples import (
    assert_checksum,
    check_zero_torchrun,
    common_checksum,
    example_module,
    field,
    rank_lines,
    run_example,
    train_on_mean_gradient,
)

STEPS = 3


def test_zero_torchrun_as_a_single_rank(tmp_path: Path) -> None:
    """Started without torchrun the script is one rank (test_torchrun.py runs it on two nodes)."""
    checkpoint = tmp_path / "checkpoint"
    output = run_example("zero_torchrun.py", "--steps", str(STEPS), "--checkpoint-dir", str(checkpoint))
    check_zero_torchrun(output, checkpoint, world_size=1, steps=STEPS)


def test_zero2_even_partition_and_clipping() -> None:
    """5 steps: the gradient norm passes 1.0 (clipping starts) at step 2; the last step's norm and the parameters
    equal torch's clip_grad_norm_ on the averaged gradient, and are far from the same training unclipped."""
    example = example_module("zero2_even_clipping")
    steps = 5
    lines = rank_lines(run_example("zero2_even_clipping.py", "--world-size", "2", "--steps", str(steps)), 2)
    printed = common_checksum(lines)
    owned = [int(field(lines[rank], "owns")) for rank in range(2)]
    total = sum(p.numel() for p in example.make_model().parameters())
    assert sum(owned) == total and max(owned) - min(owned) <= 1, owned  # even shards

    def reference(clip: float) -> tuple[nn.Module, float]:
        model = example.make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        batches = lambda step: [example.batch(rank, step) for rank in range(2)]
        train_on_mean_gradient(model, optimizer, batches, range(steps - 1), clip)
        norm = train_on_mean_gradient(model, optimizer, batches, [steps - 1], clip)
        return model, norm

    clipped, norm = reference(clip=1.0)
    assert norm > 1.0, "clipping is not active: the test would not see it"
    assert all(math.isclose(float(field(line, "norm")), norm, rel_tol=1e-5) for line in lines.values()), (lines, norm)
    assert_checksum(printed, clipped, "ZeRO-2 with clipping")
    unclipped = float(example_module("_local").checksum(reference(clip=math.inf)[0]))
    expected = float(example_module("_local").checksum(clipped))
    assert abs(printed - unclipped) > 100 * abs(printed - expected), "unclipped training is as close: a blind test"


def test_overlap_with_ddp_steps_in_the_backward() -> None:
    example = example_module("overlap_with_ddp")
    output = run_example("overlap_with_ddp.py", "--world-size", "2", "--steps", str(STEPS), "--hook", "interleaved")
    model = example.make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_on_mean_gradient(model, optimizer, lambda s: [example.batch(r, s) for r in range(2)], range(STEPS))
    assert_checksum(common_checksum(rank_lines(output, 2)), model, "overlap_with_ddp")


def test_post_local_sgd_averages_on_schedule() -> None:
    """Warm-up 2 (gradients all-reduced), then local SGD averaged every 2 steps: averaged at steps 2 and 4; the
    ranks agree after the last averaging and differ after step 5's local step. Reference: 2 replicas in one process."""
    example = example_module("post_local_sgd")
    steps, warmup, period, world_size = 6, 2, 2, 2
    args = ["--world-size", str(world_size), "--steps", str(steps), "--warmup", str(warmup), "--period", str(period)]
    lines = rank_lines(run_example("post_local_sgd.py", *args), world_size)
    checksum = example_module("_local").checksum

    models = [example.make_model() for _ in range(world_size)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9) for m in models]
    for step in range(steps):
        for rank, (model, optimizer) in enumerate(zip(models, optimizers)):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(example.batch(rank, step)[0]), example.batch(rank, step)[1]).backward()
        if step < warmup:  # the hook all-reduces gradients
            for params in zip(*(m.parameters() for m in models)):
                mean = torch.stack([p.grad for p in params]).mean(0)
                for param in params:
                    param.grad = mean.clone()
        for optimizer in optimizers:
            optimizer.step()
        if step >= warmup and (step - warmup) % period == 0:  # the averager
            with torch.no_grad():
                for params in zip(*(m.parameters() for m in models)):
                    mean = torch.stack(params).mean(0)
                    for param in params:
                        param.copy_(mean)
            averaged = checksum(models[0])
    for rank, line in lines.items():
        assert math.isfinite(float(field(line, "loss")))
        at_step, value = line.split("last averaged at step ")[1].split()[:2]
        assert int(at_step) == 4 and math.isclose(float(value), float(averaged), rel_tol=1e-5), (line, averaged)
        assert_checksum(float(field(line, "now")), models[rank], f"rank {rank} after the last local step")
    assert field(lines[0], "now") != field(lines[1], "now"), "no local steps after the last averaging?"


def test_distributed_optimizer_over_rpc() -> None:
    example = example_module("distributed_optimizer_rpc")
    output = run_example("distributed_optimizer_rpc.py", "--world-size", "3", "--steps", str(STEPS))
    line = next(line for line in output.splitlines() if line.startswith("trainer of 3 workers"))
    assert math.isfinite(float(field(line, "loss")))
    model = nn.Sequential(example.make_stage(1), example.make_stage(2), example.make_head())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    train_on_mean_gradient(model, optimizer, lambda step: [example.batch(step)], range(STEPS))
    assert_checksum(float(field(line, "checksum")), model, "DistributedOptimizer")


def test_sharded_checkpoint_resumes_at_another_world_size() -> None:
    """Saved by 2 ranks after 3 steps, resumed by 3 for 3 more: the same as 6 uninterrupted steps on the whole
    batch; a resume that lost AdamW's state (a fresh optimizer at step 3) would not be."""
    example = example_module("sharded_checkpoint")
    args = ["--save-world-size", "2", "--resume-world-size", "3", "--steps", str(STEPS)]
    output = run_example("sharded_checkpoint.py", *args)
    assert f"resumed at step {STEPS} on 3 ranks" in output, output
    lines = rank_lines(output, 3)
    assert all(field(line, "step") == str(2 * STEPS) for line in lines.values()), lines
    printed = common_checksum(lines)

    def reference(fresh_optimizer_at_resume: bool) -> nn.Module:
        model = example.make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        train_on_mean_gradient(model, optimizer, lambda step: [example.global_batch(step)], range(STEPS))
        if fresh_optimizer_at_resume:
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        train_on_mean_gradient(model, optimizer, lambda step: [example.global_batch(step)], range(STEPS, 2 * STEPS))
        return model

    assert_checksum(printed, reference(fresh_optimizer_at_resume=False), "resumed training")
    restarted = float(example_module("_local").checksum(reference(fresh_optimizer_at_resume=True)))
    assert not math.isclose(printed, restarted, rel_tol=1e-3), "the optimizer state made no difference"
