"""``python -m distoptim plan``: bytes per rank and bytes sent per step for DDP, ZeRO-1,
``ShardedDataParallel`` and FSDP2, and which of them fit in a GPU's memory (activations not counted)."""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, NoReturn

import torch

from distoptim.plan.figures import ModePlan, PlanConfig, RankMemory, dtype_name, step_dtype
from distoptim.plan.inventory import Inventory, from_factory, load_factory, transformer
from distoptim.plan.memory import plan_modes, takes_muon
from distoptim.plan.state import OptimizerSpec, resolve_optimizer, state_cost
from distoptim.zero.codecs import FORMATS
from distoptim.zero.partition import MODES as PARTITIONS

__all__ = ["main", "parse_bytes", "parse_count", "parse_dtype"]

PROG = "python -m distoptim plan"
DTYPES = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}  # fmt: skip
BYTE_UNITS = {
    "": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def _parse(text: str, units: dict[str, int], what: str, example: str) -> int:
    match = _NUMBER.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in units:
        choices = ", ".join(u for u in units if u) or "none"
        raise ValueError(f"bad {what} {text!r}: a number with an optional unit ({choices}), e.g. {example}")
    value = float(match.group(1)) * units[unit]
    if not math.isfinite(value):
        raise ValueError(f"bad {what} {text!r}: too large")
    return round(value)


def parse_bytes(text: str) -> int:
    """``"80GB"`` (10^9), ``"80GiB"`` (2^30), ``"512MiB"``, ``"1e9"`` (bytes) -> bytes."""
    return _parse(text, BYTE_UNITS, "size", "80GiB or 80e9")


def parse_count(text: str) -> int:
    """``"7e9"``, ``"7B"``, ``"1.3b"``, ``"125M"`` -> a parameter count."""
    return _parse(text, COUNT_UNITS, "parameter count", "7e9 or 7B")


def parse_dtype(text: str) -> torch.dtype:
    dtype = DTYPES.get(text.lower())
    if dtype is None:
        raise ValueError(f"unknown dtype {text!r}: choose fp32, bf16 or fp16 (or float32, bfloat16, float16)")
    return dtype


def _optimizer_argument(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise ValueError(f"bad --optimizer-arg {text!r}: expected KEY=VALUE, e.g. momentum=0.9")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise ValueError(f"bad --optimizer-arg {text!r}: VALUE must be a Python literal (0.9, True, ...)") from None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit status 2, as for the planner's own errors
        raise ValueError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__.split("\n\n")[0].replace("``", ""))
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--params", help="parameter count (7e9, 7B, 125M): modelled as a GPT-style transformer")
    source.add_argument("--model", help="package.module:factory returning an nn.Module (built on the meta device)")
    parser.add_argument("--world-size", required=True, type=int, help="data-parallel ranks")
    parser.add_argument("--optimizer", default="adamw", help="adamw (default), adam, sgd, sgd-momentum, adagrad, ...")
    parser.add_argument(
        "--optimizer-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an optimizer setting that changes its state (momentum=0.9, centered=True); repeatable",
    )
    parser.add_argument("--muon", action="store_true", help="Muon on the blocks' matrices, --optimizer on the rest")
    parser.add_argument("--dtype", help="parameter dtype: fp32, bf16, fp16 (default: the model's own, or fp32)")
    parser.add_argument("--master-dtype", help="step master copies in this dtype (fp32 for a bf16 model)")
    parser.add_argument("--partition", default="even", choices=PARTITIONS, help="ZeRO's partition (default here: even)")
    parser.add_argument("--gpu-memory", help="memory per GPU (80GiB, 80GB = 80e9 bytes): which modes fit")
    parser.add_argument("--gradient-as-bucket-view", action="store_true", help="DDP's option (default off)")
    parser.add_argument("--parameters-as-bucket-view", action="store_true", help="ZeRO's option (default off)")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="ShardedDataParallel's (default 25)")
    parser.add_argument("--reduce-dtype", help="ShardedDataParallel's and FSDP2's gradient reduction dtype")
    parser.add_argument("--state-format", default="fp32", choices=FORMATS, help="ZeRO's state_format (default fp32)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Run the planner; exit status 2 with one line on stderr for bad input."""
    try:
        args = _parser().parse_args(argv)
        report = _report(args)
    except SystemExit as exit_:  # --help
        return exit_.code if isinstance(exit_.code, int) else 0
    except ValueError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0


def _report(args: argparse.Namespace) -> dict[str, Any]:
    dtype = parse_dtype(args.dtype) if args.dtype else None
    master = parse_dtype(args.master_dtype) if args.master_dtype else None
    if args.model:
        inventory = from_factory(load_factory(args.model), args.model).cast(dtype)
    else:
        inventory = transformer(parse_count(args.params), dtype or torch.float32)
    optimizer = resolve_optimizer(args.optimizer, dict(map(_optimizer_argument, args.optimizer_arg)))
    if not 0 < args.bucket_cap_mb * 2**20 < math.inf:  # nan, inf and overflowing sizes too
        raise ValueError(f"--bucket-cap-mb must be positive, got {args.bucket_cap_mb}")
    config = PlanConfig(
        world_size=args.world_size,
        optimizer=optimizer,
        master_dtype=master,
        partition=args.partition,
        gradient_as_bucket_view=args.gradient_as_bucket_view,
        parameters_as_bucket_view=args.parameters_as_bucket_view,
        bucket_cap_mb=args.bucket_cap_mb,
        reduce_dtype=parse_dtype(args.reduce_dtype) if args.reduce_dtype else None,
        muon=OptimizerSpec(torch.optim.Muon) if args.muon else None,
        state_format=args.state_format,
    )
    return build_report(inventory, config, parse_bytes(args.gpu_memory) if args.gpu_memory else None)


def build_report(inventory: Inventory, config: PlanConfig, gpu_memory: int | None) -> dict[str, Any]:
    """Everything the table shows, as plain data (what ``--json`` prints)."""
    master = config.master_dtype
    dtypes = sorted({step_dtype(p, master) for p in inventory.params if p.trainable}, key=str)
    state_bytes = _state_bytes(config.optimizer, dtypes)
    muon = None
    if config.muon is not None:
        muon = {
            "optimizer": config.muon.name,
            "matrices": sum(1 for p in inventory.params if takes_muon(p)),
            "takes": "every 2-D parameter of the blocks (children of an nn.ModuleList)",
            "state_bytes": _state_bytes(config.muon, dtypes),
        }
    return {
        "model": inventory.description,
        "parameters": inventory.numel,
        "trainable_parameters": sum(p.numel for p in inventory.params if p.trainable),
        "parameter_dtypes": sorted({dtype_name(p.dtype) for p in inventory.params}),
        "world_size": config.world_size,
        "optimizer": config.optimizer.name,
        "state_bytes": state_bytes,
        "state_format": config.state_format,
        "format_state_bytes": _state_bytes(config.optimizer, dtypes, config.state_format),
        "muon": muon,
        "master_dtype": None if master is None else dtype_name(master),
        "partition": config.partition,
        "gpu_memory": gpu_memory,
        "counted": "parameters, gradients, optimizer state, master weights, communication buffers",
        "not_counted": "activations, CUDA context, allocator fragmentation, torch.optim's temporaries in step(), "
        "a state format's decode buffers (up to 4M elements per state key)",
        "modes": [_mode_report(mode, gpu_memory) for mode in plan_modes(inventory, config)],
    }


def _state_bytes(
    optimizer: OptimizerSpec, dtypes: list[torch.dtype], state_format: str = "fp32"
) -> dict[str, dict[str, Any]]:
    return {dtype_name(dtype): asdict(state_cost(optimizer, dtype, state_format)) for dtype in dtypes}


def _memory(memory: RankMemory) -> dict[str, Any]:
    return {
        "params": memory.params,
        "grads": memory.grads,
        "optimizer_state": memory.state,
        "master": memory.master,
        "other": dict(memory.other),
        "total": memory.total,
    }


def _mode_report(mode: ModePlan, gpu_memory: int | None) -> dict[str, Any]:
    rank, peak = mode.peak()
    flops = mode.newton_schulz  # with Muon; the balance: the largest rank's share over the mean (1.0: even)
    return {
        "mode": mode.key,
        "title": mode.title,
        "peak_rank": rank,
        "peak": _memory(peak),
        "fits": None if gpu_memory is None else peak.total <= gpu_memory,
        "sends_per_step": mode.sends_total,
        "sends": dict(mode.sends),
        "gloo_received_per_rank": list(mode.gloo_received) or None,
        "notes": list(mode.notes),
        "ranks": [_memory(memory) for memory in mode.ranks] if len(set(mode.ranks)) > 1 else "all ranks alike",
        "newton_schulz_flops": list(flops) or None,
        "newton_schulz_balance": max(flops) * len(flops) / sum(flops) if sum(flops) else None,
    }


def _human(count: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(count) < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1024
    return f"{count:.2f} GiB"


def _table(report: dict[str, Any]) -> str:
    gpu = report["gpu_memory"]
    costs = "; ".join(
        f"{c['per_element']} B per element + {c['per_tensor']} B per tensor in {name}"
        for name, c in report["state_bytes"].items()
    )
    master = f", master weights in {report['master_dtype']}" if report["master_dtype"] else ""
    if report["state_format"] != "fp32":
        master += f", ZeRO's state in {report['state_format']} (parameters of 4,096 elements or more)"
        costs += f"; in {report['state_format']}: " + "; ".join(
            f"{c['per_element']:.4g} B per element + {c['per_block']} B per block of 256 in {name}"
            for name, c in report["format_state_bytes"].items()
        )
    lines = [
        f"model: {report['model']}",
        f"{report['world_size']} ranks, {report['optimizer']}{master}, "
        f"parameters in {', '.join(report['parameter_dtypes'])}, ZeRO partition: {report['partition']}",
        f"optimizer state (measured by stepping torch.optim): {costs}",
    ]
    if muon := report["muon"]:
        states = "; ".join(f"{c['per_element']} B per element in {name}" for name, c in muon["state_bytes"].items())
        lines.append(
            f"Muon on {muon['takes']}: {muon['matrices']} matrices, {report['optimizer']} on the rest; "
            f"Muon's state: {states}"
        )
    lines += ["", "per rank (the rank holding the most); activations are NOT counted"]
    header = ["mode", "params", "grads", "optim state", "master", "other", "total", "sent/step"]
    header += ["NS GFLOP/step"] if muon else []  # the busiest rank's
    header += [f"fits {_human(gpu)}"] if gpu is not None else []
    rows = [header]
    for mode in report["modes"]:
        peak = mode["peak"]
        row = [mode["title"], *(_human(peak[k]) for k in ("params", "grads", "optimizer_state", "master")),
               _human(sum(peak["other"].values())), _human(peak["total"]), _human(mode["sends_per_step"])]  # fmt: skip
        row += [f"{max(mode['newton_schulz_flops']) / 1e9:.2f}"] if muon else []
        row += ["yes" if mode["fits"] else "no"] if gpu is not None else []
        rows.append(row)
    widths = [max(map(len, column)) for column in zip(*rows)]
    lines += [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    lines += ["", "what each mode holds and sends:"]
    for mode in report["modes"]:
        lines.append(f"  {mode['title']} (rank {mode['peak_rank']}):")
        lines += [f"    - {note}" for note in mode["notes"]]
        lines += [f"    - other: {name} {_human(size)}" for name, size in mode["peak"]["other"].items()]
        lines += [f"    - sends: {name} {_human(size)}" for name, size in mode["sends"].items()]
        if gloo := mode["gloo_received_per_rank"]:
            busiest = max(range(len(gloo)), key=lambda rank: (gloo[rank], -rank))
            lines.append(
                f"    - on gloo (point to point; through aggregators where shares are unequal): rank {busiest}, the "
                f"busiest, receives {_human(gloo[busiest])} a step"
            )
    if muon:
        lines += ["", "Newton-Schulz work per step, GFLOP by rank (max/mean: the balance):"]
        for mode in report["modes"]:
            flops = mode["newton_schulz_flops"]
            shown = ", ".join(f"{f / 1e9:.2f}" for f in flops[:8]) + (", ..." if len(flops) > 8 else "")
            balance = mode["newton_schulz_balance"]  # None: no trainable matrix for Muon
            lines.append(f"  {mode['title']}: {shown} (max/mean {'-' if balance is None else f'{balance:.3f}'})")
    return "\n".join(lines)
