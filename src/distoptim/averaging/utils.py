"""Averaging parameters directly, over a chosen group: the counterparts of
``torch.distributed.algorithms.model_averaging.utils`` (same names, arguments and results).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.distributed import ProcessGroup

from distoptim.averaging.averagers import params_to_average
from distoptim.comm import averaging as comm

__all__ = ["average_parameters", "average_parameters_or_parameter_groups", "get_params_to_average"]


def average_parameters(params: Iterable[torch.Tensor], process_group: ProcessGroup | None) -> None:
    """Replace each of ``params`` by its mean over ``process_group``, in place; unlike torch's, the parameters keep
    their storage, so views into them stay views.

    Args:
        params: the parameters (any iterable of tensors, a generator included), the same on every rank.
        process_group: the group to average over; ``None`` is the default (world) group.

    Raises:
        TypeError: ``process_group`` is neither a ``ProcessGroup`` nor ``None``.
        RuntimeError: ``process_group`` is ``None`` and no default process group is initialised.

    Example:
        ```python
        average_parameters(model.parameters(), node_group)      # None: over every rank
        ```
    """
    group = comm.default_group(process_group)
    comm.average_tensors_(list(params), group)


def get_params_to_average(params: Iterable[torch.nn.Parameter] | Iterable[Mapping[str, Any]]) -> list[torch.Tensor]:
    """The parameters of ``params`` that have a gradient (those a step changed), in order.

    Args:
        params: ``model.parameters()`` or ``optimizer.param_groups``.

    Raises:
        NotImplementedError: an entry is neither an ``nn.Parameter`` nor a param group (torch's message; also a
            ``TypeError``).
        TypeError: ``params`` is a single tensor or param group, or a group holds something other than tensors.

    Example:
        ```python
        average_parameters(get_params_to_average(optimizer.param_groups), None)
        ```
    """
    return params_to_average(params)


def average_parameters_or_parameter_groups(
    params: Iterable[torch.nn.Parameter] | Iterable[Mapping[str, Any]], process_group: ProcessGroup | None
) -> None:
    """Average, in place over ``process_group``, the parameters of a model or of an optimizer's param groups that
    have a gradient (``average_parameters(get_params_to_average(params), process_group)``).

    Args:
        params: ``model.parameters()`` or ``optimizer.param_groups``; parameters without ``.grad`` are skipped.
        process_group: the group to average over; ``None`` is the default (world) group.

    Raises:
        NotImplementedError: an entry of ``params`` is neither a parameter nor a param group (as in torch).
        TypeError: ``params`` is a single tensor or param group, or ``process_group`` is not a ``ProcessGroup``.
        RuntimeError: ``process_group`` is ``None`` and no default process group is initialised.

    Example:
        ```python
        average_parameters_or_parameter_groups(optimizer.param_groups, None)
        ```
    """
    average_parameters(get_params_to_average(params), process_group)
