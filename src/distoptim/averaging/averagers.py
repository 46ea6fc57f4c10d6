"""Model averagers: a schedule (``group_at(step)``) over ``comm.average_tensors_``, which averages in place; the
functions at the end average directly, as ``torch.distributed.algorithms.model_averaging.utils`` does."""

from __future__ import annotations

import itertools
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed import ProcessGroup

from distoptim.comm import averaging as comm

__all__ = [
    "HierarchicalModelAverager",
    "ModelAverager",
    "ParamsLike",
    "PeriodicModelAverager",
    "UnsupportedParamsError",
    "average_parameters",
    "average_parameters_or_parameter_groups",
    "get_params_to_average",
]

ParamsLike = Iterable[torch.nn.Parameter] | Iterable[Mapping[str, Any]]

_TORCH_PERIOD_ONE = (  # torch's texts, then what to do instead
    "no need to use model averaging because the communication cost of all-reducing parameters will be no less "
    "than the cost of all-reducing gradients by DistributedDataParallel in the backward pass. Therefore, only "
    "DistributedDataParallel should be used for this case. Use plain DDP, or a period > 1."
)
_PERIOD_ONE_WARNING = f"When period is 1, {_TORCH_PERIOD_ONE}"
_MAX_PERIOD_ONE_WARNING = f"When the maximum period in arg ``period_group_size_dict`` is 1, {_TORCH_PERIOD_ONE}"
_HOW_TO_PASS = "pass model.parameters() or optimizer.param_groups"


class UnsupportedParamsError(NotImplementedError, TypeError):
    """An entry of ``params`` that is neither a parameter nor a param group: torch's ``NotImplementedError``, and a
    ``TypeError`` as distoptim raised before."""


def _unsupported(item: object, how: str) -> UnsupportedParamsError:
    return UnsupportedParamsError(f"Parameter input of type {type(item)} is not supported; {how}; {_HOW_TO_PASS}")


class ModelAverager(ABC):
    """Base of the averagers: the process group and the visible ``step`` counter (saved by ``PostLocalSGDOptimizer``).

    Args:
        process_group: the group to average over; ``None`` (default) is the world group, resolved at construction.

    Raises:
        TypeError: ``process_group`` is neither a ``ProcessGroup`` nor ``None``.
        RuntimeError: ``process_group`` is ``None`` and no default process group is initialised.

    Example:
        ```python
        class EveryOtherStep(ModelAverager):
            def average_parameters(self, params):
                self._average_and_advance(params, self.process_group if self.step % 2 == 0 else None)
        ```
    """

    def __init__(self, process_group: ProcessGroup | None = None) -> None:
        self.process_group: ProcessGroup = comm.default_group(process_group)
        self.step = 0

    @abstractmethod
    def average_parameters(self, params: ParamsLike) -> None:
        """Average ``params`` if the schedule says so at ``step``, then advance ``step`` by one.

        Args:
            params: ``model.parameters()`` or ``optimizer.param_groups``; parameters without ``.grad`` are skipped.
        """

    def _average_and_advance(self, params: ParamsLike, group: ProcessGroup | None) -> None:
        selected = get_params_to_average(params)  # validated every call, so bad input fails before warm-up ends
        if group is not None:
            comm.average_tensors_(selected, group)
        self.step += 1


def _check_warmup(warmup_steps: int) -> None:
    if warmup_steps < 0:
        raise ValueError(
            f"Arg ``warmup_steps`` must be a non-negative number. Got {warmup_steps}; "
            "use 0 to average from the first step"
        )


def _check_period(period: int, warmup_steps: int) -> None:
    if period < 1:
        raise ValueError(
            f"Arg ``period`` must be a positive value. Got {period}: the steps between averagings, at least 1"
        )
    _check_warmup(warmup_steps)


class PeriodicModelAverager(ModelAverager):
    """Average over the whole group every ``period`` steps once ``warmup_steps`` steps have passed (PyTorch's schedule).

    Args:
        period: steps between averagings, at least 1 (1 warns: plain DDP is cheaper).
        warmup_steps: steps before the first averaging (default 0); pair it with the hook's ``start_localSGD_iter``.
        process_group: the group to average over; ``None`` (default) is the world group.

    Raises:
        ValueError: ``period < 1`` or ``warmup_steps < 0``, or the ranks disagree on them: raised on every rank.
        TypeError: ``period`` or ``warmup_steps`` is not a number, or ``process_group`` not a ``ProcessGroup``.
        RuntimeError: ``process_group`` is ``None`` and no default process group is initialised.

    Example:
        ```python
        averager = PeriodicModelAverager(period=4, warmup_steps=100)
        averager.average_parameters(model.parameters())   # after each optimizer.step()
        ```
    """

    def __init__(self, period: int, warmup_steps: int = 0, process_group: ProcessGroup | None = None) -> None:
        settings = {"period": period, "warmup_steps": warmup_steps}
        check = lambda: _check_period(period, warmup_steps)
        comm.agree_on_settings(settings, check, process_group, "PeriodicModelAverager")
        super().__init__(process_group)
        if period == 1:
            warnings.warn(_PERIOD_ONE_WARNING, UserWarning, stacklevel=2)
        self.period = period
        self.warmup_steps = warmup_steps

    def group_at(self, step: int) -> ProcessGroup | None:
        """The group that averages at ``step`` (``self.step`` is the next one), or ``None`` when none is due.

        Args:
            step: an averager step.
        """
        if step >= self.warmup_steps and (step - self.warmup_steps) % self.period == 0:
            return self.process_group
        return None

    def average_parameters(self, params: ParamsLike) -> None:
        """Average ``params`` in place if due at ``step``; advance ``step`` (errors: ``ModelAverager``'s).

        Args:
            params: ``model.parameters()`` or ``optimizer.param_groups``; parameters without ``.grad`` are skipped.
        """
        self._average_and_advance(params, self.group_at(self.step))


class HierarchicalModelAverager(ModelAverager):
    """Average within subgroups of consecutive ranks (created here, a collective), each level on its own period; past
    warm-up, the level with the largest period dividing ``step`` averages (PyTorch's schedule).

    Args:
        period_group_size_dict: ``{period: subgroup size}`` in increasing period order, each size dividing the
            group's and the last the whole group, e.g. ``{2: 4, 8: 16}``. Required: the default ``None`` is refused.
        warmup_steps: steps before the first averaging (default 0).
        process_group: the group to average over; ``None`` (default) is the world group.

    Raises:
        ValueError: bad levels (none, a period below 1, not increasing, a size not dividing the group, a last one
            not the group), ``warmup_steps < 0``, or ranks that disagree: raised on every rank.
        TypeError: ``process_group`` is not a ``ProcessGroup``.
        RuntimeError: ``process_group`` is ``None`` and no default process group is initialised.

    Example:
        ```python
        averager = HierarchicalModelAverager({2: 4, 8: 8}, warmup_steps=100)  # 8 ranks, 4 per node
        ```
    """

    def __init__(
        self,
        period_group_size_dict: Mapping[int, int] | None = None,
        warmup_steps: int = 0,
        process_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__(process_group)
        levels = list((period_group_size_dict or {}).items())
        overall = comm.group_size(self.process_group)
        comm.agree_on_settings(  # everything is validated, and agreed, before the collectives that build subgroups
            {"period_group_size_dict": dict(levels), "warmup_steps": warmup_steps},
            lambda: _check_levels(levels, overall, warmup_steps),
            self.process_group,
            "HierarchicalModelAverager",
        )
        if levels[-1][0] == 1:
            warnings.warn(_MAX_PERIOD_ONE_WARNING, UserWarning, stacklevel=2)
        self.warmup_steps = warmup_steps
        self.period_process_group_dict: dict[int, ProcessGroup] = {
            period: comm.split_group(self.process_group, size) for period, size in levels
        }
        self._periods_largest_first = [period for period, _ in reversed(levels)]  # fixed here, as torch's

    def group_at(self, step: int) -> ProcessGroup | None:
        """This rank's subgroup that averages at ``step`` (``self.step`` is the next one), or ``None``.

        Args:
            step: an averager step.
        """
        if step >= self.warmup_steps:
            for period in self._periods_largest_first:
                if step % period == 0:
                    return self.period_process_group_dict[period]
        return None

    def average_parameters(self, params: ParamsLike) -> None:
        """Average ``params`` in place within the level due at ``step``; advance (errors: ``ModelAverager``'s).

        Args:
            params: ``model.parameters()`` or ``optimizer.param_groups``; parameters without ``.grad`` are skipped.
        """
        self._average_and_advance(params, self.group_at(self.step))


def _check_levels(levels: list[tuple[int, int]], overall: int, warmup_steps: int) -> None:
    example = f"e.g. {{2: {max(overall // 2, 1)}, 4: {overall}}}"
    if not levels:
        raise ValueError(
            f"Arg ``period_group_size_dict`` must not be empty. Map at least one period to a group size, {example}"
        )
    periods = [period for period, _ in levels]
    if any(period < 1 for period in periods):
        raise ValueError(
            f"The minimum period in arg ``period_group_size_dict`` must be a positive value. Got periods {periods}"
        )
    if any(a >= b for a, b in itertools.pairwise(periods)):
        raise ValueError(f"list periods in increasing order (smallest, most local level first), got {periods}")
    if levels[-1][1] != overall:
        raise ValueError(
            f"The last value in arg ``period_group_size_dict`` {levels[-1][1]} must be equal to the size of arg "
            f"``process_group`` {overall}. The last level averages over the whole group, {example}"
        )
    for period, size in levels:
        if size < 1 or overall % size != 0:
            raise ValueError(
                f"group size {size} for period {period} must be positive and divide the group's {overall} ranks"
            )
    _check_warmup(warmup_steps)


def average_parameters(params: Iterable[torch.Tensor], process_group: ProcessGroup | None) -> None:
    """Replace each of ``params`` by its mean over ``process_group``, in place (views into them stay views).

    Args:
        params: the parameters (any iterable of tensors), the same on every rank.
        process_group: the group to average over; ``None`` is the default (world) group.

    Raises:
        TypeError: ``process_group`` is neither a ``ProcessGroup`` nor ``None``.
        RuntimeError: ``process_group`` is ``None`` and no default process group is initialised.

    Example:
        ```python
        average_parameters(model.parameters(), node_group)
        ```
    """
    comm.average_tensors_(list(params), comm.default_group(process_group))


def get_params_to_average(params: ParamsLike) -> list[torch.Tensor]:
    """The parameters (or param-group entries) of ``params`` that have a gradient (those a step changed), in order.

    Args:
        params: ``model.parameters()`` or ``optimizer.param_groups``.

    Raises:
        NotImplementedError: an entry is neither an ``nn.Parameter`` nor a param group (also a ``TypeError``).
        TypeError: ``params`` is a single tensor or param group, or a group holds something other than tensors.

    Example:
        ```python
        average_parameters(get_params_to_average(optimizer.param_groups), None)
        ```
    """
    if isinstance(params, torch.Tensor):
        raise _unsupported(params, "average_parameters() takes an iterable of parameters, not a single tensor")
    if isinstance(params, Mapping):
        first_key = next(iter(params), "")  # what torch's loop meets first: a key of the dict
        raise _unsupported(first_key, "average_parameters() got a single param-group dict; pass a list of them")
    selected: list[torch.Tensor] = []
    for index, item in enumerate(params):
        if isinstance(item, torch.nn.Parameter):
            candidates: Iterable[Any] = (item,)
        elif isinstance(item, Mapping):
            if "params" not in item:
                raise TypeError(f"param group {index} has no 'params' entry; {_HOW_TO_PASS}")
            candidates = item["params"]
        elif isinstance(item, torch.Tensor):
            raise _unsupported(
                item,
                f"item {index} is a plain torch.Tensor, not an nn.Parameter; averaging only touches parameters "
                "(wrap it in torch.nn.Parameter, or put it in an optimizer param group)",
            )
        else:
            raise _unsupported(item, f"item {index} has type {type(item).__name__}")
        for param in candidates:
            if not isinstance(param, torch.Tensor):
                raise TypeError(f"param group {index} holds a {type(param).__name__}, not a tensor")
            if param.grad is not None:
                selected.append(param)
    return selected


def average_parameters_or_parameter_groups(params: ParamsLike, process_group: ProcessGroup | None) -> None:
    """``average_parameters(get_params_to_average(params), process_group)``: the parameters that have a gradient.

    Args:
        params: ``model.parameters()`` or ``optimizer.param_groups``.
        process_group: the group to average over; ``None`` is the default (world) group.

    Raises:
        NotImplementedError: an entry of ``params`` is neither a parameter nor a param group.
        TypeError: ``params`` is a single tensor or param group, or ``process_group`` is not a ``ProcessGroup``.
        RuntimeError: ``process_group`` is ``None`` and no default process group is initialised.

    Example:
        ```python
        average_parameters_or_parameter_groups(optimizer.param_groups, None)
        ```
    """
    average_parameters(get_params_to_average(params), process_group)
