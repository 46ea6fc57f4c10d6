"""The loaded state of parameters no rank owns (frozen when placed): torch's optimizer keeps what a load gave them
(Adagrad's ``sum`` made with the saving optimizer's ``initial_accumulator_value``), so the optimizer keeps it (its
placer's ``kept_unowned``, by global index) until a placement gives them an owner, who then starts from it, and a
consolidated dict shows it meanwhile."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from distoptim.zero.partition import UNOWNED
from distoptim.zero.shard import MASTER_KEY, LocalShard, slice_entry

__all__ = ["install_kept", "keep_loaded"]


def keep_loaded(
    kept: dict[int, dict[str, Any]],
    owners: Sequence[int],
    params: Sequence[Tensor],
    by_param: dict[Tensor, dict[str, Any]],
) -> None:
    """Keep in ``kept`` (copies of) the loaded entries of the parameters no rank owns, replacing what it held."""
    kept.clear()
    kept.update(
        (index, {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in entry.items() if k != MASTER_KEY})
        for index, param in enumerate(params)
        if owners[index] == UNOWNED and param.numel() and (entry := by_param.get(param))
    )


def install_kept(kept: dict[int, dict[str, Any]], owners: Sequence[int], optim: Optimizer, shard: LocalShard) -> bool:
    """Move the entries whose parameters have an owner now into the owners' local state, as a load; whether any."""
    placed = {index for index in kept if owners[index] != UNOWNED}
    if not placed:
        return False
    formats = getattr(optim, "formats", None)
    for local in shard.locals:
        if local.index not in placed:
            continue
        sliced = slice_entry(kept[local.index], local)
        entry = {key: _as_loaded(local.tensor, key, value) for key, value in sliced.items()}
        if formats is not None:
            formats.encode_entry(local.tensor, entry)
        optim.state[local.tensor] = entry
    for index in placed:
        del kept[index]
    return True


def _as_loaded(tensor: Tensor, key: Any, value: Any) -> Any:
    """``value`` cast as ``Optimizer.load_state_dict`` casts it for ``tensor`` (``step`` kept as it is)."""
    if not isinstance(value, Tensor) or key == "step":
        return value
    if not torch.is_floating_point(value):
        return value.to(tensor.device)
    return value.to(tensor.device, tensor.dtype)
