"""Where the optimizer reads the gradient when it is not in ``.grad``: the interface a gradient source
(``ShardedDataParallel``'s owned store) offers ``ZeroRedundancyOptimizer.attach_gradient_source``."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

from torch import Tensor

from distoptim.zero.buckets import ParameterSync
from distoptim.zero.shard import LocalTensor

__all__ = ["GradientSource"]


class GradientSource(Protocol):
    """A gradient's one owner: read by the step and clipping, consumed by the step, cleared by ``zero_grad``."""

    sync: ParameterSync
    """The parameter sync the optimizer runs after each step (the source's buckets)."""
    replanned: Callable[[], None]
    """Called after each re-placement: attaches a source over the new placement."""

    def grad_of(self, local: LocalTensor) -> Tensor | None:
        """``local``'s piece of its parameter's gradient, or None where the parameter has none."""
        ...

    def ready(self) -> None:
        """Before a collective read (clipping): refuse what cannot be read, then what the ranks agree on first."""
        ...

    def stepping(self) -> AbstractContextManager[None]:
        """Around ``step()``'s local part: ``ready`` first, the gradient consumed after."""
        ...

    def clear(self, set_to_none: bool) -> None:
        """``zero_grad``."""
        ...
