"""Peak extra memory of ``consolidate_state_dict`` on every rank, against that rank's own shard of the state.

.venv/bin/python benchmarks/consolidation_memory.py --world-sizes 2 4 --params-millions 20

Each rank holds the GPT-shaped model of bench_zero.py and ZeroRedundancyOptimizer(Adam) after one step. Around
``consolidate_state_dict(to=0)`` it resets its peak resident set (``echo 5 > /proc/self/clear_refs`` resets VmHWM to
the current VmRSS) and reads VmHWM afterwards. Extra memory = peak growth less what the consolidated result itself
newly holds (the storages received from other ranks, on rank 0 only). glibc is set to serve every allocation over
64 KiB with its own mmap, returned on free (``mallopt(M_MMAP_THRESHOLD)``, which also stops the threshold from
drifting), and freed heap is trimmed first, so resident memory follows live tensors instead of allocator caches.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist

from distoptim import ZeroRedundancyOptimizer
from distoptim.demo.config import GPTConfig, config_for_params
from distoptim.demo.model import GPT
from tests._dist import run_on_ranks

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        match = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE)
    assert match is not None, field
    return int(match.group(1))


def _tensor_bytes(state: Any) -> int:
    return sum(v.numel() * v.element_size() for entry in state.values() for v in entry.values() if torch.is_tensor(v))


def _received_bytes(consolidated: dict[int, dict[str, Any]], local: Any) -> int:
    """Bytes of the storages in the consolidated state that are not the local optimizer's own tensors."""
    own = {v.untyped_storage().data_ptr() for entry in local.values() for v in entry.values() if torch.is_tensor(v)}
    storages = {
        v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
        for entry in consolidated.values()
        for v in entry.values()
        if torch.is_tensor(v)
    }
    return sum(nbytes for pointer, nbytes in storages.items() if pointer not in own)


def measure_peak(action: Callable[[], object]) -> tuple[int, float]:
    """Peak resident growth (bytes) and seconds of ``action()``, every rank starting together after a trim."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # resets VmHWM to the current VmRSS
    start_kib = _status_kib("VmRSS")
    started = time.perf_counter()
    action()
    return (_status_kib("VmHWM") - start_kib) * 1024, time.perf_counter() - started


def model_config(doc: str) -> tuple[argparse.Namespace, GPTConfig]:
    """The memory benchmarks' command line (``--world-sizes``, ``--params-millions``) and the model it asks for."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--params-millions", type=float, default=20.0)
    args = parser.parse_args()
    config = config_for_params(args.params_millions)
    print(f"GPT-shaped model, {config.num_params / 1e6:.1f}M fp32 parameters; Adam state after one step")
    return args, config


def _rank(rank: int, world_size: int, config: GPTConfig) -> dict[str, float]:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(_M_MMAP_THRESHOLD, 64 << 10)
    torch.manual_seed(0)
    model = GPT(config)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-4)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    zero.step()
    zero.zero_grad()
    peak_bytes, seconds = measure_peak(lambda: zero.consolidate_state_dict(to=0))
    received = _received_bytes(zero.state_dict()["state"], zero.state) if rank == 0 else 0
    dist.barrier()
    return {
        "shard": _tensor_bytes(zero.state),
        "received": received,
        "extra": peak_bytes - received,
        "seconds": seconds,
    }


def main() -> None:
    args, config = model_config(__doc__)
    print(f"{'world':>5} {'rank':>4} {'shard MB':>9} {'received MB':>11} {'extra MB':>9} {'extra/shard':>11} {'s':>6}")
    for world_size in args.world_sizes:
        for rank, row in enumerate(run_on_ranks(_rank, world_size, config, timeout=600)):
            print(
                f"{world_size:>5} {rank:>4} {row['shard'] / 1e6:>9.1f} {row['received'] / 1e6:>11.1f} "
                f"{row['extra'] / 1e6:>9.1f} {row['extra'] / row['shard']:>11.3f} {row['seconds']:>6.2f}"
            )


if __name__ == "__main__":
    main()
