"""torch.compile of a DDP model trained by ZeroRedundancyOptimizer, in each mode (greedy/even partition, bucket
views on/off, the step inside DDP's backward, gradients reduced to owners), on 2 gloo ranks: equals eager DDP +
plain AdamW within 1e-5 (relative) / 1e-6 (absolute) at every step.

The model is compiled, not the optimizer: dynamo's DDPOptimizer splits the forward at DDP's bucket boundaries (the
model has several buckets), and the comm hooks run in the compiled backward as in eager. A counting backend checks
that every forward ran compiled graphs, at least two (one per bucket). Backend "aot_eager" (dynamo's graphs and
AOTAutograd's forward/backward split, eager's kernels), for time: measured on this 2-core machine, the body costs
about 5 CPU-seconds per rank with it and about 16 with inductor (half of them in gcc). ``INDUCTOR=1`` runs the same
test with inductor, against a reference compiled alike (see ``_compile_body``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ZeroRedundancyOptimizer
from tests._dist import run_on_ranks
from tests.integration import _tiny
from tests.zero._hooks import register

BACKEND = "inductor" if os.environ.get("INDUCTOR") == "1" else "aot_eager"
ITERATIONS = 3  # every sample once: 2 ranks x batches of 4 x 3 = 24
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}  # aot_eager runs eager's kernels on decomposed graphs: the last bits differ
# (partition, gradient reduction, stepping, parameters_as_bucket_view): every mode appears, with both partitions
CONFIGS = [
    ("greedy", "all_reduce", "explicit", False),
    ("even", "all_reduce", "hook", True),
    ("greedy", "to_owners", "hook", True),
    ("even", "to_owners", "explicit", False),
]


class _Wide(nn.Module):
    """Wide enough for several DDP buckets: dynamo's DDPOptimizer needs buckets of at least DDP's first bucket's
    1 MiB, and each 512x512 weight is 1 MiB. A class of our own, not a bare ``nn.Sequential``: dynamo does not
    compile frames of torch's own modules reached after DDP's graph breaks, so ``torch.compile(DDP(Sequential))``
    runs eagerly, compiling nothing (torch 2.13)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(8, 512),
            nn.Tanh(),
            nn.Linear(512, 512),
            nn.Tanh(),
            nn.Linear(512, 512),
            nn.Tanh(),
            nn.Linear(512, 4),
        )

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.layers(inputs)


def _ddp(model: nn.Module) -> DDP:
    return DDP(model, bucket_cap_mb=1)


class _CountingBackend:
    """A dynamo backend that compiles with ``backend`` and counts the calls of what it compiled: proof that a
    forward ran compiled code, split by DDPOptimizer into a graph per bucket (so 2 calls or more per forward)."""

    def __init__(self, backend: str) -> None:
        self.compile_graph = torch._dynamo.lookup_backend(backend)
        self.calls = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        compiled = self.compile_graph(graph, example_inputs)

        def counted(*args: Any) -> Any:
            self.calls += 1
            return compiled(*args)

        counted._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]
        return counted


def _compile_body(rank: int, world_size: int, backend_name: str) -> None:
    torch._dynamo.config.optimize_ddp = "ddp_optimizer"  # the default, stated: the mode this test is about
    data = _tiny.dataset()
    backend = _CountingBackend(backend_name)  # one object: the modes share compiled graphs where guards allow
    for config in CONFIGS:
        partition, reduction, stepping, bucket_view = config
        model = _Wide()
        ddp = _ddp(model)
        zero = ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            parameters_as_bucket_view=bucket_view,
            overlap_with_ddp=stepping != "explicit",
            partition=partition,
            lr=_tiny.LR,
            weight_decay=_tiny.WEIGHT_DECAY,
        )
        register(ddp, zero, reduction, stepping)
        compiled = torch.compile(ddp, backend=backend)
        reference = _Wide()
        reference_ddp = _ddp(reference)
        # Inductor's fused kernels round differently from eager's, and AdamW's first steps move an element whose
        # gradient is near eps anywhere between 0 and lr: with inductor the reference is compiled alike.
        reference_forward = (
            torch.compile(reference_ddp, backend=backend) if backend_name == "inductor" else reference_ddp
        )
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=_tiny.LR, weight_decay=_tiny.WEIGHT_DECAY)
        for iteration in range(ITERATIONS):
            first = (iteration * world_size + rank) * _tiny.BATCH_SIZE
            inputs, targets = data[first : first + _tiny.BATCH_SIZE]
            assert len(inputs) == _tiny.BATCH_SIZE, "ran out of samples"
            zero.zero_grad()
            calls = backend.calls
            output = compiled(inputs)
            assert backend.calls - calls >= 2, f"{config}: the forward ran {backend.calls - calls} compiled graphs"
            _tiny.loss_fn(output, targets).backward()
            if stepping == "explicit":
                zero.step()
            reference_optimizer.zero_grad()
            _tiny.loss_fn(reference_forward(inputs), targets).backward()
            reference_optimizer.step()
            for index, (param, expected) in enumerate(zip(model.parameters(), reference.parameters())):
                label = f"{config} {backend_name}: iteration {iteration}, parameter {index}"
                torch.testing.assert_close(param, expected, **TOLERANCE, msg=lambda m, label=label: f"{label}: {m}")


def test_compiled_ddp_model_with_zero_in_every_mode_matches_eager() -> None:
    run_on_ranks(_compile_body, 2, BACKEND, timeout=240)
