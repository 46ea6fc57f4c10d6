"""PostLocalSGDOptimizer: a local optimizer step followed by the averager's (periodic) parameter averaging."""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any, overload

import torch

from distoptim.averaging.averagers import ModelAverager

__all__ = ["PostLocalSGDOptimizer"]


class PostLocalSGDOptimizer(torch.optim.Optimizer):
    """Run ``optim`` every step, then let ``averager`` average the parameters (post-local SGD).

    Param groups, state and defaults are the wrapped optimizer's own objects (read through, never copied), so
    learning-rate schedulers built on this wrapper drive the wrapped optimizer, also after ``load_state_dict``.
    ``optim`` may be any ``torch.optim`` optimizer but a ``ZeroRedundancyOptimizer`` (refused: its sharded state
    cannot step every parameter locally on every rank, which is what post-local SGD does between averagings).
    """

    def __init__(self, optim: torch.optim.Optimizer, averager: ModelAverager) -> None:
        # Optimizer.__init__ is deliberately not called: it would build param groups of our own.
        for name in ("step", "param_groups", "state_dict", "load_state_dict"):
            if not hasattr(optim, name):
                got = f"the class {optim.__name__}" if isinstance(optim, type) else type(optim).__name__
                raise TypeError(
                    f"optim must be a torch.optim.Optimizer instance (it has no .{name}), got {got}; build it "
                    "first, e.g. torch.optim.SGD(model.parameters(), lr=0.1)"
                )
        if hasattr(optim, "local_shard"):  # duck-typed: a ZeroRedundancyOptimizer
            raise ValueError(
                "PostLocalSGDOptimizer cannot wrap a ZeroRedundancyOptimizer: post-local SGD has every rank step every "
                "parameter with its own gradient between averagings, but ZeRO keeps each parameter's optimizer state "
                "on one rank, whose update every rank then copies, so after the warm-up each parameter would follow "
                "its owner's local gradient alone and the averaging would change nothing. Wrap a plain torch.optim "
                "optimizer (post-local SGD replicates the state), or train ZeRO with DDP's gradient averaging"
            )
        if not hasattr(averager, "average_parameters") or not hasattr(averager, "step"):
            raise TypeError(f"averager must be a ModelAverager, e.g. PeriodicModelAverager, got {type(averager)}")
        self.optim = optim
        self.averager = averager

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optim.param_groups = value

    @property
    def state(self) -> defaultdict[torch.Tensor, Any]:
        return self.optim.state

    @state.setter
    def state(self, value: defaultdict[torch.Tensor, Any]) -> None:
        self.optim.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optim.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optim.defaults = value

    def __repr__(self) -> str:
        return f"{type(self).__name__}(optim={self.optim!r}, averager={type(self.averager).__name__})"

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Step the local optimizer, then average parameters if the averager's schedule says so."""
        loss = self.optim.step() if closure is None else self.optim.step(closure)
        self.averager.average_parameters(self.param_groups)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the wrapped optimizer's gradients."""
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group to the wrapped optimizer."""
        self.optim.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus ``"step"``, the averager's step (PyTorch's format)."""
        state_dict = dict(self.optim.state_dict())
        state_dict["step"] = self.averager.step
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the wrapped optimizer's state and restore the averager's step, so the schedule resumes exactly.

        A dict without ``"step"`` (e.g. saved from the bare optimizer) warns and restarts the schedule at 0.
        """
        inner = {key: value for key, value in state_dict.items() if key != "step"}
        self.optim.load_state_dict(inner)
        if "step" in state_dict:
            step = int(state_dict["step"])
            if step < 0:
                raise ValueError(f"state_dict['step'] must be >= 0, got {step}")
            self.averager.step = step
        else:
            warnings.warn(
                "the loaded state dict has no 'step' for the model averager (was it saved from the bare optimizer?); "
                "restarting the averaging schedule at step 0, warm-up included",
                UserWarning,
                stacklevel=2,
            )
            self.averager.step = 0
