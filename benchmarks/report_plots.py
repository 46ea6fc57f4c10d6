"""The report's figures, one PNG each, drawn from report.py's data (plain dicts, as in report.json).

Every figure carries a caption line with the machine, versions, backend, date and the command that made it.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

__all__ = ["FIGURES", "caption", "render_all", "variant_styles"]

MB = 1e6
FIGURES = {
    "step_time": "step_time.png",
    "state_bytes": "state_bytes.png",
    "comm_bytes": "comm_bytes.png",
    "memory": "memory.png",
    "partition_balance": "partition_balance.png",
    "peers": "peers.png",
    "muon": "muon.png",
}
_MARKERS = "os^vD<>ph*XP8"
_COLORS = (  # tab10, then darker ones: distinct for a dozen variants
    "#1f77b4", "#d62728", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
    "#393b79", "#637939", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354", "#756bb1", "#636363", "#9c9ede",
)  # fmt: skip
_LIVE = ("params", "grads", "state", "master", "buffers")
_LIVE_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3")
_COMPONENTS = ("params", "grads", "state", "master")
_COMPONENT_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52")


def caption(machine: dict[str, Any]) -> str:
    """One or two lines: where, with what, when, and how it was made."""
    load = machine.get("load_average")
    where = (
        f"{machine['cpus']} CPUs ({machine['cpu_model']})"
        + (f", load {load:.1f} at start" if load is not None else "")
        + f"; torch {machine['torch']}, distoptim {machine['distoptim']} ({machine['git']}); {machine['backend']};"
        f" {machine['date']}"
    )
    return where + "\n" + "\n".join(textwrap.wrap("$ " + machine["command"], 150))


def variant_styles(names: list[str]) -> dict[str, dict[str, Any]]:
    """A colour, marker and line style per variant, the same in every figure: torch's dashed, the baseline black."""
    styles = {}
    others = [name for name in names if name != "ddp-adamw"]
    for index, name in enumerate(others):
        styles[name] = {"color": _COLORS[index % len(_COLORS)], "marker": _MARKERS[index % len(_MARKERS)]}
        if name.startswith("torch"):
            styles[name]["linestyle"] = "--"
    if "ddp-adamw" in names:
        styles["ddp-adamw"] = {"color": "black", "marker": "o"}
    return styles


def _finish_with_legend(
    fig: Figure, ax: Axes, machine: dict[str, Any], path: Path, right: float, bottom: float
) -> Path:
    """A y grid, the legend right of the axes, the layout, then ``_finish``."""
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.subplots_adjust(left=0.07, right=right, top=0.92, bottom=bottom)
    return _finish(fig, machine, path)


def _finish(fig: Figure, machine: dict[str, Any], path: Path) -> Path:
    fig.text(0.01, 0.005, caption(machine), fontsize=6.5, va="bottom", ha="left", color="#444444")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _results(data: dict[str, Any]) -> tuple[list[str], list[int], dict[tuple[str, int], dict[str, Any]]]:
    results = data["bench"]["results"]
    names = list(dict.fromkeys(r["variant"] for r in results))
    sizes = sorted({int(r["world_size"]) for r in results})
    return names, sizes, {(r["variant"], int(r["world_size"])): r for r in results}


def _oversubscribed(ax: Any, sizes: list[int], cpus: int, positions: list[float]) -> None:
    over = [x for n, x in zip(sizes, positions) if n > cpus]
    if over:
        ax.axvspan(min(over) - 0.5, max(over) + 0.5, color="#eeeeee", zorder=0)
        ax.text(min(over) - 0.45, ax.get_ylim()[1], f" ranks > {cpus} cores", va="top", fontsize=7, color="#666666")


def step_time(data: dict[str, Any], path: Path) -> Path:
    """Median backward + step + sync (slowest rank) against world size, one line per variant."""
    names, sizes, by_key = _results(data)
    styles = variant_styles(names)
    fig, ax = plt.subplots(figsize=(11, 6.2))
    positions = list(range(len(sizes)))
    for name in names:
        ys = [by_key[(name, n)]["median_total_ms"] if (name, n) in by_key else float("nan") for n in sizes]
        ax.plot(positions, ys, label=name, linewidth=2.2 if name == "ddp-adamw" else 1.4, **styles[name])
    ax.set_xticks(positions, [f"N={n}" for n in sizes])
    ax.set_xlim(-0.5, len(sizes) - 0.5)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("ms per iteration (median; slowest rank)")
    ax.set_title(f"Step time: backward (with DDP's gradient reduction) + step + parameter sync{_model(data)}")
    _oversubscribed(ax, sizes, data["machine"]["cpus"], positions)
    return _finish_with_legend(fig, ax, data["machine"], path, right=0.74, bottom=0.16)


def state_bytes(data: dict[str, Any], path: Path) -> Path:
    """Optimizer-state bytes per rank: largest and smallest rank per variant, the ideal (unsharded / N) as a line."""
    names, sizes, by_key = _results(data)
    styles = variant_styles(names)
    fig, ax = plt.subplots(figsize=(11, 6.2))
    width = 0.8 / len(names)
    for group, n in enumerate(sizes):
        for index, name in enumerate(names):
            if (name, n) not in by_key:
                continue
            r, x = by_key[(name, n)], group - 0.4 + (index + 0.5) * width
            low, high = r["state_bytes_min"] / MB, r["state_bytes_max"] / MB
            color = styles[name]["color"]
            ax.vlines(x, low, high, color=color, linewidth=2)
            ax.plot([x], [high], marker=styles[name]["marker"], color=color, label=name if group == 0 else None)
            ax.plot([x], [low], marker=styles[name]["marker"], color=color, fillstyle="none")
        ideal = next(by_key[(name, n)]["state_bytes_ideal"] for name in names if (name, n) in by_key) / MB
        label = "ideal: unsharded / N" if group == 0 else None
        ax.hlines(ideal, group - 0.45, group + 0.45, color="gray", linestyle=":", label=label)
    ax.set_xticks(range(len(sizes)), [f"N={n}" for n in sizes])
    ax.set_ylim(bottom=0)
    ax.set_ylabel("AdamW state per rank, MB (filled: largest rank, hollow: smallest)")
    ax.set_title(f"Optimizer state per rank{_model(data)}")
    return _finish_with_legend(fig, ax, data["machine"], path, right=0.74, bottom=0.16)


def comm_bytes(data: dict[str, Any], path: Path) -> Path:
    """Bytes each rank communicates per step, over what DDP's gradient all-reduce alone costs (fp32); the variants
    whose bytes are counted (not the peers)."""
    names, sizes, by_key = _results(data)
    styles = variant_styles(names)
    names = [
        name
        for name in names
        if any(r["comm_bytes_per_rank_per_step"] is not None for (v, _), r in by_key.items() if v == name)
    ]
    fig, ax = plt.subplots(figsize=(11, 6.2))
    width = 0.8 / len(names)
    labels = []
    for group, n in enumerate(sizes):
        ddp = by_key[("ddp-adamw", n)]["comm_bytes_per_rank_per_step"] if ("ddp-adamw", n) in by_key else None
        labels.append(f"N={n}" + (f"\n(DDP all-reduce: {ddp / MB:.1f} MB)" if ddp else ""))
        for index, name in enumerate(names):
            if (name, n) not in by_key or not ddp or by_key[(name, n)]["comm_bytes_per_rank_per_step"] is None:
                continue
            ratio = by_key[(name, n)]["comm_bytes_per_rank_per_step"] / ddp
            x = group - 0.4 + (index + 0.5) * width
            ax.bar(x, ratio, width * 0.9, color=styles[name]["color"], label=name if group == 0 else None)
            ax.text(x, ratio, f"{ratio:.2f}", ha="center", va="bottom", fontsize=6, rotation=90)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
    ax.set_xticks(range(len(sizes)), labels)
    ax.set_ylim(0, 1.9)
    ax.set_ylabel("bytes per rank per step / DDP's all-reduce")
    ax.set_title(f"Communication per step (received-bytes convention of comm_bytes.py){_model(data)}")
    return _finish_with_legend(fig, ax, data["machine"], path, right=0.74, bottom=0.18)


def memory(data: dict[str, Any], path: Path) -> Path:
    """Per-rank bytes of parameters, gradients, optimizer state and master weights, stacked, per configuration."""
    configs = data["memory_configs"]
    sizes = sorted(int(n) for n in data["memory"])
    fig, ax = plt.subplots(figsize=(11, 6.2))
    width = 0.8 / len(configs)
    for group, n in enumerate(sizes):
        rows = data["memory"][str(n)]
        reference = sum(rows["torch-zero fp32"][c] for c in _COMPONENTS) if "torch-zero fp32" in rows else None
        for index, config in enumerate(configs):
            x, bottom = group - 0.4 + (index + 0.5) * width, 0.0
            for component, color in zip(_COMPONENTS, _COMPONENT_COLORS):
                value = rows[config][component] / MB
                label = component if group == 0 and index == 0 else None
                ax.bar(x, value, width * 0.9, bottom=bottom, color=color, edgecolor="white", label=label)
                bottom += value
            note = f"{bottom:.3g}" + (f"\n{bottom * MB / reference:.2f}x" if reference else "")
            ax.text(x, bottom, note, ha="center", va="bottom", fontsize=7)
            ax.text(x, 0, config.replace(" + ", "\n+ ").replace(" fp32", "\nfp32"), ha="center", va="top", fontsize=6.5)
    ax.set_xticks(range(len(sizes)), [f"\n\n\n\nN={n}" for n in sizes])
    ax.tick_params(axis="x", length=0)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
    ax.set_ylabel("MB per rank (largest rank); labels: total and ratio to torch's ZeRO fp32")
    ax.set_title(f"Per-rank memory from the real buffers after a step{_model(data)}")
    return _finish_with_legend(fig, ax, data["machine"], path, right=0.86, bottom=0.2)


def partition_balance(data: dict[str, Any], path: Path) -> Path:
    """Largest shard over the ideal, GPT-2 124M shapes, 2 to 1,024 ranks (arithmetic: no processes)."""
    balance = data["balance"]
    sizes = balance["world_sizes"]
    fig, ax = plt.subplots(figsize=(11, 6.2))
    styles = {
        "distoptim greedy": {"color": "#1f77b4", "marker": "o", "linewidth": 3.5, "alpha": 0.6},
        "distoptim even": {"color": "#2ca02c", "marker": "s"},
        "torch greedy": {"color": "#d62728", "marker": "x", "linestyle": "--"},
    }
    same = balance["ratios"]["torch greedy"] == balance["ratios"]["distoptim greedy"]
    for name, ratios in balance["ratios"].items():
        label = name + (" (identical to distoptim greedy: same algorithm)" if name == "torch greedy" and same else "")
        ax.plot(sizes, ratios, label=label, **styles.get(name, {}))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sizes[::2], [str(n) for n in sizes[::2]])
    ax.set_xlabel("ranks")
    ax.set_ylabel("largest shard / (total / ranks)")
    ax.set_title(
        f"Partition balance for GPT-2 124M shapes ({balance['num_params']:,} elements in "
        f"{balance['num_tensors']} tensors)"
    )
    ax.grid(which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize=9)
    fig.subplots_adjust(left=0.07, right=0.97, top=0.92, bottom=0.18)
    return _finish(fig, data["machine"], path)


def _model(data: dict[str, Any]) -> str:
    config = data["bench"]["config"]
    millions = data["bench"]["results"][0]["num_params"] / 1e6
    layers = f"{config['layers']} layer" + ("s" if config["layers"] != 1 else "")
    return f"\nGPT-shaped model, {millions:.2f}M parameters ({layers}, width {config['width']})"


def peers(data: dict[str, Any], path: Path) -> Path:
    """Left: whole iteration over torch's ZeRO with bucket views, per N. Right: per-rank memory (live tensor bytes
    stacked by category, peak RSS growth as a marker) on the largest configuration measured."""
    memory = data["peers_memory"]
    same, large = memory["same_model"], memory.get("large")
    reference = same.get("reference", "torch-zero-bucket")
    names = list(dict.fromkeys(r["variant"] for r in same["results"]))
    styles = variant_styles(names)
    timing = {(r["variant"], int(r["world_size"])): r for r in data["bench"]["results"]}
    sizes = sorted({int(r["world_size"]) for r in same["results"]})
    fig, (left, right) = plt.subplots(1, 2, figsize=(15, 6.6), gridspec_kw={"width_ratios": [1, 1.25]})
    width = 0.8 / len(names)
    for group, n in enumerate(sizes):
        ref = timing.get((reference, n))
        for index, name in enumerate(names):
            if (name, n) not in timing or not ref:
                continue
            ratio = timing[(name, n)]["median_iteration_ms"] / ref["median_iteration_ms"]
            x = group - 0.4 + (index + 0.5) * width
            left.bar(x, ratio, width * 0.9, color=styles[name]["color"], label=name if group == 0 else None)
            left.text(x, ratio, f"{ratio:.2f}", ha="center", va="bottom", fontsize=6, rotation=90)
    left.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
    left.set_ylim(0, left.get_ylim()[1] * 1.1)
    left.set_xticks(range(len(sizes)), [f"N={n}" for n in sizes])
    left.set_ylabel(f"whole iteration / {reference} (median, slowest rank)")
    left.set_title(f"Whole iteration (zero_grad + forward + backward + step){_model(data)}", fontsize=10)
    left.grid(axis="y", alpha=0.3)
    left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.07), fontsize=7, ncol=3)
    source = large or same
    n = max(int(r["world_size"]) for r in source["results"])
    rows = [r for r in source["results"] if int(r["world_size"]) == n]
    for x, r in enumerate(rows):
        bottom = 0.0
        for category, color in zip(_LIVE, _LIVE_COLORS):
            value = r["live_bytes"].get(category, 0) / MB
            right.bar(x, value, 0.7, bottom=bottom, color=color, edgecolor="white", label=category if x == 0 else None)
            bottom += value
        growth = r["peak_growth_bytes_max"] / MB
        label = "peak RSS growth beyond the model's parameters" if x == 0 else None
        right.plot([x], [growth], marker="D", color="black", linestyle="none", label=label)
        note = f"live {_short(bottom)}\nRSS {_short(growth)}"
        right.text(x, max(bottom, growth) * 1.03, note, ha="center", va="bottom", fontsize=6.5)
    right.set_xticks(range(len(rows)), [r["variant"] for r in rows], rotation=35, ha="right", fontsize=7.5)
    right.set_ylim(0, right.get_ylim()[1] * 1.35)
    right.set_ylabel("MB per rank (largest rank): live tensors stacked; peak RSS growth")
    params = source["results"][0]["num_params"] / 1e6
    right.set_title(f"Per-rank memory, {params:.1f}M fp32 parameters, AdamW, N={n} (memory-only run)", fontsize=10)
    right.grid(axis="y", alpha=0.3)
    right.legend(loc="upper left", fontsize=7, ncol=3)
    fig.suptitle(
        "FSDP2 and DeepSpeed are built for GPUs (NCCL, CUDA streams, fused kernels, mixed precision): "
        "here CPU + gloo, fp32, one thread per rank",
        fontsize=9,
        color="#a03030",
    )
    fig.subplots_adjust(left=0.06, right=0.98, top=0.86, bottom=0.24, wspace=0.22)
    return _finish(fig, data["machine"], path)


def _short(megabytes: float) -> str:
    return f"{megabytes:.0f}" if megabytes >= 100 else f"{megabytes:.3g}"


def muon(data: dict[str, Any], path: Path) -> Path:
    """Muon + AdamW (bench_muon.py), per model and N: whole iteration and optimizer step over DDP + plain Muon/AdamW
    of the same run, and per-rank memory (peak RSS growth, optimizer state), one bar per variant."""
    results = data["muon"]["results"]
    names = list(dict.fromkeys(r["variant"] for r in results))
    groups = list(dict.fromkeys((r["model"], int(r["world_size"])) for r in results))
    by_key = {(r["variant"], r["model"], int(r["world_size"])): r for r in results}
    colors = {name: ("black" if name == "ddp-muon" else _COLORS[i % len(_COLORS)]) for i, name in enumerate(names)}
    fig, axes = plt.subplots(1, 3, figsize=(17, 6.4))
    panels = (
        ("iteration_over_ddp", "whole iteration / DDP + plain (median, slowest rank)", 1.0, None),
        ("step_over_ideal", "step (with the sync) / (DDP + plain step / N)", 1.0, 1.3),
        ("peak_growth_bytes_max", "MB per rank (largest rank): peak RSS growth; hatched: optimizer state", None, None),
    )
    width = 0.8 / len(names)
    for ax, (key, label, unit, target) in zip(axes, panels):
        for group, (model, n) in enumerate(groups):
            for index, name in enumerate(names):
                r = by_key.get((name, model, n))
                if r is None or r.get(key) is None:
                    continue
                x = group - 0.4 + (index + 0.5) * width
                value = r[key] / (MB if unit is None else 1.0)
                ax.bar(x, value, width * 0.9, color=colors[name], label=name if group == 0 else None)
                if unit is None:  # the memory panel: the state inside the peak
                    ax.bar(x, r["state_bytes_max"] / MB, width * 0.9, color="none", edgecolor="white", hatch="///")
                ax.text(x, value, f"{value:.0f}" if unit is None else f"{value:.2f}", ha="center", va="bottom",
                        fontsize=6, rotation=90)  # fmt: skip
        if unit is not None:
            ax.axhline(unit, color="black", linewidth=0.8, linestyle=":")
        if target is not None:
            ax.axhline(target, color="#a03030", linewidth=0.9, linestyle="--", label=f"target {target}")
        ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
        ax.set_xticks(range(len(groups)), [f"{model} N={n}" for model, n in groups], fontsize=8)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_title("Whole iteration over DDP + plain Muon/AdamW", fontsize=10)
    axes[1].set_title("Optimizer step over the ideal 1/N of DDP + plain's", fontsize=10)
    axes[2].set_title("Per-rank memory", fontsize=10)
    axes[1].legend(loc="upper center", bbox_to_anchor=(0.5, -0.07), fontsize=8, ncol=4)
    fig.suptitle(
        "Muon on the blocks' matrices + AdamW on the rest (bench_muon.py); CPU + gloo, one thread per rank: FSDP2 "
        "and DeepSpeed are built for GPUs",
        fontsize=9,
        color="#a03030",
    )
    fig.subplots_adjust(left=0.05, right=0.99, top=0.88, bottom=0.24, wspace=0.25)
    made = data["muon"]  # it may come from an earlier run (report.py --muon-json): its own command, load, date
    machine = data["machine"] | {"command": made["command"], "load_average": made["load_average"][0]}
    machine |= {key: made[key] for key in ("date", "cpu_model", "git") if key in made}
    return _finish(fig, machine, path)


def render_all(data: dict[str, Any], out: Path) -> list[Path]:
    """Draw the figures into ``out`` (the peers' only when the data has them); return their paths."""
    draw = {
        "step_time": step_time,
        "state_bytes": state_bytes,
        "comm_bytes": comm_bytes,
        "memory": memory,
        "partition_balance": partition_balance,
        "peers": peers,
        "muon": muon,
    }
    optional = {"peers": "peers_memory", "muon": "muon"}
    keys = [key for key in FIGURES if key not in optional or data.get(optional[key])]
    return [draw[key](data, out / FIGURES[key]) for key in keys]
