"""What each rank reports after training, and the closing table built from all ranks' reports (no torch here)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["RankReport", "format_bytes", "format_table"]


@dataclass
class RankReport:
    """One rank's figures: per-step losses and times, the state it holds, a checksum of its parameters."""

    rank: int
    losses: list[float]
    step_times: list[float]
    train_s: float  # wall time of the training loop
    held_out_loss: float
    state_bytes: int  # tensor bytes in this rank's local optimizer state
    owned_numel: int  # parameter elements this rank owns (updates and keeps state for)
    num_params: int  # parameter elements of the whole model
    num_tensors: int  # parameter tensors of the whole model
    checksum: float  # of all parameters after training: equal on every rank if sync worked


def format_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(count) < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


def format_table(reports: Sequence[RankReport]) -> str:
    """Loss, optimizer-state bytes per rank against unsharded AdamW, and step time."""
    world_size = len(reports)
    first = reports[0]
    unsharded = sum(report.state_bytes for report in reports)  # every parameter's state lives on exactly one rank
    analytic = 2 * 4 * first.num_params + 4 * first.num_tensors  # exp_avg, exp_avg_sq (fp32) + a step scalar each
    lines = [f"{'rank':>6}  {'params owned':>14}  {'optimizer state':>15}  {'of unsharded AdamW':>18}"]
    for report in reports:
        share = report.state_bytes / unsharded if unsharded else 0.0
        lines.append(
            f"{report.rank:>6}  {report.owned_numel:>14,}  {format_bytes(report.state_bytes):>15}  {share:>17.1%}"
        )
    lines.append(
        f"{'all':>6}  {first.num_params:>14,}  {format_bytes(unsharded):>15}  "
        f"(unsharded AdamW holds {format_bytes(analytic)} on every rank)"
    )
    steps = len(first.losses)
    tail = max(1, steps // 10)
    start = statistics.mean(report.losses[0] for report in reports)
    end = statistics.mean(loss for report in reports for loss in report.losses[-tail:])
    held_out = statistics.mean(report.held_out_loss for report in reports)
    step_ms = statistics.median(max(times) for times in zip(*(r.step_times for r in reports))) * 1000
    in_sync = len({report.checksum for report in reports}) == 1
    lines += [
        "",
        f"loss (nats/char, mean of the ranks)  first step {start:.3f}, last {tail} step(s) {end:.3f}, "
        f"held-out {held_out:.3f}",
        f"step time         median {step_ms:.0f} ms (forward + backward + step + sync, slowest of "
        f"{world_size} rank(s)), {steps} steps in {max(r.train_s for r in reports):.1f} s",
        f"parameters        {'identical' if in_sync else 'DIFFERENT'} on all ranks after training "
        f"(checksum {first.checksum!r})",
    ]
    return "\n".join(lines)
