"""Muon on the hidden matrices + AdamW on the rest, as each library's users run it (the rows of bench_muon.py).

The split is the usual one (``split``): Muon (lr 0.02, torch's other defaults) on the 2-D weights inside the
transformer blocks (qkv, proj, up, down); AdamW on the embeddings, the head, the norms and the biases.

- ``ddp-muon``: DDP + plain ``torch.optim.Muon`` and ``torch.optim.AdamW``: every rank orthogonalizes every matrix.
- ``distoptim-zero1-muon``: DDP + ``distoptim.ZeroRedundancyOptimizer`` with ``optimizer_class=torch.optim.Muon``
  on the matrices' group (whole matrices, one owner each, balanced by Newton-Schulz cost), AdamW's group cut evenly,
  bucket views.
- ``sdp-muon``: ``distoptim.ShardedDataParallel`` over the same optimizer (each matrix's gradient reduced whole to
  its owner; the rest reduce-scattered).
- ``deepspeed-zero1-muon``, ``deepspeed-zero2-muon``: DeepSpeed's own Muon (``"optimizer": {"type": "Muon"}``,
  ``MuonWithAuxAdam``) under ZeRO stage 1 / 2, fp32, DeepSpeed's defaults otherwise (its Newton-Schulz method
  ``gram``). DeepSpeed tags parameters itself (2-D and not named ``embed``/``lm_head``); this model's embeddings
  are ``tokens``/``positions`` and its head ``head``, so the tags are set to the split above after its own.
- ``fsdp2-muon``: ``fully_shard`` per block and on the root (``reshard_after_forward=False``) + the ``muon-fsdp2``
  package's ``Muon`` (one optimizer, ``use_muon`` per group): each matrix's gradient gathered to rank
  ``index % N``, orthogonalized there, scattered back; its inline Adam on the rest.

``muon_rank`` runs ``bench_worker.bench_rank`` with every Newton-Schulz entry point wrapped to record the shape it
orthogonalizes, so the benchmark reports the work each rank really did (``ns_flops``: ``5 * (4*m*m*n + 2*m**3)``
per ``m x n`` matrix, ``m`` the short side, the 5-step quintic iteration).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from harness import Harness, Variant, ddp_setup, optimizer_state_tensors
from peer_variants import _deepspeed_missing, _deepspeed_prepare, deepspeed_harness
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import AdamW, Muon, Optimizer

__all__ = ["MUON_LR", "MUON_VARIANTS", "MuonRankResult", "muon_rank", "ns_flops", "split"]

MUON_LR = 0.02
NS_STEPS = 5


def split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's matrices, AdamW's rest): the 2-D weights inside the transformer blocks, and everything else."""
    named = list(model.named_parameters())
    matrices = [p for name, p in named if name.startswith("blocks.") and p.dim() == 2]
    chosen = {id(p) for p in matrices}
    return matrices, [p for _, p in named if id(p) not in chosen]


def ns_flops(shape: tuple[int, ...]) -> int:
    """FLOPs of 5 quintic Newton-Schulz iterations on an ``m x n`` matrix (``m <= n``): ``5 * (4m^2 n + 2m^3)``."""
    m, n = sorted(shape[-2:])
    return NS_STEPS * (4 * m * m * n + 2 * m**3)


class _MuonAndAdamW:
    """DDP + plain optimizers: torch.optim.Muon on the matrices and torch.optim.AdamW on the rest, stepped in turn."""

    def __init__(self, model: nn.Module, kwargs: dict[str, Any]) -> None:
        matrices, rest = split(model)
        self.optimizers: list[Optimizer] = [Muon(matrices, lr=MUON_LR), AdamW(rest, **kwargs)]

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad()

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()


def _ddp_muon(model: nn.Module, kwargs: dict[str, Any]) -> Harness:
    ddp = DistributedDataParallel(model)
    pair = _MuonAndAdamW(model, kwargs)
    params = list(model.parameters())

    def tensors() -> dict[str, list[Tensor]]:
        return {
            "params": params,
            "grads": [p.grad for p in params if p.grad is not None],
            "state": [t for o in pair.optimizers for t in optimizer_state_tensors(o)],
        }

    return Harness(model=ddp, optimizer=pair, local_optimizer=pair.optimizers[0], tensors=tensors, no_sync=ddp.no_sync)


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    matrices, rest = split(model)
    return [{"params": matrices, "optimizer_class": Muon, "lr": MUON_LR}, {"params": rest}]


def _zero(model: nn.Module, kwargs: dict[str, Any]) -> Any:
    import distoptim

    return distoptim.ZeroRedundancyOptimizer(
        _groups(model), AdamW, partition="even", parameters_as_bucket_view=True, **kwargs
    )


def _distoptim_zero1(ddp: DistributedDataParallel, params: Iterable[Tensor], kwargs: dict[str, Any]) -> Optimizer:
    zero: Optimizer = _zero(ddp.module, kwargs)
    return zero


def _sdp_muon(model: nn.Module, kwargs: dict[str, Any]) -> Harness:
    import distoptim

    params = list(model.parameters())
    zero = _zero(model, kwargs)
    sdp = distoptim.ShardedDataParallel(model, zero)

    def tensors() -> dict[str, list[Tensor]]:
        local = [t for group in zero.local_optimizer.param_groups for t in group["params"]]
        return {
            "params": params,
            "grads": [t.grad for t in params + local if t.grad is not None],
            "state": optimizer_state_tensors(zero.local_optimizer),
        }

    return Harness(model=sdp, optimizer=zero, local_optimizer=zero.local_optimizer, tensors=tensors)


def _tag_for_deepspeed() -> None:
    """Make DeepSpeed's own Muon tagging follow ``split`` (its rule keys on the names ``embed`` and ``lm_head``)."""
    import deepspeed

    if getattr(deepspeed.set_optimizer_flags, "_split", False):
        return
    original = deepspeed.set_optimizer_flags

    def set_optimizer_flags(config: Any, model: nn.Module) -> None:
        original(config, model)
        matrices, _ = split(model)
        chosen = {id(p) for p in matrices}
        for p in model.parameters():
            p.use_muon = id(p) in chosen  # type: ignore[attr-defined]

    set_optimizer_flags._split = True  # type: ignore[attr-defined]
    deepspeed.set_optimizer_flags = set_optimizer_flags


def _deepspeed_muon(stage: int) -> Callable[[nn.Module, dict[str, Any]], Harness]:
    def setup(model: nn.Module, kwargs: dict[str, Any]) -> Harness:
        import deepspeed

        _tag_for_deepspeed()
        config = {
            "train_micro_batch_size_per_gpu": 1,  # unused: the loop feeds the batch itself
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "Muon", "params": {"lr": kwargs["lr"], "muon_lr": MUON_LR}},
            "zero_optimization": {"stage": stage},
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        engine, zero, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config, dist_init_required=False
        )
        return deepspeed_harness(engine, zero)

    return setup


def _fsdp2_muon_missing() -> str | None:
    return None if importlib.util.find_spec("muon_fsdp2") is not None else "not installed: muon-fsdp2"


def _fsdp2_muon(model: nn.Module, kwargs: dict[str, Any]) -> Harness:
    from muon_fsdp2 import Muon as FsdpMuon
    from torch.distributed.fsdp import fully_shard

    matrices, _ = split(model)  # before fully_shard: it replaces the parameters by DTensors in place
    names = {id(p): name for name, p in model.named_parameters()}
    muon_names = {names[id(p)] for p in matrices}
    for block in model.blocks:  # type: ignore[union-attr]  # the GPT's transformer blocks
        fully_shard(block, reshard_after_forward=False)
    fully_shard(model, reshard_after_forward=False)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    optimizer = FsdpMuon(
        [
            {"params": [p for n, p in named if n in muon_names], "lr": MUON_LR, "use_muon": True},
            {"params": [p for n, p in named if n not in muon_names], "lr": kwargs["lr"], "use_muon": False},
        ]
    )

    def tensors() -> dict[str, list[Tensor]]:
        return {
            "params": params,
            "grads": [p.grad for p in params if p.grad is not None],
            "state": optimizer_state_tensors(optimizer),
        }

    return Harness(model=model, optimizer=optimizer, local_optimizer=optimizer, tensors=tensors)


MUON_VARIANTS = [
    Variant("ddp-muon", "baseline", "DDP + Muon/AdamW, unsharded", _ddp_muon, family="muon"),
    Variant(
        "distoptim-zero1-muon",
        "distoptim",
        "ZeRO-1 under DDP, per-group Muon",
        ddp_setup(_distoptim_zero1, lambda z: z.local_optimizer),
        family="muon",
    ),
    Variant(
        "sdp-muon",
        "sdp",
        "ShardedDataParallel, per-group Muon",
        _sdp_muon,
        ddp_cpp_allreduce=False,
        family="muon",
    ),
    Variant(
        "deepspeed-zero1-muon",
        "deepspeed",
        "ZeRO stage 1, DeepSpeed's Muon",
        _deepspeed_muon(1),
        ddp_cpp_allreduce=False,
        family="muon-peer",
        counts_bytes=False,
        missing=_deepspeed_missing,
        prepare=_deepspeed_prepare,
    ),
    Variant(
        "deepspeed-zero2-muon",
        "deepspeed",
        "ZeRO stage 2, DeepSpeed's Muon",
        _deepspeed_muon(2),
        ddp_cpp_allreduce=False,
        family="muon-peer",
        counts_bytes=False,
        missing=_deepspeed_missing,
        prepare=_deepspeed_prepare,
    ),
    Variant(
        "fsdp2-muon",
        "fsdp2",
        "fully_shard + muon-fsdp2's Muon",
        _fsdp2_muon,
        ddp_cpp_allreduce=False,
        family="muon-peer",
        counts_bytes=False,
        missing=_fsdp2_muon_missing,
    ),
]

# Where each library orthogonalizes: (module, function), wrapped to record the shapes (the first argument).
_NS_ENTRY_POINTS = {
    "torch": ("torch.optim._muon", "_zeropower_via_newtonschulz"),
    "deepspeed": ("deepspeed.runtime.zero.muon.original_muon", "muon_update"),  # imported by ZeRO at each call
    "fsdp2": ("muon_fsdp2", "zeropower_via_newtonschulz5"),
}


@contextlib.contextmanager
def _recording(impl: str, shapes: list[tuple[int, ...]]) -> Iterator[None]:
    module_name, function = _NS_ENTRY_POINTS.get(impl, _NS_ENTRY_POINTS["torch"])
    if impl == "deepspeed":
        _deepspeed_prepare()
    module = importlib.import_module(module_name)
    original = getattr(module, function)

    def recorded(grad: Tensor, *args: Any, **kwargs: Any) -> Any:
        shapes.append(tuple(grad.shape))
        return original(grad, *args, **kwargs)

    setattr(module, function, recorded)
    try:
        yield
    finally:
        setattr(module, function, original)


@dataclass
class MuonRankResult:
    result: Any  # bench_worker.RankResult
    ns_shapes: list[tuple[int, ...]] = field(default_factory=list)  # every orthogonalization, in order


def muon_rank(ctx: Any, spec: Any, compile_ns: bool = False) -> MuonRankResult:
    """``bench_rank`` with this rank's Newton-Schulz calls recorded (the warm-up's tiny model's among them).

    Without ``compile_ns``, ``torch.compile`` is off in the rank (``torch._dynamo.config.disable``): DeepSpeed's
    ``muon_update`` and muon-fsdp2's Newton-Schulz loop are decorated with it, and compiling them with inductor on a
    2-core machine costs minutes per run; eager, they run the same matmuls.
    """
    import torch._dynamo
    from bench_worker import bench_rank
    from zero_variants import VARIANTS

    torch._dynamo.config.disable = not compile_ns
    if not compile_ns and VARIANTS[spec.variant].impl == "fsdp2":  # fullgraph=True refuses to run uncompiled
        import muon_fsdp2

        loop = muon_fsdp2.nsloop_torch
        muon_fsdp2.nsloop_torch = getattr(loop, "_torchdynamo_orig_callable", loop)
    shapes: list[tuple[int, ...]] = []
    torch.set_num_threads(1)
    with _recording(VARIANTS[spec.variant].impl, shapes):
        result = bench_rank(ctx, spec)
    return MuonRankResult(result, shapes)
