"""PostLocalSGDOptimizer: a local optimizer step followed by the averager's (periodic) parameter averaging."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, overload

import torch
import torch.distributed as dist

from distoptim.averaging.averagers import ModelAverager

__all__ = ["PostLocalSGDOptimizer"]


def _forwarded(name: str) -> Any:
    """The wrapped optimizer's attribute ``name``, read and written through: its own object, which schedulers edit."""

    def get(self: PostLocalSGDOptimizer) -> Any:
        return getattr(self.optim, name)

    get.__doc__ = f"The wrapped optimizer's ``{name}`` (the same object)."
    return property(get, lambda self, value: setattr(self.optim, name, value))


class PostLocalSGDOptimizer(torch.optim.Optimizer):
    """Run ``optim`` every step, then let ``averager`` average the parameters (post-local SGD).

    Param groups, state and defaults are the wrapped optimizer's own objects, so schedulers drive it.

    Args:
        optim: the local optimizer, already built over the model's parameters (an instance, not a class).
        averager: the averaging schedule; its ``warmup_steps`` should equal the DDP hook's ``start_localSGD_iter``.

    Raises:
        TypeError: ``optim`` is not an optimizer instance (a class, say), or ``averager`` is not a model averager.
        ValueError: ``optim`` is a ``ZeroRedundancyOptimizer`` sharded over all the ranks ``averager`` averages.

    Example:
        ```python
        local = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        optimizer = PostLocalSGDOptimizer(local, PeriodicModelAverager(period=4, warmup_steps=100))
        ```
    """

    def __init__(self, optim: torch.optim.Optimizer, averager: ModelAverager) -> None:
        # Optimizer.__init__ is not called: it would build param groups of our own
        for name in ("step", "param_groups", "state_dict", "load_state_dict"):
            if not hasattr(optim, name):
                got = f"the class {optim.__name__}" if isinstance(optim, type) else type(optim).__name__
                raise TypeError(
                    f"optim must be a torch.optim.Optimizer instance (it has no .{name}), got {got}; build it "
                    "first, e.g. torch.optim.SGD(model.parameters(), lr=0.1)"
                )
        if not hasattr(averager, "average_parameters") or not hasattr(averager, "step"):
            raise TypeError(f"averager must be a ModelAverager, e.g. PeriodicModelAverager, got {type(averager)}")
        _check_sharding_within_averaging(optim, averager)
        self.optim = optim
        self.averager = averager

    param_groups = _forwarded("param_groups")
    state = _forwarded("state")
    defaults = _forwarded("defaults")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(optim={self.optim!r}, averager={type(self.averager).__name__})"

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Step the local optimizer, then average if the averager's schedule says so.

        Args:
            closure: passed to the local optimizer's ``step`` (default ``None``); its loss is returned.
        """
        loss = self.optim.step() if closure is None else self.optim.step(closure)
        self.averager.average_parameters(self.param_groups)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the wrapped optimizer's gradients.

        Args:
            set_to_none: set ``.grad`` to None (default ``True``) instead of zeroing it.
        """
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group to the wrapped optimizer.

        Args:
            param_group: ``{"params": [...], <hyperparameters>}``, as for ``torch.optim.Optimizer.add_param_group``.
        """
        self.optim.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus ``"step"``, the averager's step (PyTorch's format)."""
        return {**self.optim.state_dict(), "step": self.averager.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped optimizer's state and the averager's step (without ``"step"``: a warning, step 0).

        Args:
            state_dict: what ``state_dict()`` returned on this rank (the ranks differ between averagings).

        Raises:
            ValueError: ``state_dict["step"]`` is negative, or the wrapped optimizer refuses the dict.
        """
        step = int(state_dict.get("step", 0))
        if step < 0:  # refused before anything is loaded: no half-loaded optimizer
            raise ValueError(f"state_dict['step'] must be >= 0, got {step}")
        self.optim.load_state_dict({key: value for key, value in state_dict.items() if key != "step"})
        if "step" not in state_dict:
            warnings.warn(
                "Loaded state dict does not contain a step counter for an averager. Setting step counter to 0. "
                "(Was it saved from the bare optimizer? The averaging schedule restarts, warm-up included.)",
                UserWarning,
                stacklevel=2,
            )
        self.averager.step = step


def _check_sharding_within_averaging(optim: Any, averager: Any) -> None:
    """Refuse ZeRO over the ranks that train locally between averagings (the averaging would change nothing)."""
    sharded_over = getattr(optim, "process_group", None)
    if not hasattr(optim, "local_shard") or sharded_over is None:  # duck-typed: not a ZeroRedundancyOptimizer
        return
    if set(dist.get_process_group_ranks(sharded_over)) >= set(dist.get_process_group_ranks(averager.process_group)):
        raise ValueError(
            "PostLocalSGDOptimizer cannot wrap a ZeroRedundancyOptimizer that shards over the ranks it averages: "
            "every rank copies each parameter's update from its owner, so it would follow the owner's local gradient "
            "alone and the averaging would change nothing. Shard over a subgroup whose gradients stay averaged every "
            "step (post_localSGD_hook's subgroup, e.g. the ranks of a node), or wrap a plain optimizer"
        )
