"""Muon on the matrices and AdamW on the rest in one ZeroRedundancyOptimizer (a per-group ``optimizer_class``): each
Muon matrix whole on one rank, balanced by Newton-Schulz cost, against DDP + plain ``torch.optim.Muon`` and
``torch.optim.AdamW`` on a Llama-shaped block (RMSNorm, grouped-query attention, SwiGLU)."""

from __future__ import annotations

import copy
import io
import pickle
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distoptim
from distoptim import ShardedDataParallel, ZeroRedundancyOptimizer, checkpoint
from distoptim.hooks import reduce_to_owners_hook
from distoptim.zero.partition import newton_schulz_cost, partition_parameters
from tests._dist import run_on_ranks

DIM, HEADS, KV_HEADS, HIDDEN, VOCAB, SEQ = 32, 4, 1, 48, 96, 8

CLIP = 0.5  # max_norm, below the gradient's norm at every step (checked): the clip acts
MUON = {"lr": 0.02}
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.05}


class Block(nn.Module):
    """One Llama block between an embedding and an output head: RMSNorm, attention with one k/v head for four query
    heads (k and v have 1/4 of q's rows), SwiGLU."""

    def __init__(self) -> None:
        super().__init__()
        head = DIM // HEADS
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm1, self.norm2, self.norm3 = nn.RMSNorm(DIM), nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.q, self.k, self.v = (nn.Linear(DIM, n * head, bias=False) for n in (HEADS, KV_HEADS, KV_HEADS))
        self.o = nn.Linear(DIM, DIM, bias=False)
        self.w1, self.w3 = nn.Linear(DIM, HIDDEN, bias=False), nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def matrices(self) -> list[nn.Parameter]:
        return [m.weight for m in (self.q, self.k, self.v, self.o, self.w1, self.w3, self.w2)]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        batch, length, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(batch, length, HEADS, -1).transpose(1, 2)
        k, v = (proj(h).view(batch, length, KV_HEADS, -1).transpose(1, 2) for proj in (self.k, self.v))
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attention.transpose(1, 2).reshape(batch, length, DIM))
        h = self.norm2(x)
        x = x + self.w2(F.silu(self.w1(h)) * self.w3(h))
        return self.head(self.norm3(x))


def _groups(model: Block, muon_key: bool = True) -> list[dict[str, Any]]:
    matrices = {id(p) for p in model.matrices()}
    rest = [p for p in model.parameters() if id(p) not in matrices]
    muon: dict[str, Any] = {"params": model.matrices(), **MUON}
    if muon_key:
        muon["optimizer_class"] = torch.optim.Muon
    return [muon, {"params": rest}]


def _loss(ddp: nn.Module, rank: int, step: int) -> torch.Tensor:
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(100 * step + rank))
    logits = ddp(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


class Reference:
    """DDP + plain Muon on the block's matrices + plain AdamW on the rest."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = Block()
        self.ddp = DDP(self.model)
        muon, rest = _groups(self.model, muon_key=False)
        self.muon = torch.optim.Muon(muon["params"], **MUON)
        self.adamw = torch.optim.AdamW(rest["params"], **ADAMW)

    def train(self, rank: int, steps: range, nudge: bool = False) -> None:
        for step in steps:
            self.muon.zero_grad()
            self.adamw.zero_grad()
            _loss(self.ddp, rank, step).backward()
            if nudge:  # the gradient one ulp off: how far a last-bit difference carries
                for p in self.model.parameters():
                    p.grad = torch.nextafter(p.grad, torch.full_like(p.grad, torch.inf))
            self.muon.step()
            self.adamw.step()


def _zero_model(**kwargs: Any) -> tuple[Block, DDP, ZeroRedundancyOptimizer]:
    torch.manual_seed(0)
    model = Block()
    ddp = DDP(model)
    zero = ZeroRedundancyOptimizer(_groups(model), torch.optim.AdamW, **ADAMW, **kwargs)
    return model, ddp, zero


def _train(ddp: nn.Module, zero: ZeroRedundancyOptimizer, rank: int, steps: range) -> None:
    for step in steps:
        zero.zero_grad()
        _loss(ddp, rank, step).backward()
        zero.step()


def _distance(model: nn.Module, reference: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))


class CountNewtonSchulz:
    """Counts the Newton-Schulz orthogonalizations this rank runs (torch's Muon calls one per matrix per step)."""

    def __init__(self) -> None:
        self.calls = 0
        self._original = torch.optim._muon._zeropower_via_newtonschulz

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        return self._original(*args, **kwargs)


def _parity_body(rank: int, world_size: int) -> None:
    steps = range(4)
    reference = Reference()
    reference.train(rank, steps)
    nudged = Reference()
    nudged.train(rank, steps, nudge=True)
    tolerance = 4 * _distance(nudged.model, reference.model)  # last-bit gradient differences, measured here
    assert tolerance > 0
    for partition in ("greedy", "even"):
        for bucket_view in (False, True):
            what = f"partition={partition}, parameters_as_bucket_view={bucket_view}"
            model, ddp, zero = _zero_model(partition=partition, parameters_as_bucket_view=bucket_view)
            counter = CountNewtonSchulz()
            with mock.patch("torch.optim._muon._zeropower_via_newtonschulz", counter):
                _train(ddp, zero, rank, steps)
            calls = torch.tensor([counter.calls])
            dist.all_reduce(calls)
            assert calls.item() == len(steps) * len(model.matrices()), f"{what}: {calls.item()} orthogonalizations"
            for param in model.matrices():  # each matrix whole on one rank
                (fragment,) = zero.fragments_of(param) or ()
                assert fragment.length == param.numel(), what
            assert _distance(model, reference.model) == 0, what  # DDP's gradient: bitwise
            assert zero.param_groups[0].get("betas") is None, "AdamW's betas leaked into the Muon group"
    # ZeRO-2: gradients reduced to their owners (another reduction order than DDP's all-reduce)
    model, ddp, zero = _zero_model(partition="even")
    ddp.register_comm_hook(zero, reduce_to_owners_hook)
    _train(ddp, zero, rank, steps)
    assert _distance(model, reference.model) <= tolerance, (_distance(model, reference.model), tolerance)
    # ShardedDataParallel: each whole matrix's gradient delivered whole to its owner, the rest cut evenly
    for partition in ("greedy", "even"):
        for overlap in (False, True):
            torch.manual_seed(0)
            model = Block()
            zero = ZeroRedundancyOptimizer(_groups(model), torch.optim.AdamW, partition=partition, **ADAMW)
            sdp = ShardedDataParallel(model, zero, bucket_cap_mb=0.004, overlap_param_sync=overlap)
            _train(sdp, zero, rank, steps)
            zero.sync_finished()
            for param in model.matrices():
                (fragment,) = zero.fragments_of(param) or ()
                assert fragment.length == param.numel()
            distance = _distance(model, reference.model)
            assert distance <= tolerance, (f"ShardedDataParallel {partition} {overlap}", distance, tolerance)
    # master weights: a bfloat16 model, its owned pieces stepped as float32 copies, as plain optimizers on float32
    # copies of every parameter (gradients upcast, results rounded back)
    torch.manual_seed(0)
    plain_model = Block().to(torch.bfloat16)
    plain_ddp = DDP(plain_model)
    copies = {p: p.detach().float().requires_grad_() for p in plain_model.parameters()}
    muon_params, rest = (g["params"] for g in _groups(plain_model, muon_key=False))
    plain = [
        torch.optim.Muon([copies[p] for p in muon_params], **MUON),
        torch.optim.AdamW([copies[p] for p in rest], **ADAMW),
    ]
    for step in steps:
        plain_model.zero_grad()
        _loss(plain_ddp, rank, step).backward()
        for p, copy_ in copies.items():
            copy_.grad = p.grad.float()
        for optim in plain:
            optim.step()
        with torch.no_grad():
            for p, copy_ in copies.items():
                p.copy_(copy_)
    for partition in ("greedy", "even"):
        torch.manual_seed(0)
        model = Block().to(torch.bfloat16)
        ddp = DDP(model)
        zero = ZeroRedundancyOptimizer(
            _groups(model), torch.optim.AdamW, partition=partition, master_dtype=torch.float32, **ADAMW
        )
        _train(ddp, zero, rank, steps)
        assert _distance(model, plain_model) == 0, f"master_dtype, {partition}"
    # torch.amp.GradScaler drives the composite like one optimizer: the same scaled steps as plain optimizers
    scaled_ref = Reference()
    scaler_ref = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    model, ddp, zero = _zero_model(partition="even")
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    for step in steps:
        for optim in (scaled_ref.muon, scaled_ref.adamw):
            optim.zero_grad()
        scaler_ref.scale(_loss(scaled_ref.ddp, rank, step)).backward()
        scaler_ref.step(scaled_ref.muon)
        scaler_ref.step(scaled_ref.adamw)
        scaler_ref.update()
        zero.zero_grad()
        scaler.scale(_loss(ddp, rank, step)).backward()
        scaler.step(zero)
        scaler.update()
    assert scaler.get_scale() == scaler_ref.get_scale()
    assert _distance(model, scaled_ref.model) == 0, "GradScaler"
    # clipping over all groups, before orthogonalization, as torch's clip on DDP's gradient: the norm equals torch's
    # (summed from the owned pieces, in another order: within 1e-6 relative), and the gradients are scaled as torch
    # scales them by that norm. The reference scales by our norm: a last-ulp difference of the scale moves bf16
    # Newton-Schulz roundings on some machines by 1e-4, which no nudge measures reliably
    model, ddp, zero = _zero_model(partition="even")
    clipped = Reference()
    for step in steps:
        zero.zero_grad()
        clipped.muon.zero_grad()
        clipped.adamw.zero_grad()
        _loss(ddp, rank, step).backward()
        _loss(clipped.ddp, rank, step).backward()
        ours = zero.clip_grad_norm_(CLIP)
        params = list(clipped.model.parameters())
        want = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
        close = 1e-6 if step == steps[0] else 1e-4  # after a step, the parameters are within the NS distance
        assert want > CLIP and abs(float(ours) - want) <= close * want, ("clip_grad_norm_", step, float(ours), want)
        torch.nn.utils.clip_grads_with_norm_(params, CLIP, ours)
        zero.step()
        clipped.muon.step()
        clipped.adamw.step()
    assert _distance(model, clipped.model) <= tolerance, ("clip_grad_norm_", _distance(model, clipped.model), tolerance)


class _PlainData(pickle.Unpickler):
    """Unpickles plain data only (what ``weights_only=True`` would read): any class or function is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")


def _checkpoint_body(rank: int, world_size: int, saved: dict[str, Any] | None) -> dict[str, Any] | None:
    """Saves (2 ranks): consolidated and sharded checkpoints after 2 steps, checked by a same-size resume; or
    resumes (3 ranks) from the 2-rank checkpoints, against plain optimizers loaded from the consolidated one."""
    if saved is None:
        reference = Reference()
        reference.train(rank, range(4))
        model, ddp, zero = _zero_model(partition="even")
        _train(ddp, zero, rank, range(2))
        directory = tempfile.mkdtemp() if rank == 0 else None
        names = [directory]
        dist.broadcast_object_list(names, src=0)
        saved_dir = names[0]
        assert saved_dir is not None
        zero.consolidate_state_dict(to=0)
        if rank == 0:  # through a file, read back as plain data: the group's class is stored by its name
            saved_state = zero.state_dict()
            assert saved_state["param_groups"][0]["optimizer_class"] == "torch.optim.Muon"
            assert zero.param_groups[0]["optimizer_class"] is torch.optim.Muon  # users still see the class
            torch.save(saved_state, Path(saved_dir) / "consolidated.pt")
        dist.barrier()
        state = torch.load(Path(saved_dir) / "consolidated.pt", weights_only=True)
        sharded_state = zero.sharded_state_dict()
        groups = _PlainData(io.BytesIO(sharded_state["param_groups"])).load()  # no class objects in it either
        assert groups[0]["optimizer_class"] == "torch.optim.Muon"
        checkpoint.save({"optim": sharded_state}, Path(saved_dir) / "ckpt")
        model_state = {k: v.clone() for k, v in model.state_dict().items()}
        for load in ("consolidated", "sharded"):  # resume at this world size: bitwise
            resumed, ddp2, zero2 = _zero_model(partition="greedy")
            resumed.load_state_dict(model_state)
            if load == "consolidated":
                zero2.load_state_dict(state)
            else:
                shard = {"optim": zero2.sharded_state_dict()}
                checkpoint.load(shard, Path(saved_dir) / "ckpt")
                zero2.load_sharded_state_dict(shard["optim"])
            _train(ddp2, zero2, rank, range(2, 4))
            assert _distance(resumed, reference.model) == 0, load
            assert zero2.param_groups[0]["optimizer_class"] is torch.optim.Muon, load  # not its saved name
        torch.manual_seed(0)
        other = Block()  # the same groups, all AdamW: the Muon group's checkpoint does not load into it
        adamw_only = ZeroRedundancyOptimizer(_groups(other, muon_key=False), torch.optim.AdamW, **ADAMW)
        with pytest.raises(ValueError, match="names optimizer_class torch.optim.Muon"):
            adamw_only.load_state_dict(state)
        return {"state": state, "model": model_state, "dir": saved_dir}
    for load in ("consolidated", "sharded"):  # at 3 ranks: plain optimizers loaded from the consolidated dict
        reference = Reference()
        reference.model.load_state_dict(saved["model"])
        state = copy.deepcopy(saved["state"])  # a plain load aliases the dict's tensors, and its step writes them
        count = len(reference.model.matrices())
        for optim, group, numbers in (
            (reference.muon, state["param_groups"][0], range(count)),
            (reference.adamw, state["param_groups"][1], range(count, count + len(state["param_groups"][1]["params"]))),
        ):
            group = {k: v for k, v in group.items() if k != "optimizer_class"}
            optim.load_state_dict(
                {
                    "state": {i: state["state"][n] for i, n in enumerate(numbers) if n in state["state"]},
                    "param_groups": [{**group, "params": list(range(len(numbers)))}],
                }
            )
        reference.train(rank, range(2, 4))
        model, ddp, zero = _zero_model(partition="even")
        model.load_state_dict(saved["model"])
        if load == "consolidated":
            zero.load_state_dict(torch.load(Path(saved["dir"]) / "consolidated.pt", weights_only=True))
        else:
            shard = {"optim": zero.sharded_state_dict()}
            checkpoint.load(shard, Path(saved["dir"]) / "ckpt")
            zero.load_sharded_state_dict(shard["optim"])
        _train(ddp, zero, rank, range(2, 4))
        assert _distance(model, reference.model) == 0, load
    return None


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_muon_and_adamw_match_ddp_with_plain_optimizers(world_size: int) -> None:
    run_on_ranks(_parity_body, world_size, timeout=240)


def test_checkpoints_resume_at_the_same_and_another_world_size() -> None:
    saved = run_on_ranks(_checkpoint_body, 2, None, timeout=240)[0]
    run_on_ranks(_checkpoint_body, 3, saved, timeout=240)


def _llama_matrices(layers: int = 8, dim: int = 4096, kv: int = 1024, hidden: int = 14336) -> list[tuple[int, int]]:
    per_layer = [(dim, dim), (kv, dim), (kv, dim), (dim, dim), (hidden, dim), (hidden, dim), (dim, hidden)]
    return per_layer * layers


@pytest.mark.parametrize("world_size", [3, 4])
def test_newton_schulz_cost_is_balanced_on_a_llama_model(world_size: int) -> None:
    matrices = _llama_matrices()
    elementwise = [(128256, 4096), (4096, 128256)] + [(4096,)] * 17  # embedding, head, norms (AdamW)
    shapes: list[tuple[int, ...]] = [*matrices, *elementwise]
    whole = [True] * len(matrices) + [False] * len(elementwise)
    costs = [newton_schulz_cost(s) for s in shapes]
    numels = [int(torch.Size(s).numel()) for s in shapes]
    for mode in ("greedy", "even"):
        plan = partition_parameters(numels, [True] * len(shapes), world_size, mode=mode, whole=whole, costs=costs)
        loads = [0] * world_size
        for index in range(len(matrices)):
            (fragment,) = plan.fragments[index]  # never cut
            assert fragment.length == numels[index]
            loads[fragment.rank] += costs[index]
        assert max(loads) / (sum(loads) / world_size) <= 1.10, (mode, loads)


def _refusals_body(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = Block()
    groups = _groups(model)
    conv = nn.Conv2d(2, 4, 3)
    cases = [
        ([{"params": [model.norm1.weight], "optimizer_class": torch.optim.Muon}], {}, "vector or scalar"),
        ([{"params": [conv.weight], "optimizer_class": torch.optim.Muon}], {}, "flattening it to a matrix"),
        ([{"params": [conv.weight], "optimizer_class": torch.optim.LBFGS}], {}, "couples every parameter"),
        (groups, {"overlap_with_ddp": True}, "overlap_with_ddp=True steps every group"),
        ([{"params": [model.q.weight], "optimizer_class": torch.optim.Muon(model.matrices())}], {}, "pass the class"),
    ]
    for params, kwargs, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            ZeroRedundancyOptimizer(params, torch.optim.AdamW, **kwargs)
    with pytest.raises(ValueError, match="vector or scalar"):  # the constructor's class is Muon
        ZeroRedundancyOptimizer(list(model.parameters()), torch.optim.Muon)
    with pytest.raises(ValueError, match="has none"):
        ZeroRedundancyOptimizer(model.matrices(), torch.optim.Muon, overlap_with_ddp=True)
    # add_param_group takes the key, and the constructor's class may be Muon or Adafactor itself
    zero = ZeroRedundancyOptimizer([groups[1]], torch.optim.AdamW, lr=1e-3)
    model(torch.zeros(1, 2, dtype=torch.long)).sum().backward()
    zero.step()
    before = {id(p): {k: v.clone() for k, v in zero.state[p].items()} for p in groups[1]["params"] if p in zero.state}
    zero.add_param_group(groups[0])
    assert zero.param_groups[1]["optimizer_class"] is torch.optim.Muon and "betas" not in zero.param_groups[1]
    assert zero.param_groups[1]["lr"] == MUON["lr"] and zero.param_groups[0]["lr"] == 1e-3
    for p in groups[1]["params"]:  # the AdamW state survives the switch to one optimizer per class
        if id(p) in before:
            assert all(torch.equal(zero.state[p][k], v) for k, v in before[id(p)].items())
    zero.step()
    assert sum(1 for p in model.matrices() if p in zero.state) == len(zero.local_shard.groups[1])
    # a group's class is fixed when it is added: editing the key afterwards is refused at the step, on every rank
    # (Muon went on stepping the group while param_groups and checkpoints named the new class)
    zero.param_groups[1]["optimizer_class"] = torch.optim.SGD
    with pytest.raises(ValueError, match="param group 1: its 'optimizer_class' was changed to SGD"):
        zero.step()
    # in add_param_group too, before the new group is added; and an edit on one rank only raises on every rank
    # (helper-27's review: the check ran after the group was placed, and on the editing rank alone)
    extra = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="'optimizer_class' was changed to SGD"):
        zero.add_param_group({"params": list(extra.parameters())})
    assert len(zero.param_groups) == 2
    zero.param_groups[1]["optimizer_class"] = torch.optim.Muon
    zero.step()
    if rank == 1:
        zero.param_groups[1]["optimizer_class"] = torch.optim.SGD
    with pytest.raises(ValueError, match="'optimizer_class' was changed to SGD"):
        zero.add_param_group({"params": list(extra.parameters())})
    assert len(zero.param_groups) == 2
    zero.param_groups[1]["optimizer_class"] = torch.optim.Muon
    for cls in (torch.optim.Muon, torch.optim.Adafactor):
        zero = ZeroRedundancyOptimizer(model.matrices(), cls, partition="even")
        assert all(len(zero.fragments_of(p) or ()) == 1 for p in model.matrices())
    assert distoptim.ZeroRedundancyOptimizer is ZeroRedundancyOptimizer


def test_refusals_and_per_group_classes_on_every_rank() -> None:
    run_on_ranks(_refusals_body, 2, timeout=120)


def test_whole_tensors_stay_whole_when_an_even_plan_grows() -> None:
    numels, whole, costs = [100, 50, 30, 40, 60], [False, True, True, False, True], [100, 500, 300, 40, 600]
    plan = partition_parameters(numels, [True] * 5, 2, mode="even", whole=whole, costs=costs)
    grown = partition_parameters(
        [*numels, 20, 30], [True] * 7, 2, plan, mode="even", whole=[*whole, True, False], costs=[*costs, 20, 30]
    )
    assert grown.fragments[:5] == plan.fragments  # what was placed stays put
    for index, is_whole in enumerate([*whole, True, False]):
        if is_whole:
            (fragment,) = grown.fragments[index]
            assert fragment.length == grown.numels[index]
    # whole ones balanced by cost among themselves (600 | 500 + 300), the new one to the lighter rank
    assert [grown.owners[i] for i in (4, 1, 2, 5)] == [0, 1, 1, 0]
    assert grown.owners[0] == grown.owners[6] == -2  # elementwise ones cut evenly (these straddle ranks)


def test_whole_tensors_are_cut_into_buckets_but_never_cut() -> None:
    """ShardedDataParallel's regions (``region_numel``): whole-tensor parameters fill regions of their own, each
    parameter inside its owner's range."""
    numels, whole = [100, 50, 30, 40, 60], [False, True, True, False, True]
    plan = partition_parameters(numels, [True] * 5, 2, mode="even", whole=whole, region_numel={0: 60})
    (layout,) = plan.layouts
    assert len(layout.bounds) == 3 + 2  # three whole-tensor regions (60 | 30 | 50), two for the others
    for index in (1, 2, 4):
        (fragment,) = plan.fragments[index]
        assert fragment.length == numels[index]


def test_a_saved_groups_class_is_compared_by_name_and_an_older_dict_with_the_class_still_loads() -> None:
    from distoptim.checkpoint.consolidated import saved_param_groups, select_shard

    matrix, vector = torch.zeros(3, 4), torch.zeros(4)
    groups = [{"params": [matrix], "optimizer_class": torch.optim.Muon, "lr": 0.02}, {"params": [vector], "lr": 1e-3}]
    saved = saved_param_groups(groups)
    assert saved[0] == {"optimizer_class": "torch.optim.Muon", "lr": 0.02, "params": [0]}
    assert groups[0]["optimizer_class"] is torch.optim.Muon  # the optimizer's own groups keep the class
    for stored in ("torch.optim.Muon", torch.optim.Muon):  # ours, and a dict saved before classes were named
        state = {"state": {}, "param_groups": [{**saved[0], "optimizer_class": stored}, saved[1]]}
        _, hyperparameters = select_shard(state, groups, torch.optim.AdamW)
        assert hyperparameters[0] == {"lr": 0.02}  # the group's class is not replaced by the saved name
    for stored in ("torch.optim.AdamW", None):
        wrong = {**saved[0], "optimizer_class": stored} if stored else {"lr": 0.02, "params": [0]}
        with pytest.raises(ValueError, match="names optimizer_class"):
            select_shard({"state": {}, "param_groups": [wrong, saved[1]]}, groups, torch.optim.AdamW)
