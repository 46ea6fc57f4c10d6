"""The single-process reference of a state format: a plain torch.optim step, then each eligible state entry of the
stepped tensors through the library's codec (encode, then decode), which is what a ZeRO step leaves between steps."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from distoptim.zero import codecs


def eligible(param: Tensor, fmt: str) -> bool:
    """Whether ``param``'s state is kept in ``fmt`` (decided on the whole parameter, as ``state_formats`` does)."""
    return fmt != "fp32" and param.is_floating_point() and param.numel() >= codecs.MIN_NUMEL


def round_trip(
    state: Mapping[Tensor, dict[str, Any]], stepped: Iterable[Tensor], formats: Mapping[Tensor, str]
) -> None:
    """Each stepped tensor's parameter-shaped state through its format's codec, in place."""
    for tensor in stepped:
        fmt, entry = formats.get(tensor, "fp32"), state.get(tensor)
        if fmt == "fp32" or not entry:
            continue
        for key in [k for k, v in entry.items() if codecs.is_encodable(k, v) and v.shape == tensor.shape]:
            laid = torch.empty_like(tensor, dtype=entry[key].dtype).copy_(entry[key])  # blocks: the parameter's order
            entry[key] = codecs.decode(key, codecs.encode(key, laid, fmt), fmt, tensor.dtype)
