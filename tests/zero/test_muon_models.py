"""Muon + AdamW in one ZeroRedundancyOptimizer on models users have, against DDP + plain ``torch.optim.Muon`` and
``torch.optim.AdamW``: a GPT-2 from ``transformers`` (its token embedding tied to the output head: AdamW; the
``Conv1D`` matrices ``c_attn``, ``c_proj``, ``c_fc``: Muon) and a convolutional net (Muon on its hidden linear
matrices; a convolution's 4-D weight in a Muon group is refused on every rank, as torch's Muon refuses it).

Bitwise under DDP's gradient; within 4x the distance a one-ulp gradient difference makes (measured here: Newton-
Schulz in bfloat16 amplifies last-bit differences) where the reduction order differs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer
from distoptim.hooks import reduce_to_owners_hook
from tests._dist import run_on_ranks

MUON = {"lr": 0.02}
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.05}
VOCAB, SEQ = 96, 8
STEPS = range(3)


def _gpt2() -> tuple[nn.Module, list[nn.Parameter]]:
    """A two-layer GPT-2 (no dropout) and its Muon matrices: every 2-D weight of the blocks (``Conv1D``'s, stored
    as ``(in, out)``); the tied ``wte``/``lm_head`` and the position embedding are not among them."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    config.attn_pdrop = config.resid_pdrop = config.embd_pdrop = 0.0
    model = GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    matrices = [p for name, p in model.named_parameters() if p.dim() == 2 and ".h." in name]
    return model, matrices


def _gpt2_loss(wrapped: nn.Module, rank: int, step: int) -> torch.Tensor:
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))
    return wrapped(input_ids=tokens, labels=tokens).loss


class ConvNet(nn.Module):
    """Two convolutions with batch norm, then two hidden linear layers and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(), nn.Flatten()
        )
        self.fc1, self.fc2, self.head = nn.Linear(8 * 4 * 4, 32), nn.Linear(32, 32), nn.Linear(32, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.fc2(F.relu(self.fc1(self.features(images))))))


def _convnet() -> tuple[nn.Module, list[nn.Parameter]]:
    torch.manual_seed(0)
    model = ConvNet()
    return model, [model.fc1.weight, model.fc2.weight]


def _convnet_loss(wrapped: nn.Module, rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + rank)
    images, labels = torch.randn(4, 3, 8, 8, generator=generator), torch.randint(0, 10, (4,), generator=generator)
    return F.cross_entropy(wrapped(images), labels)


Build = Callable[[], tuple[nn.Module, list[nn.Parameter]]]
Loss = Callable[[nn.Module, int, int], torch.Tensor]


def _rest(model: nn.Module, matrices: list[nn.Parameter]) -> list[nn.Parameter]:
    return [p for p in model.parameters() if all(p is not m for m in matrices)]  # a tied weight once


def _backwards(wrapped: Any, loss: Loss, rank: int, step: int, accumulate: str | None) -> None:
    """One backward, or two micro-batches: the first inside ``no_sync`` (``accumulate="no_sync"``) or both synced."""
    if accumulate is None:
        loss(wrapped, rank, step).backward()
        return
    with wrapped.no_sync() if accumulate == "no_sync" else contextlib.nullcontext():
        loss(wrapped, rank, 1000 + step).backward()
    loss(wrapped, rank, step).backward()


def _reference(build: Build, loss: Loss, rank: int, nudge: bool = False, accumulate: str | None = None) -> nn.Module:
    model, matrices = build()
    ddp = DDP(model)
    plain = [torch.optim.Muon(matrices, **MUON), torch.optim.AdamW(_rest(model, matrices), **ADAMW)]
    for step in STEPS:
        for optim in plain:
            optim.zero_grad()
        _backwards(ddp, loss, rank, step, accumulate)
        if nudge:  # the gradient one ulp off: how far a last-bit difference carries
            for p in model.parameters():
                p.grad = torch.nextafter(p.grad, torch.full_like(p.grad, torch.inf))
        for optim in plain:
            optim.step()
    return model


def _zero(model: nn.Module, matrices: list[nn.Parameter], **kwargs: Any) -> ZeroRedundancyOptimizer:
    groups = [{"params": matrices, "optimizer_class": torch.optim.Muon, **MUON}, {"params": _rest(model, matrices)}]
    return ZeroRedundancyOptimizer(groups, torch.optim.AdamW, **ADAMW, **kwargs)


def _distance(model: nn.Module, reference: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))


def _orthogonalizations(zero: ZeroRedundancyOptimizer, step: Callable[[], None]) -> int:
    """Newton-Schulz calls over all ranks while ``step`` runs (torch's Muon makes one per matrix it steps)."""
    original = torch.optim._muon._zeropower_via_newtonschulz
    calls = [0]

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return original(*args, **kwargs)

    with mock.patch("torch.optim._muon._zeropower_via_newtonschulz", counted):
        step()
    total = torch.tensor([calls[0]])
    dist.all_reduce(total)
    return int(total.item())


def _parity(build: Build, loss: Loss, rank: int) -> None:
    reference = _reference(build, loss, rank)
    tolerance = 4 * _distance(_reference(build, loss, rank, nudge=True), reference)
    assert tolerance > 0
    for partition in ("greedy", "even"):  # ZeRO-1 under DDP: DDP's gradient, bitwise
        model, matrices = build()
        ddp = DDP(model)
        zero = _zero(model, matrices, partition=partition)

        def train(wrapped: nn.Module = ddp, zero: ZeroRedundancyOptimizer = zero) -> None:
            for step in STEPS:
                zero.zero_grad()
                loss(wrapped, rank, step).backward()
                zero.step()

        calls = _orthogonalizations(zero, train)
        assert calls == len(STEPS) * len(matrices), f"{partition}: {calls} orthogonalizations"
        for param in matrices:
            (fragment,) = zero.fragments_of(param) or ()
            assert fragment.length == param.numel()
        assert _distance(model, reference) == 0, partition
    for mode in ("reduce_to_owners_hook", "ShardedDataParallel"):
        model, matrices = build()
        zero = _zero(model, matrices, partition="even")
        wrapped: nn.Module
        if mode == "reduce_to_owners_hook":
            wrapped = DDP(model)
            wrapped.register_comm_hook(zero, reduce_to_owners_hook)
        else:
            wrapped = ShardedDataParallel(model, zero, bucket_cap_mb=0.004)
        for step in STEPS:
            zero.zero_grad()
            loss(wrapped, rank, step).backward()
            zero.step()
        assert _distance(model, reference) <= tolerance, (mode, _distance(model, reference), tolerance)


def _gpt2_body(rank: int, world_size: int) -> None:
    _parity(_gpt2, _gpt2_loss, rank)


def _accumulation(build: Build, loss: Loss, rank: int) -> None:
    """Two micro-batches a step, the first under ``no_sync`` or both synced: Newton-Schulz runs once per matrix per
    step, at the step (never per micro-batch); ZeRO-1 under DDP bitwise, ShardedDataParallel (each micro-batch
    reduced to owners, or the local sum at the last) within the measured distance."""
    reference = _reference(build, loss, rank, accumulate="no_sync")
    tolerance = 4 * _distance(_reference(build, loss, rank, nudge=True, accumulate="no_sync"), reference)
    for wrapper in ("DDP", "ShardedDataParallel"):
        for accumulate in ("no_sync", "synced"):
            model, matrices = build()
            zero = _zero(model, matrices, partition="even")
            wrapped = DDP(model) if wrapper == "DDP" else ShardedDataParallel(model, zero, bucket_cap_mb=0.004)

            def train(wrapped: Any = wrapped, zero: ZeroRedundancyOptimizer = zero, how: str = accumulate) -> None:
                for step in STEPS:
                    zero.zero_grad()
                    _backwards(wrapped, loss, rank, step, how)
                    zero.step()

            calls = _orthogonalizations(zero, train)
            assert calls == len(STEPS) * len(matrices), (wrapper, accumulate, calls)
            distance = _distance(model, reference)
            if wrapper == "DDP" and accumulate == "no_sync":
                assert distance == 0, (wrapper, accumulate, distance)
            else:  # another summation order than DDP's no_sync
                assert distance <= tolerance, (wrapper, accumulate, distance, tolerance)


def _convnet_body(rank: int, world_size: int) -> None:
    _parity(_convnet, _convnet_loss, rank)
    _accumulation(_convnet, _convnet_loss, rank)
    model, matrices = _convnet()
    conv = model.features[0].weight
    with pytest.raises(ValueError, match=r"shape \(8, 3, 3, 3\).*flattening it to a matrix is not supported"):
        _zero(model, [*matrices, conv])  # on every rank: this body runs on each


def test_gpt2_from_transformers_with_a_tied_embedding_matches_ddp() -> None:
    pytest.importorskip("transformers")
    run_on_ranks(_gpt2_body, 3, timeout=240)


def test_a_conv_net_matches_ddp_and_its_conv_weights_are_refused_by_muon() -> None:
    run_on_ranks(_convnet_body, 2, timeout=240)
