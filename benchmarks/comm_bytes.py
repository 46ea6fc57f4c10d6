"""Count the bytes a rank communicates, by wrapping ``torch.distributed``'s collective functions while counting.

Convention (the same for every variant): each call is credited with the bytes one rank *receives* in a
bandwidth-optimal algorithm for it, with N the group size and S the bytes of the tensor(s) named below:

| call                                       | S                            | bytes credited     |
|--------------------------------------------|------------------------------|--------------------|
| all_reduce                                 | the tensor                   | 2 (N-1)/N x S      |
| broadcast, reduce                          | the tensor                   | (N-1)/N x S        |
| all_gather[_into_tensor/_single]           | the whole output             | (N-1)/N x S        |
| reduce_scatter[_tensor/_single]            | the whole input              | (N-1)/N x S        |
| all_to_all, all_to_all_single              | the whole input              | (N-1)/N x S        |
| recv, irecv                                | the tensor (on the receiver) | S                  |
| send, isend                                | (counted at the receiver)    | 0                  |

So N broadcasts of S/N each (one per owner) cost (N-1)/N x S, like one all-gather of S, and an all-reduce costs
twice that (reduce-scatter + all-gather). Object collectives (``all_gather_object``, ...) are counted through the
tensor collectives they call. DDP's gradient all-reduce runs in its C++ reducer and never calls these functions:
callers add it analytically (``all_reduce_bytes``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch.distributed import distributed_c10d

__all__ = ["CommCounter", "all_reduce_bytes"]

# function name -> (argument holding the sized tensor(s), multiplier as a function of N)
_RULES: dict[str, tuple[str, Callable[[int], float]]] = {
    "all_reduce": ("tensor", lambda n: 2 * (n - 1) / n),
    "broadcast": ("tensor", lambda n: (n - 1) / n),
    "reduce": ("tensor", lambda n: (n - 1) / n),
    "all_gather": ("tensor_list", lambda n: (n - 1) / n),
    "all_gather_into_tensor": ("output_tensor", lambda n: (n - 1) / n),
    "all_gather_single": ("output_tensor", lambda n: (n - 1) / n),  # torch 2.13's name (FSDP2 calls it)
    "reduce_scatter": ("input_list", lambda n: (n - 1) / n),
    "reduce_scatter_tensor": ("input", lambda n: (n - 1) / n),
    "reduce_scatter_single": ("input", lambda n: (n - 1) / n),
    "all_to_all": ("input_tensor_list", lambda n: (n - 1) / n),
    "all_to_all_single": ("input", lambda n: (n - 1) / n),
    "recv": ("tensor", lambda n: 1.0),
    "irecv": ("tensor", lambda n: 1.0),
    "send": ("tensor", lambda n: 0.0),
    "isend": ("tensor", lambda n: 0.0),
}


def _nbytes(value: Any, floating_only: bool = False) -> int:
    if isinstance(value, Tensor):
        return value.numel() * value.element_size() if value.is_floating_point() or not floating_only else 0
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(item, floating_only) for item in value)
    return 0


def all_reduce_bytes(numel_bytes: int, world_size: int) -> float:
    """Bytes credited to an all-reduce of ``numel_bytes`` bytes over ``world_size`` ranks."""
    return 2 * (world_size - 1) / world_size * numel_bytes


class CommCounter:
    """``with counter.counting(): ...`` credits every collective called inside to ``bytes`` and ``calls``.
    ``floating_only``: bytes of floating-point tensors only (data, not the control plane's integer agreements)."""

    def __init__(self, floating_only: bool = False) -> None:
        self.floating_only = floating_only
        self.bytes = 0.0
        self.calls = 0
        self.by_function: dict[str, int] = {}
        self._active = False
        self._depth = threading.local()  # per thread: distoptim's p2p waiters post receives from their own
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def counting(self, active: bool = True) -> Iterator[None]:
        """Patch the functions (in ``torch.distributed`` and ``distributed_c10d``) for the block's duration."""
        if not active:
            yield
            return
        saved: list[tuple[Any, str, Any]] = []
        for name in _RULES:
            for module in (dist, distributed_c10d):
                original = getattr(module, name, None)
                if original is not None:
                    saved.append((module, name, original))
                    setattr(module, name, self._wrap(name, original))
        try:
            yield
        finally:
            for module, name, original in saved:
                setattr(module, name, original)

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        argument, factor = _RULES[name]
        signature = inspect.signature(original)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._depth, "value", 0)
            if depth == 0:  # a collective built from others is counted once, at the outside
                bound = signature.bind(*args, **kwargs)
                group = bound.arguments.get("group")
                size = dist.get_world_size(group) if group is not None else dist.get_world_size()
                with self._lock:
                    self.bytes += factor(size) * _nbytes(bound.arguments.get(argument), self.floating_only)
                    self.calls += 1
                    self.by_function[name] = self.by_function.get(name, 0) + 1
            self._depth.value = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth.value = depth

        return wrapper
