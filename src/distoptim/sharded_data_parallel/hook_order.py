"""Where ``ShardedDataParallel``'s landing hooks stand among the user's forward pre-hooks: first.

torch runs, before a module's forward, the module-global forward pre-hooks
(``torch.nn.modules.module.register_module_forward_pre_hook``), then the module's own in their dict's order. A
user's pre-hook that reads parameters (``w = base + delta``, the old ``weight_norm`` and ``spectral_norm``) must find
them landed, whenever it was registered: the landing hooks are registered with ``prepend=True`` (so they precede
those registered before wrapping and after it, appended), and before each forward of the wrapper ``keep_first``
moves any of them that a later ``prepend=True`` registration displaced back to the front. Nothing can precede a
module-global pre-hook or one on the wrapper itself, so while any is registered the wrapper lands the whole sync
before its forward (``others_run_first``): right, without overlap. Parametrizations (``torch.nn.utils.parametrize``)
read their parameter through a property, which calls the ``ParametrizationList`` module: it holds the parameter and
has its own landing hook when registered before wrapping; registered after, the parametrized module's hook and its
ancestors' cover it, as any parameter of theirs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import cast

from torch import nn
from torch.nn.modules import module as _module

__all__ = ["keep_first", "others_run_first"]


def others_run_first(wrapper: nn.Module) -> bool:
    """Whether a forward pre-hook runs before any landing hook can: a module-global one, or one of the user's on the
    wrapper (whose own first pre-hook is the caller)."""
    return bool(_module._global_forward_pre_hooks) or len(wrapper._forward_pre_hooks) > 1


def keep_first(landers: Sequence[tuple[nn.Module, int]]) -> None:
    """Each ``(module, hook id)`` first in its module's forward pre-hooks again (a user's ``prepend=True`` after
    wrapping puts theirs before it): a dict lookup per module while nothing moved."""
    for module, hook in landers:
        hooks = cast(OrderedDict[int, object], module._forward_pre_hooks)  # an OrderedDict, typed as a dict
        if next(iter(hooks)) != hook:
            hooks.move_to_end(hook, last=False)
