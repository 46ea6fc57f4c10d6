"""Model averagers on a schedule (post-local SGD) and the averaging itself (``average_parameters`` ...): the
counterparts of ``torch.distributed.algorithms.model_averaging``."""

from distoptim.averaging.averagers import (
    HierarchicalModelAverager,
    ModelAverager,
    PeriodicModelAverager,
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
