"""What ``.grad`` holds while ``ShardedDataParallel``'s store holds the gradient: a marker with the parameter's shape
and no values, so that whatever the program then does to ``.grad`` is seen (``OwnedGradients.settle``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["GradientMarker"]


class GradientMarker(Tensor):
    """What ``.grad`` holds while the store holds the gradient: one element of storage, no values. Reads and writes
    raise; metadata, clearing, and ``module.to()``, ``.data``, ``.detach()``, ``copy.deepcopy`` (markers still) are
    allowed. ``origin`` tells the store's marker (converted or not) from one copied or kept from before a clear."""

    _CLEARS = frozenset({"zero_", "_foreach_zero_", "requires_grad_", "detach_", "__set__"})
    _METADATA = frozenset({"size", "dim", "ndimension", "numel", "nelement", "stride", "element_size", "__len__"})
    _METADATA |= {"is_floating_point", "is_complex", "is_contiguous", "get_device", "__hash__"}
    _METADATA |= {"_has_compatible_shallow_copy_type", "_is_view", "storage_offset", "untyped_storage", "data_ptr"}
    _STAY_MARKERS = frozenset({"__get__", "to", "type", "float", "double", "half", "bfloat16", "cpu", "cuda"})
    _STAY_MARKERS |= {"detach", "_to_copy", "as_subclass"}
    _VALUE_VIEWS = frozenset({"T", "mT", "H", "mH", "real", "imag"})  # properties that would hand out values
    origin: object

    @staticmethod
    def like(param: Tensor) -> GradientMarker:
        """A new marker (one element, expanded): never reused, since an alias of an old one (``.detach()``,
        ``torch.Tensor(g)``, a weakref) would share its identity or version counter."""
        base = torch.full((), float("nan"), dtype=param.dtype, device=param.device)
        marker = base.expand(param.shape).as_subclass(GradientMarker)
        marker.origin = object()
        return marker

    @property
    def version(self) -> int:
        """``_version``, read without ``__torch_function__`` (0.8 us, not 9: read for each parameter in each step)."""
        with torch._C.DisableTorchFunctionSubclass():
            return self._version

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", str(func))
        if name == "__get__":  # a property: .data is the marker itself (p.grad.data.zero_() clears, as in torch)
            name = "." + getattr(getattr(func, "__self__", None), "__name__", "?")
            if name == ".data":
                return args[0]
            if name[1:] not in cls._VALUE_VIEWS:
                return cls._stays_a_marker(func, types, args, kwargs)
        elif name in cls._STAY_MARKERS:
            return cls._stays_a_marker(func, types, args, kwargs)
        assigns_values = name == "__set__" and any(type(a) is Tensor for a in args[1:])  # marker.data = values
        if assigns_values or (name not in cls._CLEARS and name not in cls._METADATA):
            what = name if name.startswith(".") else f"{name}()"
            raise RuntimeError(
                f"ShardedDataParallel holds this parameter's gradient sharded in the ZeroRedundancyOptimizer: its "
                f".grad is a marker without values, which {what} cannot use. Clip with zero.clip_grad_norm_() "
                "(not torch.nn.utils.clip_grad_norm_), drive a GradScaler with scaler.step(zero) (without "
                "scaler.unscale_(zero)), read norms through zero.clip_grad_norm_(float('inf')); to replace the "
                "gradient, set .grad to a full tensor of your own, or to None (zero_grad) to clear it"
            )
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def _stays_a_marker(cls, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        """``func``'s result, a tensor result a marker of the same origin (``module.to()`` converts ``.grad``)."""
        result = super().__torch_function__(func, types, args, kwargs)  # type: ignore[no-untyped-call]
        source = args[0] if args else None
        if isinstance(result, GradientMarker) and result is not source and isinstance(source, GradientMarker):
            result.origin = source.origin
        return result

    def __repr__(self, *, tensor_contents: Any = None) -> Any:  # type: ignore[override]
        return (
            f"<gradient held sharded by ShardedDataParallel: shape {tuple(self.shape)}, {self.dtype}; no values "
            "in .grad (read norms with zero.clip_grad_norm_)>"
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> GradientMarker:
        return GradientMarker.like(self)
