"""A composite local optimizer (here: a state format) keeps the state its parts make at
construction (Adagrad's sums), as a plain torch optimizer does: a checkpoint taken before the first step holds it,
and ShardedDataParallel's even re-cut sees it (its refusal does not depend on the state format)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from distoptim import ZeroRedundancyOptimizer
from tests._dist import run_on_ranks


def _params() -> list[torch.Tensor]:
    shapes = [(70, 70), (5,), (9,)]
    return [torch.randn(s, generator=torch.Generator().manual_seed(i)).requires_grad_() for i, s in enumerate(shapes)]


def _body(rank: int, world_size: int, variant: str) -> None:
    params, reference_params = _params(), _params()
    extra: dict[str, Any] = {"state_format": variant}
    groups = [{"params": params[:1]}, {"params": params[1:]}]  # a part's later groups too
    zero = ZeroRedundancyOptimizer(groups, torch.optim.Adagrad, lr=0.1, initial_accumulator_value=0.5, **extra)
    reference_groups = [{"params": reference_params[:1]}, {"params": reference_params[1:]}]
    reference = torch.optim.Adagrad(reference_groups, lr=0.1, initial_accumulator_value=0.5)
    zero.consolidate_state_dict(to=0)
    if rank == 0:
        saved, expected = zero.state_dict()["state"], reference.state_dict()["state"]
        assert sorted(saved) == sorted(expected), f"{variant}: state of {sorted(saved)}, torch's of {sorted(expected)}"
        for index, entry in expected.items():
            for key, value in entry.items():
                assert torch.equal(saved[index][key], value), f"{variant}: state[{index}][{key!r}]"


@pytest.mark.parametrize("variant", ["int8", "bf16"])
def test_state_made_at_construction_is_kept(variant: str) -> None:
    run_on_ranks(_body, 2, variant)
