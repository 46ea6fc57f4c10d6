"""The memory planner (``python -m distoptim plan``): its figures against the bytes of live tensors on real gloo runs
(parameters, ``.grad`` and DDP's buckets, optimizer state, master weights, staging buffers; distinct storages, never
RSS), its optimizer-state measurement against torch.optim's documented state, and its command line."""

from __future__ import annotations

import gc
import json
import os
import warnings
from collections.abc import Iterable
from typing import Any
from unittest import mock

import pytest
import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distoptim
from distoptim import ZeroRedundancyOptimizer
from distoptim.comm import collectives as comm
from distoptim.hooks import allreduce_hook
from distoptim.plan.cli import build_report, main, parse_bytes, parse_count
from distoptim.plan.figures import PlanConfig
from distoptim.plan.inventory import Inventory, ParamSpec, from_factory, load_factory, transformer
from distoptim.plan.memory import plan_modes
from distoptim.plan.state import OptimizerSpec, resolve_optimizer, state_cost
from distoptim.sharded_data_parallel.gradients import OwnedGradients
from tests._dist import run_on_ranks

FACTORY = "tests.test_planner:planner_net"
F32, BF16 = torch.float32, torch.bfloat16


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(24, 40), nn.Linear(40, 24)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class PlannerNet(nn.Module):
    """Odd sizes (an even cut splits parameters), a frozen parameter, blocks in a ModuleList (FSDP units), and one
    parameter of 1.5 MiB in fp32 (ZeRO syncs pieces of 1 MiB or more in place, smaller ones through staging)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(12, 24)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(24, 512)
        self.wide = nn.Linear(512, 768, bias=False)
        self.frozen = nn.Parameter(torch.ones(7, 3), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.wide(torch.tanh(self.head(x))) * self.frozen.sum()


def planner_net() -> PlannerNet:
    torch.manual_seed(0)
    return PlannerNet()


def _failing_factory() -> nn.Module:
    raise RuntimeError("no weights here")


# ------------------------------------------------------------------------------------------ live bytes


def _storages(tensors: Iterable[Any]) -> dict[int, int]:
    """Distinct storages (data pointer -> bytes) of ``tensors``; DTensors by their local shard."""
    found = {}
    for tensor in tensors:
        if not isinstance(tensor, Tensor):
            continue
        if hasattr(tensor, "to_local"):
            tensor = tensor.to_local()
        storage = tensor.untyped_storage()
        if storage.nbytes():
            found[storage.data_ptr()] = storage.nbytes()
    return found


def _all_live_tensors() -> dict[int, int]:
    gc.collect()  # a tensor that only a reference cycle still holds is garbage, not memory the plan must count
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _storages(o for o in gc.get_objects() if isinstance(o, Tensor))


class _Counter:
    """Bytes per category, each storage counted once (in the first category that names it)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.bytes: dict[str, int] = {}

    def add(self, category: str, storages: dict[int, int]) -> None:
        fresh = {ptr: size for ptr, size in storages.items() if ptr not in self.seen}
        self.seen.update(fresh)
        self.bytes[category] = self.bytes.get(category, 0) + sum(fresh.values())


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[Any]:
    return [value for entry in optimizer.state.values() for value in entry.values()]


def _capturing(inner: Any, buckets: dict[int, Tensor]) -> Any:
    """``inner`` (a DDP comm hook) that also keeps this backward's bucket buffers, to count DDP's gradient storage.
    Unannotated: DDP checks a hook's annotations against the real classes."""

    def hook(state, bucket):  # type: ignore[no-untyped-def]
        if bucket.index() == 0:
            buckets.clear()
        buckets[bucket.index()] = bucket.buffer()
        return inner(state, bucket)

    return hook


def _live_run(rank: int, world_size: int, config: dict[str, Any], baseline: set[int]) -> dict[str, int]:
    """One mode trained for two iterations; bytes of live tensors by category on this rank. ``baseline``: the
    storages alive before any run (whatever an earlier run left alive would count as unaccounted here)."""
    model = planner_net().to(config["dtype"])
    ddp = DDP(model, gradient_as_bucket_view=config.get("bucket_view", False))
    buckets: dict[int, Tensor] = {}
    upcast: dict[int, int] = {}
    mode, kwargs = config["mode"], dict(config["optimizer_kwargs"])
    optimizer_class = resolve_optimizer(config["optimizer"], kwargs)
    if mode == "ddp":
        ddp.register_comm_hook(None, _capturing(allreduce_hook, buckets))
        optimizer: Any = optimizer_class.cls(model.parameters(), **dict(optimizer_class.kwargs))
        local = optimizer
    else:
        optimizer = ZeroRedundancyOptimizer(
            model.parameters(),
            optimizer_class.cls,
            partition=config["partition"],
            master_dtype=config["master"],
            parameters_as_bucket_view=config.get("param_view", False),
            **dict(optimizer_class.kwargs),
        )
        ddp.register_comm_hook(None, _capturing(allreduce_hook, buckets))
        local = optimizer.local_optimizer

        def record_upcast(*_: Any) -> None:  # the master copies' gradients, made for this step
            upcast.clear()
            upcast.update(_storages(t.tensor.grad for t in optimizer.local_shard.masters))

        local.register_step_pre_hook(record_upcast)
    for iteration in range(2):
        optimizer.zero_grad()
        batch = torch.randn(4, 12, generator=torch.Generator().manual_seed(10 * iteration + rank))
        loss = ddp(batch.to(config["dtype"])).float().square().mean()
        loss.backward()
        del loss, batch
        optimizer.step()
    counter = _Counter()
    counter.add("params", _storages(model.parameters()))
    counter.add("grads", _storages(p.grad for p in model.parameters()))
    counter.add("grads", _storages(buckets.values()))
    counter.add("state", _storages(_state_tensors(local)))
    if mode != "ddp":
        counter.add("master", _storages(t.tensor for t in optimizer.local_shard.masters))
        rounds = getattr(optimizer.placer.sync, "rounds", ())  # BucketViewSync stages nothing
        counter.add("staging", _storages(r.work.stage for r in rounds if r.work is not None))
    counter.add("unaccounted", {p: s for p, s in _all_live_tensors().items() if p not in baseline})
    return {**counter.bytes, "upcast": sum(upcast.values())}


def _live_body(rank: int, world_size: int, configs: list[dict[str, Any]]) -> list[dict[str, int]]:
    baseline = set(_all_live_tensors())
    return [_live_run(rank, world_size, config, baseline) for config in configs]


LIVE_CONFIGS = [
    {"dtype": F32, "master": None, "optimizer": "adamw", "optimizer_kwargs": {}, "partition": "even"},
    {"dtype": F32, "master": None, "optimizer": "sgd-momentum", "optimizer_kwargs": {}, "partition": "greedy"},
    {"dtype": BF16, "master": F32, "optimizer": "rmsprop", "optimizer_kwargs": {"centered": True}, "partition": "even"},
    {"dtype": BF16, "master": None, "optimizer": "adagrad", "optimizer_kwargs": {}, "partition": "greedy"},
]


def _planned(config: dict[str, Any], world_size: int) -> dict[str, Any]:
    inventory = from_factory(load_factory(FACTORY), FACTORY).cast(config["dtype"])
    plan_config = PlanConfig(
        world_size=world_size,
        optimizer=resolve_optimizer(config["optimizer"], config["optimizer_kwargs"]),
        master_dtype=config["master"],
        partition=config["partition"],
        gradient_as_bucket_view=config.get("bucket_view", False),
        parameters_as_bucket_view=config.get("param_view", False),
        bucket_cap_mb=config.get("bucket_cap_mb", 25.0),
        reduce_dtype=config.get("reduce_dtype"),
    )
    return {mode.key: mode for mode in plan_modes(inventory, plan_config)}


@pytest.mark.parametrize(
    ("world_size", "settings"), [(2, LIVE_CONFIGS), (4, LIVE_CONFIGS[1:3])], ids=["2-ranks", "4-ranks"]
)
def test_plan_matches_live_tensor_bytes_of_ddp_and_zero1(world_size: int, settings: list[Any]) -> None:
    """Every category, every rank, exact: DDP's buckets and .grad (and with gradient_as_bucket_view), the local
    optimizer's state and master copies of this rank's shard, ZeRO's staging buffers (none, and parameters in flat
    buffers, with parameters_as_bucket_view), the master gradients made for the step;
    and nothing else stays alive. (4 ranks: two of the settings, to keep the suite fast on 2 cores.)"""
    configs = [{**c, "mode": mode} for c in settings for mode in ("ddp", "zero1")]
    configs.append({**settings[0], "mode": "ddp", "bucket_view": True})
    configs += [{**settings[-1], "mode": "zero1", "param_view": True}]
    results = run_on_ranks(_live_body, world_size, configs, timeout=240)
    for index, config in enumerate(configs):
        if config["mode"] == "ddp":  # DDP + a plain torch.optim optimizer: it keeps no master copies
            config = {**config, "master": None}
        mode = _planned(config, world_size)[config["mode"]]
        for rank in range(world_size):
            live, planned = results[rank][index], mode.ranks[rank]
            other = dict(planned.other)
            want = {
                "params": planned.params,
                "grads": planned.grads,
                "state": planned.state,
                "master": planned.master,
                "staging": other.get("parameter sync staging", 0),
                "upcast": other.get("master gradients during step", 0),
                "unaccounted": 0,
            }
            if config["mode"] == "ddp":
                del want["master"], want["staging"]
            got = {key: live.get(key, 0) for key in want}
            assert got == want, f"{config} rank {rank}/{world_size}"


def _fsdp2_body(rank: int, world_size: int) -> dict[str, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = planner_net()
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 12)).square().mean().backward()
    optimizer.step()
    counter = _Counter()
    counter.add("params", _storages(model.parameters()))
    counter.add("grads", _storages(p.grad for p in model.parameters()))
    counter.add("state", _storages(_state_tensors(optimizer)))
    return counter.bytes


def test_plan_matches_fsdp2_sharded_bytes_at_2_ranks() -> None:
    """FSDP2's sharded parameters and gradients (padded to a full dim-0 chunk) and its optimizer state (unpadded)."""
    results = run_on_ranks(_fsdp2_body, 2, timeout=120)
    config = {"dtype": F32, "master": None, "optimizer": "adamw", "optimizer_kwargs": {}, "partition": "even"}
    fsdp2 = _planned(config, 2)["fsdp2"]
    for rank, live in enumerate(results):
        planned = fsdp2.ranks[rank]
        assert live == {"params": planned.params, "grads": planned.grads, "state": planned.state}, rank


class _Watch:
    """What a ShardedDataParallel rank holds at the backward's peak and casts for the step."""

    def __init__(self, zero: ZeroRedundancyOptimizer, baseline: set[int]) -> None:
        self.zero, self.baseline, self.peak, self.casts = zero, baseline, 0, 0

    def measured(self, taken: Any) -> Any:
        """``OwnedGradients._buffer``, measuring every live tensor once a new bucket's buffer is taken (the gradient
        to copy into it still alive). No collection here: only the backward's own tensors changed since the last."""

        def buffer(store: Any, bucket: int, *args: Any) -> Any:
            fresh = bucket not in store._buffers
            result = taken(store, bucket, *args)
            if not fresh:  # the peak is where a bucket is taken: the fullest moment of the backward since the last
                return result
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                live = _storages(o for o in gc.get_objects() if isinstance(o, Tensor))
            self.peak = max(self.peak, sum(size for ptr, size in live.items() if ptr not in self.baseline))
            return result

        return buffer

    def record_casts(self, *_: Any) -> None:
        """A step pre-hook: the stepped gradients that are not views of the owned gradient."""
        stepped = (t.tensor.grad for group in self.zero.local_shard.groups for t in group)
        owned = set(_storages(self.zero.gradient_source.owned))
        self.casts = sum(size for ptr, size in _storages(stepped).items() if ptr not in owned)


def _sdp_body(rank: int, world_size: int, configs: list[dict[str, Any]]) -> list[dict[str, int]]:
    """Per config, on this rank: the live bytes at the backward's peak (measured each time a bucket buffer is taken,
    the moment a gradient and the buckets in flight coexist), what is held after the backward by category, and the
    gradients cast for the step (caught in a step pre-hook)."""
    results = []
    for config in configs:
        os.environ[comm.ENVIRONMENT] = "chunked"  # NCCL's style, the one a GPU runs (gloo's p2p stages receives)
        baseline = set(_all_live_tensors())  # with what earlier configs left in cycles through C++ (their hooks)
        model = planner_net().to(config["dtype"])
        optimizer = resolve_optimizer(config["optimizer"], config["optimizer_kwargs"])
        zero = ZeroRedundancyOptimizer(
            model.parameters(),
            optimizer.cls,
            **dict(optimizer.kwargs),
            partition=config["partition"],
            master_dtype=config["master"],
            parameters_as_bucket_view=config.get("param_view", False),
        )
        sdp = distoptim.ShardedDataParallel(
            model, zero, bucket_cap_mb=config["bucket_cap_mb"], reduce_dtype=config.get("reduce_dtype")
        )
        watch = _Watch(zero, baseline)
        zero.local_optimizer.register_step_pre_hook(watch.record_casts)
        counts: dict[str, int] = {}
        for iteration in range(2):
            zero.zero_grad()
            watch.peak = 0
            batch = torch.randn(4, 12, generator=torch.Generator().manual_seed(10 * iteration + rank))
            loss = sdp(batch.to(config["dtype"])).float().square().mean()
            gc.collect()
            with mock.patch.object(OwnedGradients, "_buffer", watch.measured(OwnedGradients._buffer)):
                loss.backward()
            del loss, batch
            counter = _Counter()
            counter.add("params", _storages(model.parameters()))
            counter.add("state", _storages(_state_tensors(zero.local_optimizer)))
            counter.add("master", _storages(t.tensor for t in zero.local_shard.masters))
            staged = [
                unit.sync for unit in zero.placer.sync.units if hasattr(unit, "sync")
            ]  # the in-place ones have none
            counter.add("staging", _storages(r.work.stage for s in staged for r in s.rounds if r.work is not None))
            counter.add("grads", _storages(zero.gradient_source.owned))
            counter.add("markers", _storages(p.grad for p in model.parameters()))  # one element each, no values
            counter.add("unaccounted", {p: s for p, s in _all_live_tensors().items() if p not in baseline})
            markers = sum(p.element_size() for p in model.parameters() if p.requires_grad and p.numel())
            counts = {**counter.bytes, "peak": watch.peak, "markers_planned": markers}
            zero.step()
        results.append({**counts, "casts": watch.casts})
        del sdp, zero, model
    os.environ.pop(comm.ENVIRONMENT)
    return results


SDP_CONFIGS = [  # PlannerNet's 1.5 MiB ``wide`` is over every cap: a bucket of its own
    {**LIVE_CONFIGS[0], "bucket_cap_mb": 0.25},
    {**LIVE_CONFIGS[0], "bucket_cap_mb": 0.05, "param_view": True},
    {**LIVE_CONFIGS[1], "bucket_cap_mb": 0.05, "param_view": True},
    {**LIVE_CONFIGS[2], "bucket_cap_mb": 0.1, "reduce_dtype": F32},  # bf16, fp32 masters: no cast for the step
    {**LIVE_CONFIGS[2], "bucket_cap_mb": 0.1, "master": None, "reduce_dtype": F32},  # cast down for the step
    {**LIVE_CONFIGS[3], "bucket_cap_mb": 0.1},
]


@pytest.mark.parametrize("world_size", [2, 3])
def test_plan_matches_sharded_data_parallel_live_bytes(world_size: int) -> None:
    """ShardedDataParallel after the backward, every rank, exact: parameters, the owned gradient, optimizer state,
    masters, staging, the gradients cast for the step. The backward's peak (every live tensor beyond what existed
    before, measured whenever a bucket buffer is taken) is at most the plan's backward figure (the same plus the
    buckets in flight and the gradient being copied into one) and within one bucket of it: which buckets coexist
    at the peak depends on when the reductions finish, the plan assumes the two largest."""
    results = run_on_ranks(_sdp_body, world_size, SDP_CONFIGS, timeout=240)
    wrong = []
    for index, config in enumerate(SDP_CONFIGS):
        sdp = _planned(config, world_size)["sharded_data_parallel"]
        for rank in range(world_size):
            live, planned = results[rank][index], sdp.ranks[rank]
            other = dict(planned.other)
            want = {
                "params": planned.params,
                "grads": planned.grads,
                "state": planned.state,
                "master": planned.master,
                "staging": other.get("parameter sync staging", 0),
                "casts": other.get("gradients cast to the step's dtype", 0),
                "markers": live["markers_planned"],  # .grad's markers: one element a parameter (not planned)
                "unaccounted": 0,
            }
            got = {key: live.get(key, 0) for key in want}
            backward = planned.total - want["casts"]
            in_flight = other["gradient buckets in flight (at most)"]
            if got != want or not backward - in_flight <= live["peak"] <= backward:
                wrong.append(f"{config} rank {rank}/{world_size}: {got} != {want} or peak {live['peak']} vs {backward}")
    assert not wrong, "\n".join(wrong)


# ------------------------------------------------------------------------------- pieces and command line


@pytest.mark.parametrize(
    ("name", "kwargs", "per_element_f32", "per_tensor"),
    [
        ("sgd", {}, 0, 0),  # no state without momentum
        ("sgd", {"momentum": 0.9}, 4, 0),  # momentum_buffer
        ("sgd-momentum", {}, 4, 0),
        ("adam", {}, 8, 4),  # exp_avg, exp_avg_sq; a float32 step scalar
        ("adamw", {}, 8, 4),
        ("adagrad", {}, 4, 4),  # sum; step
        ("rmsprop", {}, 4, 4),  # square_avg; step
        ("rmsprop", {"centered": True, "momentum": 0.9}, 12, 4),  # + grad_avg, momentum_buffer
    ],
)
def test_state_cost_is_torch_optims_documented_state(
    name: str, kwargs: dict[str, Any], per_element_f32: int, per_tensor: int
) -> None:
    optimizer = resolve_optimizer(name, kwargs)
    assert (state_cost(optimizer, F32).per_element, state_cost(optimizer, F32).per_tensor) == (
        per_element_f32,
        per_tensor,
    )
    half = state_cost(optimizer, BF16)  # state follows the stepped tensor's dtype; the step count stays float32
    assert (half.per_element, half.per_tensor) == (per_element_f32 // 2, per_tensor)


def test_state_cost_knows_which_optimizers_make_state_at_construction() -> None:
    """Adagrad fills its ``sum`` for every parameter it is given, frozen ones too; Adam waits for a gradient."""
    assert state_cost(resolve_optimizer("adagrad"), F32).at_construction
    assert not state_cost(resolve_optimizer("adamw"), F32).at_construction


def test_state_cost_refuses_state_not_proportional_to_size() -> None:
    with pytest.raises(ValueError, match="not proportional"):
        state_cost(OptimizerSpec(torch.optim.Adafactor), F32)  # factored second moment of a matrix
    with pytest.raises(ValueError, match="unknown optimizer 'adafactor'"):
        resolve_optimizer("adafactor")


@pytest.mark.parametrize("total", [1, 4_000_000, 125_000_000, 7_000_000_000])
def test_transformer_model_of_a_parameter_count_is_exact(total: int) -> None:
    inventory = transformer(total, BF16)
    assert inventory.numel == total
    assert {p.dtype for p in inventory.params} == {BF16}


def test_ring_collective_bytes_per_rank() -> None:
    """One flat fp32 tensor of P = 4k elements on 4 ranks: DDP all-reduces 2 (N-1)/N P b, ZeRO-1 adds an all-gather
    of (N-1)/N P b, ShardedDataParallel reduce-scatters instead; FSDP2 gathers in forward (the root is
    not resharded, so not again in backward) and reduce-scatters."""
    size, numel = 4, 4096
    inventory = Inventory((ParamSpec("w", (numel,), F32, True),), "flat")
    modes = {m.key: m for m in plan_modes(inventory, PlanConfig(size, resolve_optimizer("adamw")))}
    ring = (size - 1) * numel * 4 // size
    assert {key: mode.sends_total for key, mode in modes.items()} == {
        "ddp": 2 * ring, "zero1": 3 * ring, "sharded_data_parallel": 2 * ring,
        "fsdp2": 2 * ring,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("text", "value"), [("80GB", 80 * 10**9), ("80GiB", 80 * 2**30), ("512 MiB", 2**29), ("1e9", 10**9)]
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize(("text", "value"), [("7e9", 7 * 10**9), ("7B", 7 * 10**9), ("1.3b", 1_300_000_000)])
def test_parse_count(text: str, value: int) -> None:
    assert parse_count(text) == value


def test_json_and_fits_for_a_model_built_on_the_meta_device(capsys: pytest.CaptureFixture[str]) -> None:
    """The parameters counted on the meta device are the real model's; fits compares the peak rank's total."""
    params = list(planner_net().parameters())
    expected_params = sum(p.numel() * 2 for p in params)  # bf16
    argv = ["--model", FACTORY, "--world-size", "4", "--dtype", "bf16", "--master-dtype", "fp32", "--json"]
    assert main([*argv, "--gpu-memory", "1GiB"]) == 0
    report = json.loads(capsys.readouterr().out)
    modes = {mode["mode"]: mode for mode in report["modes"]}
    assert report["parameters"] == sum(p.numel() for p in params)
    assert modes["ddp"]["peak"]["params"] == expected_params
    assert all(mode["fits"] is True for mode in modes.values())
    ddp_total = modes["ddp"]["peak"]["total"]
    assert main([*argv, "--gpu-memory", str(ddp_total - 1)]) == 0
    fits = {mode["mode"]: mode["fits"] for mode in json.loads(capsys.readouterr().out)["modes"]}
    assert fits["ddp"] is False and fits["sharded_data_parallel"] is True


def test_parameters_as_bucket_view_option_reaches_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """``--parameters-as-bucket-view``: no sync staging in ZeRO-1 (PlannerNet's fragments are all staged without)."""
    argv = ["--model", FACTORY, "--world-size", "2", "--json"]
    staging = {}
    for extra in ([], ["--parameters-as-bucket-view"]):
        assert main([*argv, *extra]) == 0
        modes = {mode["mode"]: mode for mode in json.loads(capsys.readouterr().out)["modes"]}
        staging[bool(extra)] = modes["zero1"]["peak"]["other"].get("parameter sync staging", 0)
    assert staging[False] > 0 and staging[True] == 0


def test_table_says_what_is_not_counted(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--params", "7e9", "--world-size", "64", "--dtype", "bf16", "--gpu-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "activations are NOT counted" in out
    for title in ("DDP", "ZeRO-1", "ShardedDataParallel", "FSDP2 (ZeRO-3)"):
        assert f"\n{title} " in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--params", "7e9", "--world-size", "8", "--optimizer", "lion"], "unknown optimizer 'lion'"),
        (["--params", "7e9", "--world-size", "8", "--gpu-memory", "80 gigs"], "bad size '80 gigs'"),
        (["--params", "seven", "--world-size", "8"], "bad parameter count 'seven'"),
        (["--params", "1e999", "--world-size", "8"], "bad parameter count '1e999': too large"),
        (["--params", "7e9", "--world-size", "8", "--optimizer-arg", "momentum"], "expected KEY=VALUE"),
        (["--params", "7e9", "--world-size", "0"], "--world-size must be at least 1"),
        (["--params", "7e9", "--world-size", "8", "--dtype", "fp8"], "unknown dtype 'fp8'"),
        (["--params", "7e9"], "the following arguments are required: --world-size"),
        (["--model", "tests.test_planner:_failing_factory", "--world-size", "2"], "the factory failed"),
        (["--model", "tests.test_planner:nothing", "--world-size", "2"], "has no attribute 'nothing'"),
        (["--model", "no.such.module:f", "--world-size", "2"], "cannot import 'no.such.module'"),
        (["--model", "tests.test_planner", "--world-size", "2"], "expected 'package.module:factory'"),
    ],
)
def test_bad_input_is_one_line_and_exit_status_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("python -m distoptim plan: error:"), captured.err
    assert message in captured.err


def test_python_m_distoptim_plan_runs_the_planner(capsys: pytest.CaptureFixture[str]) -> None:
    from distoptim.__main__ import main as distoptim_main

    assert distoptim_main(["plan", "--params", "1e6", "--world-size", "2", "--optimizer", "sgd", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parameters"] == 10**6 and report["world_size"] == 2


# ------------------------------------------------------------------------------------------ Muon


class _NewtonSchulzFlops:
    """Counts the FLOPs of the orthogonalizations this rank runs, from each call's shape (torch's Muon makes one per
    matrix it steps)."""

    def __init__(self) -> None:
        self.flops = 0
        self._original = torch.optim._muon._zeropower_via_newtonschulz

    def __call__(self, grad: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        from distoptim.plan.memory import newton_schulz_flops

        self.flops += newton_schulz_flops(tuple(grad.shape))
        return self._original(grad, *args, **kwargs)


def _muon_run(rank: int, partition: str) -> dict[str, int]:
    """Muon on the blocks' matrices + AdamW on the rest, as the Muon guide builds it (plain under DDP, or one
    ZeroRedundancyOptimizer with ``partition``), two steps: this rank's live state bytes, and the Newton-Schulz FLOPs
    of the second step."""
    model = planner_net()
    matrices = [p for block in model.blocks for p in block.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if all(p is not m for m in matrices)]
    if partition == "ddp":
        ddp: nn.Module = DDP(model)
        optimizers: list[Any] = [torch.optim.Muon(matrices), torch.optim.AdamW(rest)]
        locals_ = optimizers
    else:
        groups = [{"params": matrices, "optimizer_class": torch.optim.Muon}, {"params": rest}]
        zero = ZeroRedundancyOptimizer(groups, torch.optim.AdamW, partition=partition.removeprefix("sdp-"))
        ddp = distoptim.ShardedDataParallel(model, zero) if partition.startswith("sdp-") else DDP(model)
        optimizers, locals_ = [zero], [zero.local_optimizer]
    for iteration in range(2):
        model.zero_grad()
        batch = torch.randn(4, 12, generator=torch.Generator().manual_seed(10 * iteration + rank))
        ddp(batch).square().mean().backward()
        counter = _NewtonSchulzFlops()
        with mock.patch("torch.optim._muon._zeropower_via_newtonschulz", counter):
            for optimizer in optimizers:
                optimizer.step()
    return {
        "state": sum(_storages(t for optim in locals_ for t in _state_tensors(optim)).values()),
        "flops": counter.flops,
    }


def _muon_body(rank: int, world_size: int, partitions: list[str]) -> list[dict[str, int]]:
    return [_muon_run(rank, partition) for partition in ["ddp", *partitions]]


@pytest.mark.parametrize("world_size", [3])
def test_plan_models_muon_state_and_newton_schulz_work_per_rank(world_size: int) -> None:
    """``--muon``: per rank, the optimizer state bytes and the Newton-Schulz FLOPs the plan gives DDP + plain
    Muon/AdamW, ZeRO-1 and ShardedDataParallel (both partitions each) are the live ones, and the balance is their
    max/mean."""
    partitions = ["even", "greedy", "sdp-even", "sdp-greedy"]
    results = run_on_ranks(_muon_body, world_size, partitions, timeout=180)
    inventory = from_factory(load_factory(FACTORY), FACTORY)
    for index, partition in enumerate(["ddp", *partitions]):
        config = PlanConfig(
            world_size=world_size,
            optimizer=resolve_optimizer("adamw"),
            partition="even" if partition == "ddp" else partition.removeprefix("sdp-"),
            muon=OptimizerSpec(torch.optim.Muon),
        )
        key = "ddp" if partition == "ddp" else "sharded_data_parallel" if partition.startswith("sdp-") else "zero1"
        mode = {m.key: m for m in plan_modes(inventory, config)}[key]
        live = [results[rank][index] for rank in range(world_size)]
        assert [r["state"] for r in live] == [m.state for m in mode.ranks], partition
        assert [r["flops"] for r in live] == list(mode.newton_schulz), partition
        assert sum(mode.newton_schulz) > 0
    flops = [r["flops"] for r in (results[rank][1] for rank in range(world_size))]
    report = build_report(inventory, config, None)
    zero1 = next(m for m in report["modes"] if m["mode"] == "zero1")
    assert zero1["newton_schulz_balance"] == pytest.approx(max(flops) * world_size / sum(flops))
    assert report["muon"]["matrices"] == 4


def test_muon_by_name_points_to_the_muon_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--params", "1e8", "--world-size", "2", "--optimizer", "muon"]) == 2
    assert "pass --muon" in capsys.readouterr().err
    assert main(["--params", "1e8", "--world-size", "3", "--muon"]) == 0
    assert "Newton-Schulz work per step" in capsys.readouterr().out


@pytest.mark.parametrize("cap", ["0", "inf", "nan", "1e303"])
def test_a_bucket_cap_no_int_holds_is_a_one_line_error(cap: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--params", "1e7", "--world-size", "2", "--bucket-cap-mb", cap]) == 2
    assert "--bucket-cap-mb must be positive" in capsys.readouterr().err


def frozen_muon_net() -> nn.Module:
    """Every matrix Muon would take frozen: its Newton-Schulz work is zero on every rank."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 8)]))
    model[1].requires_grad_(False)
    return model


def test_muon_with_every_matrix_frozen_prints_no_balance(capsys: pytest.CaptureFixture[str]) -> None:
    """No Newton-Schulz work anywhere: the table shows no balance rather than failing to format it."""
    assert main(["--model", "tests.test_planner:frozen_muon_net", "--world-size", "2", "--muon"]) == 0
    assert "(max/mean -)" in capsys.readouterr().out


def test_muon_takes_the_matrices_of_a_gpt2s_blocks_and_leaves_its_tied_embedding() -> None:
    """``--muon``'s rule on a ``transformers`` GPT-2 built on the meta device: the blocks' ``Conv1D`` matrices, first,
    in model order; the tied token embedding (listed once), the position embedding and every vector on AdamW."""
    transformers = pytest.importorskip("transformers")
    from distoptim.plan.memory import with_muon

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=16)
    inventory = with_muon(from_factory(lambda: transformers.GPT2LMHeadModel(config), "gpt2"))
    muon = [p.name for p in inventory.params if p.muon]
    kinds = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    assert muon == [f"transformer.h.{layer}.{kind}.weight" for layer in range(2) for kind in kinds]
    assert [p.name for p in inventory.params[: len(muon)]] == muon
    rest = {p.name for p in inventory.params[len(muon) :]}
    assert {"transformer.wte.weight", "transformer.wpe.weight"} <= rest and "lm_head.weight" not in rest


def _zero_state_of_format(rank: int, world_size: int, fmt: str) -> int:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 128), nn.Linear(128, 40))
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, partition="even", state_format=fmt)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    zero.step()
    return sum(v.numel() * v.element_size() for e in zero.state.values() for v in e.values() if isinstance(v, Tensor))


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_state_formats_bytes_match_the_optimizer(fmt: str) -> None:
    """The planner's state bytes per rank in a state format are what ZeroRedundancyOptimizer holds (blocks cut as
    the even partition cuts them: within a block's scale per rank)."""
    from tests._dist import run_on_ranks

    measured = run_on_ranks(_zero_state_of_format, 2, fmt)
    inventory = Inventory(
        (
            ParamSpec("0.weight", (128, 96), torch.float32, True),
            ParamSpec("0.bias", (128,), torch.float32, True),
            ParamSpec("1.weight", (40, 128), torch.float32, True),
            ParamSpec("1.bias", (40,), torch.float32, True),
        ),
        "two linears",
    )
    config = PlanConfig(2, resolve_optimizer("adamw"), state_format=fmt)
    zero1 = next(mode for mode in plan_modes(inventory, config) if mode.key == "zero1")
    planned = [rank.state for rank in zero1.ranks]
    assert sum(planned) == pytest.approx(sum(measured), abs=16), (planned, measured)
    fp32 = next(m for m in plan_modes(inventory, PlanConfig(2, resolve_optimizer("adamw"))) if m.key == "zero1")
    assert sum(planned) < sum(rank.state for rank in fp32.ranks) * (0.51 if fmt == "bf16" else 0.27)
