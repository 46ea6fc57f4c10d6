"""Where ``ShardedDataParallel``'s landing hooks stand among the user's forward pre-hooks: first.

The landing hooks are registered with ``prepend=True``, and before each forward ``keep_first`` moves any that a
later ``prepend=True`` registration displaced back to the front, so a user's pre-hook that reads parameters finds
them landed. While a module-global pre-hook or one on the wrapper exists, the whole sync lands before the forward
(``others_run_first``). Why, and parametrizations: ``docs/guides/internals.md``.
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
