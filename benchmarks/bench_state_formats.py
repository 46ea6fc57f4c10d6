"""State formats: per-rank live optimizer-state bytes and step time of ZeroRedundancyOptimizer(AdamW) with
``state_format`` fp32 / bf16 / int8, on N local ranks (gloo, one thread each), on GPT-shaped parameters.

State bytes: every tensor the local optimizer's state holds after the steps (codes, scales, step counts). Peak
RSS: each format alone in fresh ranks, a few steps, and the optimizer's share of it (the decode buffers too). Step
time: ``zero.step()`` (the local step and the parameter sync) with fixed gradients, median over iterations of the
slowest rank, and its ratio to fp32's measured in the same ranks, formats interleaved iteration by iteration.

Where torchao imports (an optional package, not a dependency), also torchao.optim.AdamW8bit (block 256, the same
scheme up to the two map differences ``codecs.dynamic_map`` states) beside ours and plain AdamW on one process, on
the same parameters and gradients: state bytes, step time (``torch.compile``'s first step reported apart), and how
far the parameters are apart after the steps; then the same under FSDP2 (``fully_shard``) at 2 ranks beside ZeRO.

    python benchmarks/bench_state_formats.py --world-sizes 1 2 --params-millions 8 --iters 10
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from distoptim import ZeroRedundancyOptimizer
from distoptim.demo.config import config_for_params
from distoptim.demo.launch import run_ranks
from distoptim.demo.model import GPT

FORMATS = ("fp32", "bf16", "int8")


def _state_bytes(zero: ZeroRedundancyOptimizer) -> int:
    return sum(
        value.numel() * value.element_size()
        for entry in zero.local_optimizer.state.values()
        for value in entry.values()
        if isinstance(value, torch.Tensor)
    )


def _rank(context: Any, millions: float, iters: int, partition: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(config_for_params(millions))
    params = {fmt: [p.detach().clone().requires_grad_() for p in model.parameters()] for fmt in FORMATS}
    zeros = {
        fmt: ZeroRedundancyOptimizer(params[fmt], torch.optim.AdamW, partition=partition, state_format=fmt, lr=1e-4)
        for fmt in FORMATS
    }
    for fmt in FORMATS:
        generator = torch.Generator().manual_seed(1)
        for param in params[fmt]:
            param.grad = torch.randn(param.shape, generator=generator) * 1e-3
        zeros[fmt].step()  # the first step makes the state
    times: dict[str, list[float]] = {fmt: [] for fmt in FORMATS}
    for _ in range(iters):
        for fmt in FORMATS:
            dist.barrier()
            start = time.perf_counter()
            zeros[fmt].step()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[fmt].append(float(elapsed))
    return {
        "numel": sum(p.numel() for p in params["fp32"]),
        "bytes": {fmt: _state_bytes(zeros[fmt]) for fmt in FORMATS},
        "ms": {fmt: 1e3 * statistics.median(times[fmt]) for fmt in FORMATS},
    }


def _peak_rss(context: Any, millions: float, fmt: str, partition: str, steps: int) -> dict[str, int]:
    """One format alone in fresh ranks: the peak RSS of a few steps (model, gradients, state, the codec's buffers and
    temporaries), and the RSS before the optimizer was built (model and gradients only)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    params = list(GPT(config_for_params(millions)).parameters())
    generator = torch.Generator().manual_seed(1)
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator) * 1e-3
    before = _max_rss()
    zero = ZeroRedundancyOptimizer(params, torch.optim.AdamW, partition=partition, state_format=fmt, lr=1e-4)
    for _ in range(steps):
        zero.step()
    return {"before": before, "peak": _max_rss()}


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _torchao_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Live state bytes of a torchao optimizer (an 8-bit state's codes, scales and map; DTensors' local parts), and
    how many parameters have 8-bit state."""
    total, quantized = 0, 0
    for entry in optimizer.state.values():
        for value in entry.values():
            local = value.to_local() if hasattr(value, "to_local") else value
            parts = (
                [getattr(local, name) for name in ("codes", "scale", "qmap")] if hasattr(local, "codes") else [local]
            )
            total += sum(t.numel() * t.element_size() for t in parts if isinstance(t, torch.Tensor))
        quantized += any(hasattr(getattr(v, "_local_tensor", v), "codes") for v in entry.values())
    return total, quantized


def _plain_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for e in optimizer.state.values()
        for v in e.values()
        if isinstance(v, torch.Tensor)
    )


def _grads(shapes: list[torch.Size], step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(shape, generator=generator) * 1e-3 for shape in shapes]


def _timed_steps(
    steppers: dict[str, Any], set_grads: Any, iters: int
) -> tuple[dict[str, float], dict[str, float], dict[str, list[float]]]:
    """The first step's seconds (compiles), then a warm-up step, then ``iters`` steps interleaved (slowest rank)."""
    first: dict[str, float] = {}
    times: dict[str, list[float]] = {name: [] for name in steppers}
    for step in range(iters + 2):
        set_grads(step)
        for name, stepper in steppers.items():
            dist.barrier()
            start = time.perf_counter()
            stepper.step()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step == 0:
                first[name] = float(elapsed)
            elif step > 1:
                times[name].append(float(elapsed))
    return first, {name: 1e3 * statistics.median(t) for name, t in times.items()}, times


@contextlib.contextmanager
def _cold_compile_cache() -> Iterator[None]:
    """A fresh, empty inductor cache for this rank (so that the first step's time is a cold compile, run after run),
    compiled in this rank's one thread; removed afterwards. Set before torchao is imported."""
    directory = tempfile.mkdtemp(prefix="bench-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = directory
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    try:
        yield
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _beside_adamw(
    millions: float, peer: str, make_peer: Any
) -> tuple[dict[str, list[torch.Tensor]], dict[str, Any], Any]:
    """Plain AdamW, ours in int8 and ``peer`` (``make_peer(params)``) on copies of the demo GPT's parameters, one
    thread: each one's parameters, the steppers, and ``set_grads(step)`` giving all three the same fresh gradients."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(config_for_params(millions))
    names = ("AdamW fp32", "ours int8", peer)
    params = {name: [p.detach().clone().requires_grad_() for p in model.parameters()] for name in names}
    steppers: dict[str, Any] = {
        names[0]: torch.optim.AdamW(params[names[0]], lr=1e-4),
        names[1]: ZeroRedundancyOptimizer(params[names[1]], torch.optim.AdamW, state_format="int8", lr=1e-4),
        peer: make_peer(params[peer]),
    }
    shapes = [p.shape for p in params[names[0]]]

    def set_grads(step: int) -> None:
        grads = _grads(shapes, step)
        for name in names:
            for param, grad in zip(params[name], grads):
                param.grad = grad.clone()

    return params, steppers, set_grads


def _torchao_one_process(context: Any, millions: float, iters: int) -> dict[str, Any]:
    with _cold_compile_cache():
        return _torchao_one_process_body(millions, iters)


def _torchao_one_process_body(millions: float, iters: int) -> dict[str, Any]:
    from torchao.optim import AdamW8bit

    names = ("AdamW fp32", "ours int8", "torchao AdamW8bit")
    params, steppers, set_grads = _beside_adamw(millions, names[2], lambda ps: AdamW8bit(ps, lr=1e-4, block_size=256))
    shapes = [p.shape for p in params[names[0]]]
    first, ms, _ = _timed_steps(steppers, set_grads, iters)
    tao_bytes, tao_quantized = _torchao_bytes(steppers[names[2]])

    def apart(a: str, b: str) -> float:
        return max(float((x - y).abs().max()) for x, y in zip(params[a], params[b]))

    return {
        "numel": sum(p.numel() for p in params[names[0]]),
        "params": len(shapes),
        "bytes": {
            names[0]: _plain_bytes(steppers[names[0]]),
            names[1]: _state_bytes(steppers[names[1]]),
            names[2]: tao_bytes,
        },
        "quantized": {names[1]: sum(s.numel() >= 4096 for s in shapes), names[2]: tao_quantized},
        "first": first,
        "ms": ms,
        "apart": {
            "ours - torchao": apart(names[1], names[2]),
            "ours - AdamW": apart(names[1], names[0]),
            "torchao - AdamW": apart(names[2], names[0]),
        },
        "steps": iters + 2,
    }


def _torchao_fsdp2(context: Any, millions: float, iters: int) -> dict[str, Any]:
    """FSDP2 (``fully_shard`` on each block and the root, gloo, CPU) with AdamW and AdamW8bit, and ZeRO fp32 / int8,
    in the same ranks; FSDP2's step is the local optimizer's only, ZeRO's includes its parameter sync."""
    with _cold_compile_cache():
        return _torchao_fsdp2_body(millions, iters)


def _torchao_fsdp2_body(millions: float, iters: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor
    from torchao.optim import AdamW8bit

    torch.set_num_threads(1)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    base = GPT(config_for_params(millions))
    models = {}
    for name in ("FSDP2 + AdamW", "FSDP2 + AdamW8bit"):
        model = GPT(config_for_params(millions))
        model.load_state_dict(base.state_dict())
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        models[name] = fully_shard(model, mesh=mesh)
    zero_params = {fmt: [p.detach().clone().requires_grad_() for p in base.parameters()] for fmt in ("fp32", "int8")}
    steppers: dict[str, Any] = {
        "FSDP2 + AdamW": torch.optim.AdamW(models["FSDP2 + AdamW"].parameters(), lr=1e-4),
        "FSDP2 + AdamW8bit": AdamW8bit(models["FSDP2 + AdamW8bit"].parameters(), lr=1e-4, block_size=256),
        **{
            f"ZeRO {fmt}": ZeroRedundancyOptimizer(
                zero_params[fmt], torch.optim.AdamW, partition="even", state_format=fmt, lr=1e-4
            )
            for fmt in ("fp32", "int8")
        },
    }
    shapes = [p.shape for p in base.parameters()]

    def set_grads(step: int) -> None:
        grads = _grads(shapes, step)
        for model in models.values():
            for param, grad in zip(model.parameters(), grads):
                param.grad = distribute_tensor(grad, param.device_mesh, param.placements)
        for own in zero_params.values():
            for param, grad in zip(own, grads):
                param.grad = grad.clone()

    first, ms, _ = _timed_steps(steppers, set_grads, iters)
    full = [p.full_tensor() for p in models["FSDP2 + AdamW8bit"].parameters()]
    tao_bytes, tao_quantized = _torchao_bytes(steppers["FSDP2 + AdamW8bit"])
    return {
        "first": first,
        "ms": ms,
        "bytes": {
            "FSDP2 + AdamW": sum(
                v.to_local().numel() * v.element_size()
                for e in steppers["FSDP2 + AdamW"].state.values()
                for v in e.values()
                if hasattr(v, "to_local")
            ),
            "FSDP2 + AdamW8bit": tao_bytes,
            "ZeRO fp32": _state_bytes(steppers["ZeRO fp32"]),
            "ZeRO int8": _state_bytes(steppers["ZeRO int8"]),
        },
        "quantized": tao_quantized,
        "apart": max(float((x - y).abs().max()) for x, y in zip(full, zero_params["int8"])),
    }


def _torchao_comparison(millions: float, iters: int) -> None:
    try:
        import torchao  # optional: only this comparison uses it
        from torchao.optim import AdamW8bit  # noqa: F401
    except Exception as error:  # absent, or built for another torch
        print(f"torchao: not importable ({type(error).__name__}: {error}); its comparison skipped")
        return
    print(f"\ntorchao {torchao.__version__}: AdamW8bit(block_size=256) beside ours, one process (world size 1)")
    one = run_ranks(_torchao_one_process, 1, (millions, iters), timeout_s=3600.0)[0]
    base_bytes, base_ms = one["bytes"]["AdamW fp32"], one["ms"]["AdamW fp32"]
    print("optimizer | state MiB | x AdamW | 8-bit params | first step s | step ms (median) | x AdamW")
    for name in one["ms"]:
        quantized = one["quantized"].get(name, 0)
        print(
            f"{name} | {one['bytes'][name] / 2**20:.2f} | {one['bytes'][name] / base_bytes:.3f} | "
            f"{quantized}/{one['params']} | {one['first'][name]:.2f} | {one['ms'][name]:.1f} | "
            f"{one['ms'][name] / base_ms:.2f}"
        )
    apart = ", ".join(f"{k} {v:.3g}" for k, v in one["apart"].items())
    print(f"max |parameter difference| after {one['steps']} steps (lr 1e-4): {apart}")
    try:
        ranks = run_ranks(_torchao_fsdp2, 2, (millions, iters), timeout_s=3600.0)
    except Exception as error:
        print(f"FSDP2 + AdamW8bit at 2 ranks (gloo, CPU) failed: {type(error).__name__}: {error}")
        return
    print("\nFSDP2 (fully_shard per block and root) beside ZeRO, 2 ranks, gloo, CPU; step = optimizer.step() only")
    print("optimizer | state MiB/rank (max) | first step s | step ms (median, slowest rank) | x FSDP2 + AdamW")
    base = ranks[0]["ms"]["FSDP2 + AdamW"]
    for name in ranks[0]["ms"]:
        most = max(r["bytes"][name] for r in ranks)
        print(
            f"{name} | {most / 2**20:.2f} | {ranks[0]['first'][name]:.2f} | {ranks[0]['ms'][name]:.1f} | "
            f"{ranks[0]['ms'][name] / base:.2f}"
        )
    quantized = [r["quantized"] for r in ranks]
    print(
        f"8-bit parameters per rank (torchao decides on each shard): {quantized}; max |FSDP2 + AdamW8bit - ZeRO int8| "
        f"after {iters + 2} steps: {ranks[0]['apart']:.3g}"
    )


def _bitsandbytes_one_process(context: Any, millions: float, iters: int) -> dict[str, Any]:
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnb_functional

    from distoptim.zero import codecs

    _, steppers, set_grads = _beside_adamw(
        millions, "bitsandbytes AdamW8bit", lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-4, min_8bit_size=codecs.MIN_NUMEL)
    )
    _, ms, _ = _timed_steps(steppers, set_grads, iters)
    values, scratch = torch.randn(1 << 20) * 1e-3, codecs.Scratch(1 << 22)

    def ours() -> None:
        scratch.reset()
        codecs.decode("exp_avg", codecs.encode("exp_avg", values, "int8", scratch), "int8", torch.float32, scratch)

    def theirs() -> None:
        bnb_functional.dequantize_blockwise(*bnb_functional.quantize_blockwise(values, blocksize=codecs.BLOCK))

    codec_ms = {}
    for name, codec in (("ours", ours), ("bitsandbytes", theirs)):
        codec()
        codec_ms[name] = 1e3 * statistics.median(_seconds(codec) for _ in range(9))
    return {"ms": ms, "codec_ms": codec_ms, "version": bnb.__version__}


def _seconds(work: Any) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def _bitsandbytes_comparison(millions: float, iters: int) -> None:
    try:
        import bitsandbytes  # noqa: F401  (optional: only this comparison uses it)
    except Exception as error:
        print(f"bitsandbytes: not importable ({type(error).__name__}: {error}); its comparison skipped")
        return
    one = run_ranks(_bitsandbytes_one_process, 1, (millions, iters), timeout_s=3600.0)[0]
    base = one["ms"]["AdamW fp32"]
    print(f"\nbitsandbytes {one['version']} (its CPU backend): AdamW8bit beside ours, one process, one thread")
    print("optimizer | step ms (median) | x AdamW")
    for name, ms in one["ms"].items():
        print(f"{name} | {ms:.1f} | {ms / base:.2f}")
    codec = one["codec_ms"]
    print(
        f"blockwise int8 encode + decode of 2^20 elements (block 256): ours {codec['ours']:.1f} ms, bitsandbytes "
        f"{codec['bitsandbytes']:.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--params-millions", type=float, default=8.0)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--partition", choices=("even", "greedy"), default="even")
    parser.add_argument("--no-torchao", action="store_true", help="skip the comparison with torchao's AdamW8bit")
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, the demo's GPT shapes (--params-millions {args.params_millions}), AdamW, "
        f"partition={args.partition}"
    )
    print("world | format | state MiB/rank (max) | x fp32 | step ms (median) | x fp32 | parameters")
    for world_size in args.world_sizes:
        ranks = run_ranks(_rank, world_size, (args.params_millions, args.iters, args.partition), timeout_s=1800.0)
        for fmt in FORMATS:
            most = max(r["bytes"][fmt] for r in ranks)
            fp32 = max(r["bytes"]["fp32"] for r in ranks)
            ms, base = ranks[0]["ms"][fmt], ranks[0]["ms"]["fp32"]
            print(
                f"{world_size:5} | {fmt:6} | {most / 2**20:20.2f} | {most / fp32:6.3f} | {ms:16.1f} | {ms / base:6.2f}"
                f" | {ranks[0]['numel']:,}"
            )
    print("\nworld | format | peak RSS MiB/rank (max) | of which the optimizer's (peak - before it) | x fp32")
    for world_size in args.world_sizes:
        grown = {}
        for fmt in FORMATS:
            ranks = run_ranks(_peak_rss, world_size, (args.params_millions, fmt, args.partition, 3), timeout_s=1800.0)
            peak, grown[fmt] = max(r["peak"] for r in ranks), max(r["peak"] - r["before"] for r in ranks)
            print(
                f"{world_size:5} | {fmt:6} | {peak / 2**20:23.1f} | {grown[fmt] / 2**20:43.1f} | "
                f"{grown[fmt] / grown['fp32']:6.3f}"
            )
    _bitsandbytes_comparison(args.params_millions, args.iters)
    if args.no_torchao:
        print("torchao: --no-torchao, its comparison skipped")
    else:
        _torchao_comparison(args.params_millions, args.iters)


if __name__ == "__main__":
    main()
