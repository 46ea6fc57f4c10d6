"""The marker ``ShardedDataParallel`` leaves in ``.grad`` where its store holds the gradient sharded: the
parameter's shape without values, so that what a program does to ``.grad`` is seen (``gradients.py``: set to None,
zeroed, replaced) and what would read values it does not have raises instead of answering wrong."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["GradientMarker"]


class GradientMarker(Tensor):
    """What ``.grad`` holds while the store holds the parameter's gradient: the parameter's shape, one element of
    storage, no values. Refused by default: every operation that would read its values or write into it raises,
    saying where the gradient is (a NaN norm or a False ``isinf`` would be a silent wrong answer). Allowed: its
    metadata, clearing it (``zero_grad`` either way, through any object: the store sees it), and what ``module.to()``,
    ``.data``, ``.detach()`` and ``copy.deepcopy`` do to it, whose results stay markers."""

    _CLEARS = frozenset({"zero_", "_foreach_zero_", "requires_grad_", "detach_", "__set__"})
    _METADATA = frozenset({"size", "dim", "ndimension", "numel", "nelement", "stride", "element_size", "__len__"})
    _METADATA |= {"is_floating_point", "is_complex", "is_contiguous", "get_device", "__hash__"}
    _METADATA |= {"_has_compatible_shallow_copy_type", "_is_view", "storage_offset", "untyped_storage", "data_ptr"}
    _STAY_MARKERS = frozenset({"__get__", "to", "type", "float", "double", "half", "bfloat16", "cpu", "cuda"})
    _STAY_MARKERS |= {"detach", "_to_copy", "as_subclass"}

    @staticmethod
    def like(param: Tensor) -> GradientMarker:
        base = torch.full((), float("nan"), dtype=param.dtype, device=param.device)
        return base.expand(param.shape).as_subclass(GradientMarker)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", str(func))
        if name in cls._STAY_MARKERS:
            return super().__torch_function__(func, types, args, kwargs)  # type: ignore[no-untyped-call]
        assigns_values = name == "__set__" and any(type(a) is Tensor for a in args[1:])  # marker.data = values
        if assigns_values or (name not in cls._CLEARS and name not in cls._METADATA):
            raise RuntimeError(
                f"ShardedDataParallel holds this parameter's gradient sharded in the ZeroRedundancyOptimizer: its "
                f".grad is a marker without values, which {name}() cannot use. Clip with zero.clip_grad_norm_() "
                "(not torch.nn.utils.clip_grad_norm_), drive a GradScaler with scaler.step(zero) (without "
                "scaler.unscale_(zero)), read norms through zero.clip_grad_norm_(float('inf')); to replace the "
                "gradient, set .grad to a full tensor of your own, or to None (zero_grad) to clear it"
            )
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def __repr__(self, *, tensor_contents: Any = None) -> Any:  # type: ignore[override]
        return (
            f"<gradient held sharded by ShardedDataParallel: shape {tuple(self.shape)}, {self.dtype}; no values "
            "in .grad (read norms with zero.clip_grad_norm_)>"
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> GradientMarker:
        return GradientMarker.like(self)
