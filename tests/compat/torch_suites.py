"""Torch's own tests of the APIs distoptim re-implements, run against distoptim inside the ranks.

The test modules ship inside the torch wheel (``torch.testing._internal``); nothing of them is copied. In each rank
the names those modules imported (``averagers``, ``model_averaging_utils``, ``post_localSGD``,
``DistributedOptimizer`` ...) are rebound to distoptim's, and each selected test method runs as torch wrote it, on
an instance of torch's own test class, in a fresh gloo group over 127.0.0.1 (file store).

Torch gates the model-averaging bodies on GPUs although they are device-generic: in the ranks, ``.cuda()``, integer
devices and DDP's ``device_ids`` mean the CPU, and only the outermost ``skip_if_lt_x_gpu`` layer is bypassed. Any
other skip (``__unittest_skip__`` on any layer, a decorator not known here) fails the run: nothing is skipped
unnoticed.
"""

from __future__ import annotations

import os
import re
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import distoptim
import distoptim.averagers
import distoptim.hooks

_INTERNAL = Path(torch.__file__).parent / "testing" / "_internal" / "distributed"
DISTRIBUTED_TEST = _INTERNAL / "distributed_test.py"
"""``torch.testing._internal.distributed.distributed_test``: read as text in the pytest process (importing it there
would need its environment variables)."""

SELECTED = re.compile(
    r"test_average_parameters\w*|test_periodic_model_averager\w*|test_\w*hierarchical_model_averager\w*"
    r"|test_post_localSGD_optimizer_\w*|test_ddp_hook_parity_post_localSGD"
)
"""The model-averaging and post-local-SGD tests of ``distributed_test`` (issue 44)."""

_GPU_GATE = "skip_if_lt_x_gpu.<locals>.decorator.<locals>.wrapper"
_KNOWN_LAYERS = {  # kept: they run (set-up included), and skip only where torch would
    "skip_if_odd_worldsize.<locals>.wrapper",
    "dist_init.<locals>.new_test_method",
}


def selected_distributed_tests() -> list[str]:
    """Every test method of ``distributed_test`` that ``SELECTED`` matches, as the installed torch defines them."""
    names = re.findall(r"^\s+def (test_\w+)\(", DISTRIBUTED_TEST.read_text(), flags=re.MULTILINE)
    return sorted({name for name in names if SELECTED.fullmatch(name)})


# ------------------------------------------------------------------------------- in a rank: the names patched


def patch_distributed_test(module: types.ModuleType) -> None:
    """Rebind the names ``distributed_test`` imported from torch's averaging and post-local-SGD modules."""
    module.averagers = distoptim.averagers  # type: ignore[attr-defined]
    module.hierarchicalSGD = distoptim.averagers  # type: ignore[attr-defined]
    module.model_averaging_utils = distoptim.averagers  # type: ignore[attr-defined]
    module.post_localSGD_optimizer = distoptim  # type: ignore[attr-defined]
    module.post_localSGD = distoptim.hooks  # type: ignore[attr-defined]


def assert_patched(module: types.ModuleType) -> None:
    """The objects torch's test bodies will reach are distoptim's (checked in the rank that runs them)."""
    reached = {
        "averagers.PeriodicModelAverager": module.averagers.PeriodicModelAverager,
        "hierarchicalSGD.HierarchicalModelAverager": module.hierarchicalSGD.HierarchicalModelAverager,
        "model_averaging_utils.average_parameters": module.model_averaging_utils.average_parameters,
        "post_localSGD_optimizer.PostLocalSGDOptimizer": module.post_localSGD_optimizer.PostLocalSGDOptimizer,
        "post_localSGD.PostLocalSGDState": module.post_localSGD.PostLocalSGDState,
        "post_localSGD.post_localSGD_hook": module.post_localSGD.post_localSGD_hook,
    }
    foreign = {name: obj.__module__ for name, obj in reached.items() if not obj.__module__.startswith("distoptim.")}
    assert not foreign, f"torch's tests would reach torch's own objects: {foreign}"


def _on_cpu(device: Any) -> Any:
    """An integer or CUDA device, as torch's GPU-gated bodies pass them, means the CPU here."""
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
        return "cpu"
    return device


class _CpuDistributedDataParallel(nn.parallel.DistributedDataParallel):
    """DDP without ``device_ids`` (a CPU module refuses them); otherwise torch's own."""

    def __init__(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("device_ids", None)
        kwargs.pop("output_device", None)
        super().__init__(module, *args, **kwargs)


def run_gpu_bodies_on_cpu(module: types.ModuleType, world_size: int) -> None:
    """Make this rank's CUDA calls land on the CPU, and its NCCL groups gloo's (a process of its own: nothing
    else runs here)."""
    module_to = nn.Module.to

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        return module_to(self, *(_on_cpu(arg) for arg in args), **kwargs)

    nn.Module.to = to  # type: ignore[method-assign,assignment]
    nn.Module.cuda = lambda self, device=None: self  # type: ignore[method-assign,assignment]
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign,assignment]
    torch.cuda.set_device = lambda device: None
    new_group = dist.new_group

    def new_cpu_group(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("backend") == "nccl":
            kwargs["backend"] = "gloo"
        return new_group(*args, **kwargs)

    dist.new_group = new_cpu_group
    nn.parallel.DistributedDataParallel = _CpuDistributedDataParallel  # type: ignore[misc]
    module.DistributedDataParallel = _CpuDistributedDataParallel  # type: ignore[attr-defined]
    module.init_multigpu_helper = lambda size, backend: {rank: [rank] for rank in range(size)}  # type: ignore[attr-defined]


def import_distributed_test(world_size: int, temp_dir: str) -> types.ModuleType:
    """Import ``distributed_test`` as torch's launcher would for gloo at ``world_size`` ranks, patched."""
    os.environ.update(BACKEND="gloo", WORLD_SIZE=str(world_size), TEMP_DIR=temp_dir, MASTER_ADDR="127.0.0.1")
    from torch.testing._internal.distributed import distributed_test

    patch_distributed_test(distributed_test)
    run_gpu_bodies_on_cpu(distributed_test, world_size)
    assert_patched(distributed_test)
    return distributed_test


def runnable_body(cls: type, name: str) -> Callable[[Any], Any]:
    """Torch's test ``name`` less its outermost GPU gate; an AssertionError if torch would skip it otherwise."""
    layers, layer = [], getattr(cls, name)
    while True:
        if getattr(layer, "__unittest_skip__", False):
            raise AssertionError(f"{name}: torch skips it here ({layer.__unittest_skip_why__})")
        layers.append(layer)
        if not hasattr(layer, "__wrapped__"):
            break
        layer = layer.__wrapped__
    while len(layers) > 1 and layers[0].__code__.co_qualname == _GPU_GATE:
        layers.pop(0)
    unknown = [f.__code__.co_qualname for f in layers[:-1] if f.__code__.co_qualname not in _KNOWN_LAYERS]
    assert not unknown, f"{name}: decorators not reviewed for a CPU run: {unknown}"
    return layers[0]


def new_case(cls: type, rank: int, world_size: int) -> Any:
    """An instance of torch's test class ``cls`` as its harness would set it up in a rank."""
    from torch.testing._internal.common_utils import TestCase

    case_class = type(f"Distoptim{cls.__name__}", (cls, TestCase), {})
    case = case_class("runTest")
    case.rank = rank
    if "world_size" not in dir(cls):
        case.world_size = world_size
    return case


def run_in_fresh_group(case: Any, name: str, body: Callable[[Any], Any], store_dir: str) -> None:
    """Run one test body in a new default gloo group (torch runs each test in fresh processes: counts of process
    groups, as ``test_3_level_hierarchical_model_averager`` checks, start from zero)."""
    dist.init_process_group(
        "gloo", init_method=f"file://{store_dir}/{name}", rank=case.rank, world_size=case.world_size
    )
    try:
        body(case)
    finally:
        dist.destroy_process_group()
