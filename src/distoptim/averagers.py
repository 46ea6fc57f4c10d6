"""Model averagers: average parameters across a process group on a schedule (used by post-local SGD), and the
averaging itself, for code that averages by hand or over a subgroup of its own (``average_parameters`` ...): the
counterparts of ``torch.distributed.algorithms.model_averaging``'s ``averagers``, ``hierarchical_model_averager``
and ``utils``."""

from distoptim.averaging.averagers import HierarchicalModelAverager, ModelAverager, PeriodicModelAverager
from distoptim.averaging.utils import (
    average_parameters,
    average_parameters_or_parameter_groups,
    get_params_to_average,
)

__all__ = [
    "HierarchicalModelAverager",
    "ModelAverager",
    "PeriodicModelAverager",
    "average_parameters",
    "average_parameters_or_parameter_groups",
    "get_params_to_average",
]
