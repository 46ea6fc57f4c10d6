"""benchmarks/report.py --quick renders the whole report (Markdown, six PNGs, report.json) in one command, and the
figures that are arithmetic match references computed here: partition balance, byte counts, per-rank memory (the
buffers' count in memory_master.py and the live-tensor census of bench_zero.py, peers included). DeepSpeed and
distoptim's ShardedDataParallel are optional: absent, they are reported as skipped with the reason, not as errors."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from distoptim.demo.config import GPTConfig
from distoptim.demo.model import GPT
from tests.zero.test_partition import _gpt2_124m_numels

ROOT = Path(__file__).resolve().parents[1]
PNGS = ("step_time.png", "state_bytes.png", "comm_bytes.png", "memory.png", "partition_balance.png", "peers.png")
QUICK_PEERS = ("sdp", "fsdp2-zero2", "deepspeed-zero2")
REASONS = {"sdp": "not available: distoptim.ShardedDataParallel", "deepspeed-zero2": "not installed: deepspeed"}
ZERO1 = ("torch-zero", "torch-zero-bucket", "distoptim-zero", "distoptim-zero-bucket", "distoptim-even-bucket")
ZERO2 = ("zero2-greedy-bucket", "zero2-even-bucket", "zero2-even-interleaved")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Run the quick report once for the module (tiny model, 2 ranks): its directory and its report.json."""
    out = tmp_path_factory.mktemp("report")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "report.py"), "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,  # a hung rank fails the test (bench_zero's ranks time out too)
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return out, json.loads((out / "report.json").read_text())


def _sorted_greedy(numels: list[int], world_size: int) -> tuple[list[int], list[int]]:
    """Reference: torch's documented partition (largest first, to the least-loaded rank, ties to the lowest)."""
    loads, counts = [0] * world_size, [0] * world_size
    for numel in sorted(numels, reverse=True):
        rank = loads.index(min(loads))
        loads[rank] += numel
        counts[rank] += 1
    return loads, counts


def _benchmarks_module(name: str) -> Any:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_one_command_writes_markdown_and_six_pngs(report: Any) -> None:
    out, data = report
    for name in PNGS:
        png = (out / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n", name
        width, height = struct.unpack(">II", png[16:24])
        assert width >= 800 and height >= 400 and len(png) > 20_000, (name, width, height, len(png))
    text = (out / "REPORT.md").read_text()
    machine = data["machine"]
    for fact in (f"{machine['cpus']} CPUs", machine["cpu_model"], torch.__version__, "gloo", machine["date"]):
        assert fact in text, fact
    assert f"python benchmarks/report.py --quick --out {out}" in text
    for name in PNGS:
        assert f"]({name})" in text
    for variant in {r["variant"] for r in data["bench"]["results"]}:
        assert f"| `{variant}` |" in text
    caption = _benchmarks_module("report_plots").caption
    core = _benchmarks_module("zero_variants").CORE
    measured, skipped = {r["variant"] for r in data["bench"]["results"]}, data["bench"]["skipped"]
    assert measured | set(skipped) == set(core) | set(QUICK_PEERS) and not measured & set(skipped)
    assert "fsdp2-zero2" in measured  # FSDP2 runs wherever torch does
    for name, reason in skipped.items():  # an optional peer that is absent says why, in the page too
        assert reason == REASONS[name], (name, reason)
        assert f"| `{name}` | {reason} |" in text
    assert "## 6. Sharded data parallelism" in text and "Built for GPUs" in text
    line = caption(machine)  # what every figure carries at its foot
    for fact in (str(machine["cpus"]), machine["cpu_model"], machine["torch"], "gloo", machine["date"], "--quick"):
        assert fact in line, fact


def test_partition_balance_matches_arithmetic(report: Any) -> None:
    _, data = report
    numels = _gpt2_124m_numels()
    total = sum(numels)
    balance = data["balance"]
    assert balance["world_sizes"][0] == 2 and balance["world_sizes"][-1] == 1024 and balance["num_params"] == total
    for index, world_size in enumerate(balance["world_sizes"]):
        ideal = total / world_size
        even = balance["ratios"]["distoptim even"][index]
        torch_greedy = balance["ratios"]["torch greedy"][index]
        assert even == pytest.approx(math.ceil(ideal) / ideal) and even <= 1.01
        assert torch_greedy == pytest.approx(max(_sorted_greedy(numels, world_size)[0]) / ideal)
        assert torch_greedy >= even and balance["ratios"]["distoptim greedy"][index] == pytest.approx(torch_greedy)
    assert balance["ratios"]["torch greedy"][-1] > 300  # the embedding alone, at 1,024 ranks


def test_bytes_and_state_shards_match_arithmetic(report: Any) -> None:
    _, data = report
    config = GPTConfig(**data["bench"]["config"])
    numel, tensors = config.num_params, len(list(GPT(config).parameters()))
    results = {r["variant"]: r for r in data["bench"]["results"] if r["family"] == "ddp"}
    assert all(r["world_size"] == 2 for r in results.values())
    ddp = results["ddp-adamw"]["comm_bytes_per_rank_per_step"]
    assert ddp == 2 * (2 - 1) / 2 * 4 * numel  # one all-reduce of the fp32 gradients
    for name in ZERO1:  # the all-reduce plus one broadcast of every parameter from its owner
        assert results[name]["comm_bytes_per_rank_per_step"] / ddp == pytest.approx(1.5, rel=1e-3), name
    for name in ZERO2:  # the deprecated reduce_to_owners_hook is an all-reduce now: ZeRO-1's bytes
        assert results[name]["comm_bytes_per_rank_per_step"] / ddp == pytest.approx(1.5, rel=1e-3), name
    assert results["distoptim-master-bf16"]["comm_bytes_per_rank_per_step"] / ddp == pytest.approx(0.75, rel=1e-3)
    unsharded = 8 * numel + 4 * tensors  # AdamW: exp_avg, exp_avg_sq, a 4-byte step per tensor
    assert results["ddp-adamw"]["state_bytes_min"] == results["ddp-adamw"]["state_bytes_max"] == unsharded
    loads, counts = _sorted_greedy([p.numel() for p in GPT(config).parameters()], 2)
    for r in results.values():
        assert math.isfinite(r["median_total_ms"]) and r["median_total_ms"] > 0
        if r["variant"] == "ddp-adamw":
            continue
        # two ranks share the state; a parameter split by the even partition has a step on each side
        assert unsharded <= r["state_bytes_min"] + r["state_bytes_max"] <= unsharded + 4 * tensors, r["variant"]
        if "even" in r["setting"]:
            assert r["state_bytes_max"] <= 8 * math.ceil(numel / 2) + 4 * tensors, r["variant"]
        else:
            assert r["state_bytes_max"] == max(8 * load + 4 * count for load, count in zip(loads, counts))


def test_memory_matches_the_buffers_arithmetic(report: Any) -> None:
    _, data = report
    config = GPTConfig(**data["bench"]["config"])
    numel, tensors = config.num_params, len(list(GPT(config).parameters()))
    rows = data["memory"]["2"]
    shard = math.ceil(numel / 2)
    assert rows["ddp-adamw fp32"] | {"peak_rss": 0, "step_us": 0} == {
        "params": 4 * numel, "grads": 4 * numel, "state": 8 * numel + 4 * tensors, "master": 0,
        "peak_rss": 0, "step_us": 0,
    }  # fmt: skip
    for config_name in ("torch-zero fp32", "distoptim fp32"):
        row = rows[config_name]
        assert (row["params"], row["grads"], row["master"]) == (4 * numel, 4 * numel, 0)
        assert 8 * numel / 2 <= row["state"] <= 8 * numel / 2 * 1.25
    master = rows["distoptim bf16 + fp32 master"]
    assert (master["params"], master["grads"]) == (2 * numel, 2 * numel)
    assert master["master"] == 4 * shard  # fp32 copies of the owned half, nothing more
    assert 8 * shard <= master["state"] <= 8 * shard + 4 * tensors
    total = {name: sum(row[k] for k in ("params", "grads", "state", "master")) for name, row in rows.items()}
    assert total["distoptim bf16 + fp32 master"] < total["distoptim fp32"] < total["ddp-adamw fp32"]


def test_live_tensor_census_matches_the_arithmetic(report: Any) -> None:
    """The memory-only run's census: each category's bytes are what the configuration must hold, each storage once
    (DDP's buckets counted once even where a comm hook holds Python views of them), on the largest rank."""
    _, data = report
    config = GPTConfig(**data["bench"]["config"])
    numel, tensors = config.num_params, len(list(GPT(config).parameters()))
    memory = {r["variant"]: r for r in data["peers_memory"]["same_model"]["results"]}
    assert set(memory) | set(data["peers_memory"]["same_model"]["skipped"]) == {"torch-zero-bucket", *QUICK_PEERS}
    for r in memory.values():
        assert r["peak_growth_bytes_max"] > 0 and r["live_phase"] in ("forward", "backward", "step"), r["variant"]
    torch_zero = memory["torch-zero-bucket"]["live_bytes"]
    assert (torch_zero["params"], torch_zero["grads"], torch_zero["master"]) == (4 * numel, 4 * numel, 0)
    assert torch_zero["state"] == memory["torch-zero-bucket"]["state_bytes_max"]  # the fuller rank
    assert 4 * numel <= torch_zero["buffers"] <= 4 * numel + 4096  # DDP's buckets, the batch and the loss
    fsdp = memory["fsdp2-zero2"]["live_bytes"]  # after the forward: the gathered parameters are buffers
    assert 4 * numel / 2 <= fsdp["params"] <= 4 * numel / 2 + 4 * tensors * config.width
    assert fsdp["state"] == 2 * fsdp["params"] + 4 * tensors and fsdp["buffers"] >= 4 * numel
    if "deepspeed-zero2" in memory:
        deepspeed = memory["deepspeed-zero2"]["live_bytes"]
        assert deepspeed["master"] == 4 * math.ceil(numel / 2)  # its fp32 copy of the owned partition
        assert deepspeed["state"] == 2 * deepspeed["master"] + 4  # one param group: one step
        assert 4 * numel <= deepspeed["params"] <= 4 * numel + 64
    timed = {r["variant"]: r for r in data["bench"]["results"]}
    for name in ("zero2-greedy-bucket", "zero2-even-bucket"):  # comm hooks see DDP's buckets: not counted twice
        assert 4 * numel <= timed[name]["live_bytes"]["buffers"] <= 4 * numel + 4096, name


def test_muon_section_orthogonalizes_each_matrix_once(report: Any) -> None:
    """bench_muon.py's quick pass (tiny model, 2 ranks): DDP + plain Muon orthogonalizes every matrix on every rank,
    distoptim each matrix once over the ranks, and the optimizer state adds up to plain Muon + AdamW's."""
    out, data = report
    muon = data["muon"]
    variants = _benchmarks_module("muon_variants")
    config = _benchmarks_module("bench_muon").model_config("tiny", int(muon["args"]["seq"]))
    matrices, rest = variants.split(GPT(config))
    results = {r["variant"]: r for r in muon["results"]}
    assert set(results) == {"ddp-muon", "distoptim-zero1-muon", "sdp-muon"} and not muon["skipped"]
    flops = sum(variants.ns_flops(tuple(p.shape)) for p in matrices)
    assert results["ddp-muon"]["ns_calls_by_rank"] == [len(matrices)] * 2
    assert results["ddp-muon"]["ns_flops_by_rank"] == [flops] * 2
    plain = 4 * sum(p.numel() for p in matrices) + 8 * sum(p.numel() for p in rest) + 4 * len(rest)
    assert results["ddp-muon"]["state_bytes_max"] == plain  # Muon's momentum; AdamW's moments and steps
    for name in ("distoptim-zero1-muon", "sdp-muon"):
        r = results[name]
        assert sum(r["ns_calls_by_rank"]) == len(matrices) and sum(r["ns_flops_by_rank"]) == flops, name
        assert plain <= sum(r["state_bytes_by_rank"]) <= plain + 4 * len(rest), name  # a cut tensor: a step each
    text = (out / "REPORT.md").read_text()
    assert "## 7. Muon + AdamW" in text and "](muon.png)" in text and (out / "muon.png").read_bytes()[:4] == b"\x89PNG"
    assert {t["variant"] for t in muon["targets"]} == {"distoptim-zero1-muon", "sdp-muon"}
