"""Where the optimizer reads the gradient when ``.grad`` does not hold it: the interface a gradient source
(``ShardedDataParallel``'s owned store) offers ``ZeroRedundancyOptimizer.attach_gradient_source``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from torch import Tensor

from distoptim.zero.buckets import ParameterSync
from distoptim.zero.shard import LocalTensor

__all__ = ["GradientSource"]


class GradientSource(Protocol):
    """The gradient's one owner: read by the step and clipping, cleared by ``zero_grad``; which parameters some
    rank used rides on the step's agreement (``used``, then ``agreed``)."""

    sync: ParameterSync
    """The parameter sync the optimizer runs after each step (the source's buckets)."""
    replanned: Callable[[], None]
    """Called after each re-placement: attaches a source over the new placement."""
    used: list[bool]
    """Which parameters (global index) this rank gave a gradient since the ranks last agreed."""

    def grad_of(self, local: LocalTensor) -> Tensor | None:
        """``local``'s piece of its parameter's gradient, or None where the parameter has none."""
        ...

    def check_finished(self) -> None:
        """Refuse a gradient a backward that raised midway left (local)."""
        ...

    def prepare_step(self) -> bool:
        """Before the step reads (inside its agreement): whether this rank may step before the ranks agree."""
        ...

    def agreed(self, everywhere: Sequence[bool]) -> None:
        """The step's agreement said which parameters some rank used."""
        ...

    def ready(self) -> None:
        """Before ``clip_grad_norm_`` reads (collective): the same, agreed on its own where a backward ran since."""
        ...

    def clear(self, set_to_none: bool) -> None:
        """``zero_grad``."""
        ...
