"""Gradient accumulation with ``reduce_to_owners_hook``: a step (or a clip) over gradients a synced backward added
onto what a previous one reduced to owners is refused on every rank (it summed the ranks' leftovers: silently wrong);
the ways that accumulate right (``no_sync()``, clearing between backwards, to None or in place, with DDP's bucket
views), DDP's static graph, a ``torch.autograd.grad`` between steps and a backward added onto the gradients but
cleared before the next step (a GAN's generator step; cleared to None, or in place with
``zero_grad(set_to_none=False)``) train as DDP + the plain optimizer do (clipped too, in place: the same norm), and so
do clears through ``.data`` (``p.grad.data.zero_()``, which leaves ``_version`` alone)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distoptim import ZeroRedundancyOptimizer
from distoptim.hooks import reduce_to_owners_hook
from tests._dist import run_on_ranks


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(rank: int, step: int, micro: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank))


def _train(rank: int, how: str, partition: str) -> str:
    """Two micro-batches a step, three steps, against DDP + SGD; returns "ok" or the error raised."""
    bucket_view, static = how == "bucket_view", how == "static_graph"
    model, reference = _net(), _net()
    ddp = DDP(model, bucket_cap_mb=1e-4, gradient_as_bucket_view=bucket_view, static_graph=static)
    reference_ddp = DDP(reference, bucket_cap_mb=1e-4)
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, partition=partition, lr=0.1, momentum=0.9)
    ddp.register_comm_hook(zero, reduce_to_owners_hook)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    try:
        for step in range(3):
            if how.startswith("data_zero") or how == "added_then_data_cleared":  # the old idiom: no _version bump
                for param in model.parameters():
                    if param.grad is not None:
                        param.grad.data.zero_()
            elif how != "across_steps" or step == 0:
                zero.zero_grad(set_to_none=how != "in_place")
            plain.zero_grad()
            for micro in range(2):
                if how in ("no_sync", "bucket_view", "in_place") and micro == 0:
                    with ddp.no_sync(), reference_ddp.no_sync():
                        ddp(_batch(rank, step, micro)).square().mean().backward()
                        reference_ddp(_batch(rank, step, micro)).square().mean().backward()
                else:
                    ddp(_batch(rank, step, micro)).square().mean().backward()
                    reference_ddp(_batch(rank, step, micro)).square().mean().backward()
                if how in (
                    "static_graph",
                    "autograd_grad",
                    "added_then_cleared",
                    "data_zero",
                    "added_then_data_cleared",
                ) or (how in ("synced", "synced_clipped", "across_steps") and step == 0):
                    break  # one micro-batch (DDP's static graph has no no_sync); the refusals come later
            if how in ("synced_clipped", "in_place"):  # clipping reads the gradients as the step does
                try:
                    norm = zero.clip_grad_norm_(0.05)
                except RuntimeError as error:
                    return f"clip: {error}"
                want_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
                torch.testing.assert_close(norm, want_norm, msg=f"{how} {partition} step {step} norm")
            zero.step()
            plain.step()
            for ours, want in zip(model.parameters(), reference.parameters()):
                torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-6, msg=f"{how} {partition} step {step}")
            if how == "autograd_grad":  # a diagnostic gradient, never written to .grad: not an accumulation
                torch.autograd.grad(model(_batch(rank, step, 9)).sum(), list(model.parameters()))
            if how in ("added_then_cleared", "added_then_data_cleared"):  # a GAN's generator backward through D
                ddp(_batch(rank, step, 8)).square().mean().backward()
    except RuntimeError as error:
        return str(error)
    return "ok"


HOWS = ["synced", "synced_clipped", "across_steps", "no_sync", "in_place", "bucket_view", "static_graph"]
HOWS += ["autograd_grad", "added_then_cleared", "data_zero", "added_then_data_cleared", "data_zero_synced"]
# two synced backwards with no clearing between them
REFUSED = ("synced", "synced_clipped", "across_steps", "data_zero_synced")


def _body(rank: int, world_size: int) -> list[tuple[str, str, str]]:
    return [(how, partition, _train(rank, how, partition)) for how in HOWS for partition in ["greedy", "even"]]


@pytest.mark.parametrize("world_size", [2, 3])
def test_accumulating_onto_reduced_gradients_is_refused_and_the_right_ways_train_as_ddp(world_size: int) -> None:
    for results in run_on_ranks(_body, world_size, timeout=180):
        for how, partition, outcome in results:
            if how in REFUSED:
                assert "a backward added onto the gradients" in outcome, (how, partition, outcome)
                assert "no_sync()" in outcome and "ShardedDataParallel" in outcome
                assert outcome.startswith("clip: ") == (how == "synced_clipped"), (how, outcome)
            else:
                assert outcome == "ok", (how, partition, outcome)


def _gan(rank: int, partition: str) -> None:
    """A GAN whose discriminator is cleared in place (``ddp_D.zero_grad(set_to_none=False)``): the generator's
    backward adds onto D's reduced gradients, the in-place clear zeroes them; every step equals DDP + the plain
    optimizers."""
    torch.manual_seed(0)
    generator, discriminator = nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    ref_generator, ref_discriminator = nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    ref_generator.load_state_dict(generator.state_dict())
    ref_discriminator.load_state_dict(discriminator.state_dict())
    ddp_g, ddp_d = DDP(generator), DDP(discriminator, bucket_cap_mb=1e-4)
    ref_g, ref_d = DDP(ref_generator), DDP(ref_discriminator, bucket_cap_mb=1e-4)
    zero = ZeroRedundancyOptimizer(discriminator.parameters(), torch.optim.AdamW, partition=partition, lr=0.01)
    ddp_d.register_comm_hook(zero, reduce_to_owners_hook)
    plain_d = torch.optim.AdamW(ref_discriminator.parameters(), lr=0.01)
    opt_g, plain_g = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (generator, ref_generator))
    for step in range(3):
        data = torch.Generator().manual_seed(100 * step + rank)
        real, noise = torch.randn(4, 8, generator=data), torch.randn(4, 4, generator=data)
        for g, d, opt_d, opt in ((ddp_g, ddp_d, zero, opt_g), (ref_g, ref_d, plain_d, plain_g)):
            d.zero_grad(set_to_none=False)  # the discriminator's step
            d(torch.cat([real, g(noise).detach()])).mean().backward()
            opt_d.step()
            g.zero_grad()  # the generator's step: its backward goes through D, adding onto D's gradients
            (-d(g(noise)).mean()).backward()
            opt.step()
        ours_all = [*generator.parameters(), *discriminator.parameters()]
        for ours, want in zip(ours_all, [*ref_generator.parameters(), *ref_discriminator.parameters()]):
            torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-6, msg=f"GAN {partition} step {step}")


def _gan_body(rank: int, world_size: int) -> None:
    for partition in ["greedy", "even"]:
        _gan(rank, partition)


def test_a_gan_whose_discriminator_is_cleared_in_place_trains_as_ddp() -> None:
    run_on_ranks(_gan_body, 2, timeout=120)
