"""The loaded state of parameters no rank owns (frozen when placed): torch's optimizer keeps what a load gave them
(Adagrad's ``sum`` made with the saving optimizer's ``initial_accumulator_value``), so it is kept here until a
placement gives them an owner, who then starts from it, and a consolidated dict shows it meanwhile."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from distoptim.zero.partition import UNOWNED
from distoptim.zero.shard import MASTER_KEY, slice_entry

__all__ = ["install_kept", "keep_loaded"]


def keep_loaded(zero: Any, by_param: dict[Tensor, dict[str, Any]]) -> None:
    """Keep (copies of) the loaded entries of the parameters no rank owns; a load replaces what an earlier kept."""
    owners = zero.plan.owners
    zero._kept_unowned = {
        index: {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in entry.items() if k != MASTER_KEY}
        for index, param in enumerate(zero.global_params)
        if owners[index] == UNOWNED and param.numel() and (entry := by_param.get(param))
    }


def install_kept(zero: Any) -> None:
    """After a placement: the kept entries of parameters that have an owner now go into the owners' local state (cut
    to their fragments, cast as ``torch.optim``'s load casts), as a load would have put them; then are dropped."""
    kept, owners = zero._kept_unowned, zero.plan.owners
    placed = {index for index in kept if owners[index] != UNOWNED}
    if not placed:
        return
    optim = zero.local_optimizer
    formats = getattr(optim, "formats", None)
    for local in zero.local_shard.locals:
        if local.index not in placed:
            continue
        sliced = slice_entry(kept[local.index], local)
        entry = {key: _as_loaded(local.tensor, key, value) for key, value in sliced.items()}
        if formats is not None:
            formats.encode_entry(local.tensor, entry)
        optim.state[local.tensor] = entry
    zero._kept_unowned = {index: entry for index, entry in kept.items() if index not in placed}
    zero._consolidated = None


def _as_loaded(tensor: Tensor, key: Any, value: Any) -> Any:
    """``value`` cast as ``Optimizer.load_state_dict`` casts it for ``tensor`` (``step`` kept as it is)."""
    if not isinstance(value, Tensor) or key == "step":
        return value
    if not torch.is_floating_point(value):
        return value.to(tensor.device)
    return value.to(tensor.device, tensor.dtype)
