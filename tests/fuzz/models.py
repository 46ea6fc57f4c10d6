"""The fuzzer's model zoo: one small model (a few thousand parameters) whose features the program switches on.

Features (``program.MODEL_FEATURES``): ``groups3`` three param groups instead of two; ``tied`` an embedding whose
weight is the output head's; ``unused`` a layer no forward uses; ``rank_branch`` a layer rank 0 alone uses;
``odd_branch`` one used on odd steps only; ``frozen`` a frozen layer in the main path (the ``unfreeze`` action
thaws it); ``extra`` a frozen layer outside the optimizer (``add_group`` thaws it and adds it as a group); ``bf16``
a bf16 head (``master`` in the mode adds fp32 master weights); ``batchnorm`` BatchNorm buffers; ``conv`` a
channels_last convolution on an image input; ``prehook`` a layer whose weight a forward pre-hook registered at
construction (before any wrapping) computes as ``base + delta``; ``sparse`` an ``nn.Embedding(sparse=True)``;
``transposed`` a layer whose weight is stored column-major (not row-major in memory), of an odd element count;
``wide`` two layers of 8,192-element weights (a state format keeps those in bf16 or int8). Every rank builds the
same values from the seed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from tests.fuzz.matrices import hidden_matrices
from tests.fuzz.noise import one_bf16_ulp_up, one_ulp_up_of_sum

WIDTH, VOCAB, BATCH = 16, 11, 4
# Exact programs' gradient grid: each rank's local gradient rounded to multiples of GRID, magnitude capped at CAP, by
# a tensor hook on every parameter (it runs before the gradient is accumulated into .grad, so before DDP's and
# distoptim's hooks read it). 2^19 grid steps per CAP: a sum of up to 32 such values (micro-batches, accumulated
# backwards, ranks), divided by 2 or 4, needs at most 24 bits, so fp32 adds it exactly in any order.
GRID, CAP = 2.0**-16, 2.0**3


WIDE = 512  # the wide layers' hidden width: 512 x 16 weights, twice codecs.MIN_NUMEL (a low-bit state; most of
# the model's elements, so that an even partition cuts inside them)
SKEW = 5  # the transposed layer's outputs: 5 x 16 + 5 elements, a count no world size above 1 divides


def _transposed(linear: nn.Linear) -> nn.Linear:
    """``linear`` with its weight stored column-major (strides ``(1, rows)``): its memory order is not row-major."""
    linear.weight = nn.Parameter(linear.weight.detach().t().contiguous().t())
    return linear


class Composed(nn.Module):
    """A layer whose weight is ``base + delta``, computed by a forward pre-hook (as reparametrizations do)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Parameter(torch.randn(WIDTH, WIDTH) * 0.2)
        self.delta = nn.Parameter(torch.randn(WIDTH, WIDTH) * 0.05)
        self.weight: Tensor | None = None
        self.register_forward_pre_hook(_compose)

    def forward(self, h: Tensor) -> Tensor:
        assert self.weight is not None
        return h + torch.tanh(h @ self.weight.T)


def _compose(module: Composed, args: Any) -> None:
    module.weight = module.base + module.delta


def on_grid(grad: Tensor) -> Tensor:
    """``grad`` clamped to [-CAP, CAP] and rounded to a multiple of ``GRID`` (exact: scaling by 2^16 is)."""
    if grad.is_sparse or grad.dtype != torch.float32:  # not in exact programs (``program.exact_features``)
        return grad
    return grad.clamp(-CAP, CAP).mul_(1 / GRID).round_().mul_(GRID)


def register_gradient_hooks(program: Any, subject: nn.Module, oracle: nn.Module) -> None:
    """A model outside the zoo that both sides train (the GAN's discriminator): the grid on both in exact programs
    at 2 and 4 ranks (``modes.on_grid``), the twin's ulp on the oracle's in the twin pass (noise.py)."""
    import torch.distributed as dist

    grid = bool(program.options.get("exact")) and dist.get_world_size() in (2, 4)
    for model, hooks in ((subject, [on_grid] if grid else []), (oracle, [on_grid] if grid else [])):
        for param in model.parameters():
            for hook in hooks:
                param.register_hook(hook)
            if program.options.get("twin") and model is oracle:
                param.register_hook(one_ulp_up_of_sum(param))


class FuzzModel(nn.Module):
    def __init__(self, features: list[str], seed: int, grid: bool = False, twin: str = "") -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.features = set(features)
        has = self.features.__contains__
        self.inp = nn.Linear(8, WIDTH)
        self.embed = nn.Embedding(VOCAB, WIDTH) if has("tied") else None
        self.conv = nn.Conv2d(1, 2, 3).to(memory_format=torch.channels_last) if has("conv") else None
        self.norm = nn.BatchNorm1d(WIDTH) if has("batchnorm") else None
        self.body = nn.Linear(WIDTH + (8 if has("conv") else 0), WIDTH)
        self.odd = nn.Linear(WIDTH, WIDTH) if has("odd_branch") else None
        self.composed = Composed() if has("prehook") else None
        self.skew = _transposed(nn.Linear(WIDTH, SKEW)) if has("transposed") else None
        self.up = nn.Linear(WIDTH, WIDE, bias=False) if has("wide") else None  # no bias: cuts fall in weights
        self.down = nn.Linear(WIDE, WIDTH) if has("wide") else None
        self.sparse = nn.Embedding(VOCAB, WIDTH, sparse=True) if has("sparse") else None
        self.rank0 = nn.Linear(WIDTH, WIDTH) if has("rank_branch") else None
        self.never = nn.Linear(WIDTH, 4) if has("unused") else None
        self.frozen = nn.Linear(WIDTH, WIDTH) if has("frozen") else None
        self.extra = nn.Linear(WIDTH, WIDTH) if has("extra") else None
        self.head = nn.Linear(WIDTH, WIDTH)
        if has("bf16"):
            self.head.to(torch.bfloat16)
        self.out = nn.Linear(WIDTH, VOCAB, bias=False)
        if self.embed is not None:
            self.out.weight = self.embed.weight
        if grid:  # registered before any wrapper's hooks (theirs only look at .grad, not at the gradient passed)
            for param in self.parameters():
                param.register_hook(on_grid)
        if twin:  # the noise-measuring oracle's gradients, one ulp up (noise.py); ``twin="muon"``: Muon's in bf16
            matrices = hidden_matrices(self) if twin == "muon" else set()
            for param in self.parameters():
                param.register_hook(one_bf16_ulp_up if id(param) in matrices else one_ulp_up_of_sum(param))
        for frozen in (self.frozen, self.extra):  # frozen after the hooks: a hook needs requires_grad
            if frozen is not None:
                frozen.requires_grad_(False)

    def forward(self, x: Tensor, tokens: Tensor, image: Tensor, step: int, rank: int) -> Tensor:
        h = torch.tanh(self.inp(x))
        if self.embed is not None:
            h = h + self.embed(tokens).mean(1)
        if self.sparse is not None:
            h = h + self.sparse(tokens).mean(1)
        if self.norm is not None:
            h = self.norm(h)
        if self.conv is not None:
            picture = torch.tanh(self.conv(image.contiguous(memory_format=torch.channels_last))).flatten(1)
            h = torch.cat([h, picture], 1)
        h = torch.tanh(self.body(h))
        if self.composed is not None:
            h = self.composed(h)
        if self.skew is not None:
            h = torch.cat([h[:, :SKEW] + torch.tanh(self.skew(h)), h[:, SKEW:]], 1)
        if self.up is not None and self.down is not None:
            h = h + torch.tanh(self.down(torch.tanh(self.up(h))))
        if self.odd is not None and step % 2 == 1:
            h = h + torch.tanh(self.odd(h))
        if self.rank0 is not None and rank == 0:
            h = h + torch.tanh(self.rank0(h))
        if self.frozen is not None:
            h = h + self.frozen(h)
        if self.extra is not None:
            h = h + self.extra(h)
        h = self.head(h.to(self.head.weight.dtype)).float()
        return self.out(torch.tanh(h))


def param_groups(model: FuzzModel, lr: float) -> list[dict[str, Any]]:
    """Two or three groups over every parameter but ``extra``'s (frozen ones included: unfreezing needs them there);
    the first has its own learning rate."""
    params = [p for name, p in model.named_parameters() if not name.startswith("extra.")]
    if "groups3" in model.features:
        third = len(params) // 3
        return [
            {"params": params[:third], "lr": lr * 2},
            {"params": params[third : 2 * third]},
            {"params": params[2 * third :], "lr": lr / 2},
        ]
    return [{"params": params[:3], "lr": lr * 2}, {"params": params[3:]}]


def batch(rank: int, step: int, micro: int) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's inputs for one micro-batch of one step (x, tokens, image): the same on the subject and oracle."""
    generator = torch.Generator().manual_seed(100_000 + 1000 * step + 10 * micro + rank)
    x = torch.randn(BATCH, 8, generator=generator)
    tokens = torch.randint(0, VOCAB, (BATCH, 3), generator=generator)
    image = torch.randn(BATCH, 1, 4, 4, generator=generator)
    return x, tokens, image


def layer(model: FuzzModel, name: str) -> nn.Module | None:
    return getattr(model, name, None)
