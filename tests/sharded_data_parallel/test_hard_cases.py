"""ShardedDataParallel in the cases a hostile review built (each found a defect, or checks a neighbour of one):
each compares with DDP(find_unused_parameters) + plain AdamW on the same seeds and data, mostly by the loss of every
forward (which ran while the previous step's parameter sync was in flight), or checks that no rank hangs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer
from tests._dist import run_on_ranks

KW = {"lr": 0.05, "weight_decay": 0.1}


def _x(rank: int, step: int, width: int = 6) -> torch.Tensor:
    return torch.randn(4, width, generator=torch.Generator().manual_seed(100 * step + rank))


def _same_loss(ours: torch.Tensor, want: torch.Tensor, label: str) -> None:
    """The forward's loss (computed from the parameters as the forward read them, the sync possibly in flight)."""
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-7, msg=lambda m: f"{label} loss: {m}")


def _step_both(
    zero: ZeroRedundancyOptimizer, sdp: nn.Module, plain: Any, ddp: nn.Module, x: torch.Tensor, label: str
) -> None:
    """One step of ShardedDataParallel and of DDP + the plain optimizer on the same batch; their losses must agree
    (no sync_finished here: the next forward overlaps the sync)."""
    zero.zero_grad()
    loss = sdp(x).square().mean()
    loss.backward()
    zero.step()
    plain.zero_grad()
    want = ddp(x).square().mean()
    want.backward()
    plain.step()
    _same_loss(loss, want, label)


def _compare(ours: nn.Module, ref: nn.Module, label: str) -> None:
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{label} {n}: {m}")


class Chain(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(n))
        self.side = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if use_side:
            x = x + self.side(x)
        return x


def _sdp(model: nn.Module, partition: str = "greedy", bucket_view: bool = False, **kw: Any) -> Any:
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, partition=partition, parameters_as_bucket_view=bucket_view, **KW
    )
    return zero, ShardedDataParallel(model, zero, bucket_cap_mb=0.0001, **kw)


# ---------------------------------------------------------------- 1. model.zero_grad() leaves the owned gradient
def _module_zero_grad_body(rank: int, world_size: int) -> None:
    model, reference = Chain(), Chain()
    zero, sdp = _sdp(model)
    ddp, plain = DDP(reference), torch.optim.AdamW(reference.parameters(), **KW)
    for step in range(3):
        sdp.zero_grad()  # what DDP users write: nn.Module.zero_grad on the wrapper
        sdp(_x(rank, step), True).square().mean().backward()
        zero.step()
        ddp.zero_grad()
        ddp(_x(rank, step), True).square().mean().backward()
        plain.step()
        sdp.sync_finished()
        _compare(model, reference, f"step {step}")


def test_module_zero_grad_clears_the_owned_gradient() -> None:
    run_on_ranks(_module_zero_grad_body, 2)


# ------------------------------------- 2. zero_grad(set_to_none=False) and a parameter no rank used this step
def _zeros_not_none_body(rank: int, world_size: int) -> None:
    model, reference = Chain(), Chain()
    zero, sdp = _sdp(model)
    ddp = DDP(reference, find_unused_parameters=True)
    plain = torch.optim.AdamW(reference.parameters(), **KW)
    for step in range(3):
        use_side = step == 0  # side used at step 0 only: afterwards its .grad is zeros under DDP + set_to_none=False
        zero.zero_grad(set_to_none=False)
        sdp(_x(rank, step), use_side).square().mean().backward()
        zero.step()
        plain.zero_grad(set_to_none=False)
        ddp(_x(rank, step), use_side).square().mean().backward()
        plain.step()
        sdp.sync_finished()
        _compare(model, reference, f"step {step}")


def test_zero_grad_set_to_none_false_steps_unused_parameters_like_ddp() -> None:
    run_on_ranks(_zeros_not_none_body, 2)


# ----------------------- 3. a tail of layers used on rank 0 only, with the overlapped sync of staged buckets
class Tail(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(6, 6)
        self.tail = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        x = torch.tanh(self.first(x))
        if rank == 0:  # an auxiliary head only one rank runs
            for layer in self.tail:
                x = torch.tanh(layer(x))
        return x


def _tail_body(rank: int, world_size: int, partition: str, bucket_view: bool) -> None:
    """SDP runs all its steps first (no other collective in between), then the reference."""
    model, reference = Tail(), Tail()
    zero, sdp = _sdp(model, partition, bucket_view)
    losses = []
    for step in range(3):
        zero.zero_grad()
        loss = sdp(_x(rank, step), rank).square().mean()
        loss.backward()
        zero.step()
        losses.append(loss.detach())
    sdp.sync_finished()
    ddp = DDP(reference, find_unused_parameters=True)
    plain = torch.optim.AdamW(reference.parameters(), **KW)
    for step in range(3):
        plain.zero_grad()
        want = ddp(_x(rank, step), rank).square().mean()
        want.backward()
        plain.step()
        _same_loss(losses[step], want, f"step {step}")
    _compare(model, reference, "at the end")


@pytest.mark.parametrize(
    ("partition", "bucket_view"), [("greedy", False), ("even", False), ("greedy", True), ("even", True)]
)
def test_layers_used_by_one_rank_at_the_end(partition: str, bucket_view: bool) -> None:
    run_on_ranks(_tail_body, 2, partition, bucket_view, timeout=60)


# ---------------------- 4. a layer added with add_param_group that runs first in the forward: no pre-hook on it
class Late(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.early = nn.Linear(6, 6)  # frozen at first, then added: it runs first
        self.body = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.early(x))
        for layer in self.body:
            x = torch.tanh(layer(x))
        return x


def _late_body(rank: int, world_size: int, partition: str, bucket_view: bool, overlap: bool = True) -> None:
    model, reference = Late(), Late()
    ddp = DDP(reference, find_unused_parameters=True)
    for net in (model, reference):
        net.early.requires_grad_(False)
    zero = ZeroRedundancyOptimizer(
        [p for p in model.parameters() if p.requires_grad],
        torch.optim.AdamW,
        partition=partition,
        parameters_as_bucket_view=bucket_view,
        **KW,
    )
    sdp = ShardedDataParallel(model, zero, bucket_cap_mb=0.0001, overlap_param_sync=overlap)
    plain = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], **KW)
    for step in range(4):
        if step == 1:
            for net in (model, reference):
                net.early.requires_grad_(True)
            zero.add_param_group({"params": list(model.early.parameters())})
            plain.add_param_group({"params": list(reference.early.parameters())})
        _step_both(zero, sdp, plain, ddp, _x(rank, step), f"step {step}")
    sdp.sync_finished()
    _compare(model, reference, "at the end")


@pytest.mark.parametrize(("partition", "bucket_view"), [("greedy", False), ("even", False)])
def test_a_layer_added_later_that_runs_first(partition: str, bucket_view: bool) -> None:
    run_on_ranks(_late_body, 2, partition, bucket_view)


def test_control_a_layer_added_later_without_overlap() -> None:
    run_on_ranks(_late_body, 2, "greedy", False, False)


# ------------------------------- 5. the parent reads a child's weight functionally (no pre-hook of the child)
class Functional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.head = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.body:
            x = torch.tanh(layer(x))
        return F.linear(x, self.head.weight, self.head.bias)


def _functional_body(rank: int, world_size: int, overlap: bool = True) -> None:
    model, reference = Functional(), Functional()
    zero, sdp = _sdp(model, overlap_param_sync=overlap)
    ddp, plain = DDP(reference), torch.optim.AdamW(reference.parameters(), **KW)
    for step in range(3):
        _step_both(zero, sdp, plain, ddp, _x(rank, step), f"step {step}")
    sdp.sync_finished()
    _compare(model, reference, "at the end")


def test_control_functional_read_without_overlap() -> None:
    run_on_ranks(_functional_body, 2, False)


# ------------------------- 3b. `if rank == 0: save(model.state_dict())` between steps, a model with a buffer
class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))
        self.norm = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.norm(x)


def _rank0_state_dict_body(rank: int, world_size: int, how: str) -> None:
    model = Normed()
    zero, sdp = _sdp(model)
    for step in range(3):
        zero.zero_grad()
        sdp(_x(rank, step)).square().mean().backward()
        zero.step()
        if rank == 0:  # DDP's idiom for saving, or a rank-0-only evaluation
            if how == "state_dict":
                sdp.state_dict()
            else:
                sdp.sync_finished()  # the guide: call it before reading through the inner module
                with torch.no_grad():
                    sdp.module.eval()
                    sdp.module(_x(rank, 99))
                    sdp.module.train()
    sdp.sync_finished()  # the end of training: no rank leaves with its sync in flight


@pytest.mark.parametrize("how", ["state_dict", "eval"])
def test_rank0_only_state_dict_between_steps(how: str) -> None:
    run_on_ranks(_rank0_state_dict_body, 2, how, timeout=60)


# ------------------------------------------------------------- 6. assorted: run SDP alone, then the reference
class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 6)
        self.d = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, how: str, micro: int, rank: int) -> torch.Tensor:
        x = torch.tanh(self.a(x))
        if how == "reentrant":
            x = torch.utils.checkpoint.checkpoint(
                lambda h: torch.tanh(self.c(torch.tanh(self.b(h)))), x, use_reentrant=True
            )
        elif how == "nonreentrant":
            x = torch.utils.checkpoint.checkpoint(
                lambda h: torch.tanh(self.c(torch.tanh(self.b(h)))), x, use_reentrant=False
            )
        elif how == "no_sync_split":  # b only in the no_sync micro-batch, c only in the synced one, on rank 0 only
            if micro == 0 or rank == 1:
                x = torch.tanh(self.b(x))
            if micro == 1 and rank == 0:
                x = torch.tanh(self.c(x))
        else:
            x = torch.tanh(self.c(torch.tanh(self.b(x))))
        return self.d(x)


def _run(model: nn.Module, rank: int, how: str, step_fn: Any, zero_grad: Any, no_sync: Any, steps: int = 3) -> None:
    for step in range(steps):
        zero_grad()
        micros = 2 if how == "no_sync_split" else 1
        for micro in range(micros):
            context = no_sync() if micro < micros - 1 else _Nothing()
            with context:
                inp = _x(rank, 10 * step + micro)
                if how == "reentrant":
                    inp.requires_grad_()
                model(inp, how, micro, rank).square().mean().backward()
        step_fn(step)


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: Any) -> None:
        return None


def _assorted_body(rank: int, world_size: int, how: str, partition: str, overlap: bool) -> None:
    model, reference = Mixed(), Mixed()
    zero, sdp = _sdp(model, partition, overlap_param_sync=overlap)

    def sdp_step(step: int) -> None:
        zero.step()
        if how == "twice":
            zero.step()
        if how == "moved" and step == 0:
            sdp.sync_finished()
            for p in model.parameters():
                p.data = p.data.clone()

    _run(sdp, rank, how, sdp_step, zero.zero_grad, sdp.no_sync)
    sdp.sync_finished()
    ddp = DDP(reference, find_unused_parameters=True)
    plain = torch.optim.AdamW(reference.parameters(), **KW)

    def ref_step(step: int) -> None:
        plain.step()
        if how == "twice":
            plain.step()

    _run(ddp, rank, "plain" if how in ("reentrant", "nonreentrant") else how, ref_step, plain.zero_grad, ddp.no_sync)
    _compare(model, reference, how)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("partition", ["greedy", "even"])
@pytest.mark.parametrize("how", ["reentrant", "nonreentrant", "no_sync_split", "twice", "moved"])
def test_assorted(how: str, partition: str, overlap: bool) -> None:
    run_on_ranks(_assorted_body, 2, how, partition, overlap, timeout=60)


# ------------------------------------------ 7. BatchNorm buffers: train steps with evaluations under no_grad between
def _eval_between_body(rank: int, world_size: int, partition: str, overlap: bool) -> None:
    model, reference = Normed(), Normed()
    zero, sdp = _sdp(model, partition, overlap_param_sync=overlap)
    ddp = DDP(reference)
    plain = torch.optim.AdamW(reference.parameters(), **KW)
    ours, wants = [], []
    for net, step_fn, zero_grad, outs in (
        (sdp, zero.step, zero.zero_grad, ours),
        (ddp, plain.step, plain.zero_grad, wants),
    ):
        for step in range(4):
            zero_grad()
            net(_x(rank, step)).square().mean().backward()
            step_fn()
            if step % 2 == 0:
                net.eval()
                with torch.no_grad():
                    outs.append(net(_x(rank, 50 + step)))
                net.train()
                with torch.no_grad():  # a train-mode forward without gradients: DDP syncs no buffers after it
                    outs.append(net(_x(rank, 70 + step)))
    sdp.sync_finished()
    for index, (a, b) in enumerate(zip(ours, wants)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, i=index: f"output {i}: {m}")
    _compare(model, reference, "end")
    for (name, a), b in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"buffer {n}: {m}")


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("partition", ["greedy", "even"])
def test_eval_between_steps(partition: str, overlap: bool) -> None:
    run_on_ranks(_eval_between_body, 2, partition, overlap, timeout=60)


# ------------------------- 8. no zero_grad between steps (gradients accumulate across steps), a branch left later
def _no_zero_grad_body(rank: int, world_size: int, partition: str, overlap: bool, reduce_dtype: Any) -> None:
    model, reference = Chain(), Chain()
    zero, sdp = _sdp(model, partition, overlap_param_sync=overlap, reduce_dtype=reduce_dtype)
    for step in range(3):
        if step == 0:
            zero.zero_grad()
        sdp(_x(rank, step), step == 0 or rank == step % 2).square().mean().backward()
        zero.step()
    sdp.sync_finished()
    ddp = DDP(reference, find_unused_parameters=True)
    plain = torch.optim.AdamW(reference.parameters(), **KW)
    for step in range(3):
        if step == 0:
            plain.zero_grad()
        ddp(_x(rank, step), step == 0 or rank == step % 2).square().mean().backward()
        plain.step()
    _compare(model, reference, "end")


@pytest.mark.parametrize("reduce_dtype", [None, torch.float64])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("partition", ["greedy", "even"])
def test_no_zero_grad_between_steps(partition: str, overlap: bool, reduce_dtype: Any) -> None:
    run_on_ranks(_no_zero_grad_body, 2, partition, overlap, reduce_dtype, timeout=60)


# -------------- 3c. DDP's saving idiom, `if rank == 0: torch.save(model.module.state_dict())`, right after a step
def _inner_state_dict_body(rank: int, world_size: int) -> None:
    model = Chain(4)
    zero, sdp = _sdp(model)
    zero.zero_grad()
    sdp(_x(rank, 0), True).square().mean().backward()
    zero.step()
    saved = {k: v.clone() for k, v in sdp.module.state_dict().items()}  # what rank 0 would write to disk
    sdp.sync_finished()
    for name, value in sdp.module.state_dict().items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0, msg=lambda m, n=name: f"saved {n}: {m}")


def test_inner_state_dict_right_after_a_step() -> None:
    run_on_ranks(_inner_state_dict_body, 2)


# ------------- 5b. torch's own nn.MultiheadAttention reads out_proj.weight functionally (out_proj never runs)
class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def _attention_body(rank: int, world_size: int, partition: str, bucket_view: bool) -> None:
    model, reference = Attention(), Attention()
    zero, sdp = _sdp(model, partition, bucket_view)
    ddp, plain = DDP(reference), torch.optim.AdamW(reference.parameters(), **KW)
    for step in range(3):
        x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        _step_both(zero, sdp, plain, ddp, x, f"step {step}")
    sdp.sync_finished()
    _compare(model, reference, "at the end")


@pytest.mark.parametrize(("partition", "bucket_view"), [("greedy", False), ("even", False), ("even", True)])
def test_transformer_encoder_layer(partition: str, bucket_view: bool) -> None:
    run_on_ranks(_attention_body, 2, partition, bucket_view)


# ------------------------------------- a gradient sharing memory with one another branch still needs is not reduced
class Positions(nn.Module):
    """GPT-2's learned positions: a parameter added to the token embeddings through a view. Its gradient is a view
    of the sum's, which the embedding's backward still reads after the parameter's hook ran; and it sits in an
    ``nn.ParameterDict`` that is never called: the root's forward reads it, so the root's pre-hook lands it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tokens = nn.Embedding(10, 6)
        # in a submodule after the tokens: its bucket is reduced before the embedding's backward runs
        self.learned = nn.ParameterDict({"positions": nn.Parameter(torch.randn(4, 6) * 0.1)})
        self.head = nn.Linear(6, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.tokens(tokens) + self.learned["positions"].unsqueeze(0)))


def _positions_body(rank: int, world_size: int) -> None:
    model, reference = Positions(), Positions()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, partition="even", lr=0.01)
    sdp = ShardedDataParallel(model, zero, bucket_cap_mb=0.0001)  # the positions fill a bucket by themselves
    ddp, plain = DDP(reference), torch.optim.SGD(reference.parameters(), lr=0.01)
    for step in range(3):
        tokens = torch.randint(0, 10, (1, 4), generator=torch.Generator().manual_seed(10 * step + rank))
        _step_both(zero, sdp, plain, ddp, tokens, f"step {step}")
    sdp.sync_finished()
    _compare(model, reference, "after 3 steps")


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_gradient_another_branch_still_reads_is_copied(world_size: int) -> None:
    run_on_ranks(_positions_body, world_size)


# --------------------------- fine-tuning: the optimizer built over the whole model, the backbone frozen, then wrapped
class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Linear(40, 1, bias=False)  # frozen before wrapping: the re-cut leaves it out
        self.head = nn.Linear(1, 10, bias=False)  # lies beyond the end of the smaller layout: moves back

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def _frozen_backbone_body(rank: int, world_size: int) -> None:
    model, reference = Backbone(), Backbone()
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, partition="even", parameters_as_bucket_view=True, **KW
    )
    for net in (model, reference):
        net.backbone.requires_grad_(False)
    sdp = ShardedDataParallel(model, zero, bucket_cap_mb=0.0001)
    _compare(model, reference, "after wrapping")
    ddp = DDP(reference)
    plain = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], **KW)
    for step in range(2):
        _step_both(zero, sdp, plain, ddp, _x(rank, step, 40), f"step {step}")
    sdp.sync_finished()
    _compare(model, reference, "after 2 steps")


def test_a_backbone_frozen_before_wrapping() -> None:
    run_on_ranks(_frozen_backbone_body, 2)


# ------------------------------------------------------------- what cannot be made right is refused on every rank
class Checkpointed(nn.Module):
    """``a`` inside a reentrant activation checkpoint, and (``outside``) used once more outside it: its gradient
    then arrives twice in one backward, the second time after its bucket was reduced."""

    def __init__(self, outside: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.outside = nn.Linear(6, 6), nn.Linear(6, 6), outside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=True)
        return self.b(self.a(h) if self.outside else h)


def _pending_and_twice_body(rank: int, world_size: int) -> None:
    torch.manual_seed(0)  # a forward through the bare model, its backward after wrapping: the moves (odd sizes pad)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))  # bump the versions the graph saved
    zero = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.SGD, partition="even", parameters_as_bucket_view=True, lr=0.1
    )
    loss = model(_x(rank, 0, 5)).square().sum()
    ShardedDataParallel(model, zero, bucket_cap_mb=0.0001)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    for outside in (False, True):
        model, reference = Checkpointed(outside), Checkpointed(outside)
        zero, sdp = _sdp(model, "even")
        if outside:
            with pytest.raises(RuntimeError, match=r"second gradient in one backward.*use_reentrant=False"):
                sdp(_x(rank, 0).requires_grad_()).square().mean().backward()
            continue
        ddp, plain = DDP(reference), torch.optim.AdamW(reference.parameters(), **KW)
        for step in range(2):
            _step_both(zero, sdp, plain, ddp, _x(rank, step).requires_grad_(), f"checkpointed step {step}")


def test_a_graph_pending_across_wrapping_and_a_gradient_twice_in_one_backward_raise() -> None:
    run_on_ranks(_pending_and_twice_body, 2)


def _two_views_body(rank: int, world_size: int) -> None:
    """Two forwards a step; the second view's loss term only where this rank's batch has positives (the same code on
    every rank, a different graph): against DDP + the plain optimizer, step by step."""
    model, reference = Chain(3), Chain(3)
    zero, sdp = _sdp(model)
    ddp, plain = DDP(reference, find_unused_parameters=True), torch.optim.AdamW(reference.parameters(), **KW)
    for step in range(3):
        positives = rank == 0 or step == 0
        for opt, wrapper in ((zero, sdp), (plain, ddp)):
            opt.zero_grad()
            first, second = wrapper(_x(rank, step), False), wrapper(_x(rank, 50 + step), False)
            loss = first.square().mean() + (second.abs().mean() if positives else 0.0)
            loss.backward()
            opt.step()
        sdp.sync_finished()
        _compare(model, reference, f"two views, step {step}")


def test_two_forwards_whose_second_output_some_ranks_leave_unused_train_as_ddp() -> None:
    """A second output some ranks leave unused: before, one rank waited in the c10d store (the line-up of a
    backward that raised, since replaced by the restart DDP asks for)."""
    run_on_ranks(_two_views_body, 2, timeout=90)
