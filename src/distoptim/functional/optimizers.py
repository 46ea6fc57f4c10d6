"""Functional optimizers, handed their gradients (by the overlap hooks, the RPC ``DistributedOptimizer``): one
generic class running ``torch.optim``'s own kernels bit for bit, one ``kernels.KernelSpec`` row per optimizer, its
state created as ``torch.optim`` creates it."""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import torch
from torch import Tensor

from distoptim.functional import kernels


class FunctionalOptimizer:
    """A ``torch.optim`` optimizer that is handed its gradients: ``step(gradients)`` or ``step_param(param, grad)``.

    Use a subclass (``FunctionalAdam`` ...); ``param_group`` is read at every step, ``state`` is ``torch.optim``'s.

    Args:
        params: the parameters ``step`` updates (a list of tensors); empty only through ``as_functional_optim``.
        *args: the ``torch.optim`` class's hyperparameters by position, in its order; omitted ones take its defaults.
        **kwargs: the same by name, plus keyword-only ``foreach`` (default ``None``: torch's
            choice) and ``maximize`` (default False).

    Raises:
        TypeError: ``FunctionalOptimizer`` itself is built, or an argument is unknown or given twice.
        ValueError: ``params`` is empty, or a hyperparameter the ``torch.optim`` class refuses (torch's message).

    Example:
        ```python
        opt = FunctionalAdam([weight], lr=1e-3)
        opt.step([weight_grad])                 # one gradient per parameter, None to skip one
        ```
    """

    spec: ClassVar[kernels.KernelSpec]
    __signature__: ClassVar[inspect.Signature]

    def __init_subclass__(cls, spec: kernels.KernelSpec | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if spec is not None:  # else set in the class body, or inherited
            cls.spec = spec
        positional, keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
        cls.__signature__ = inspect.Signature(  # (params, <torch.optim's hyperparameters>, *, foreach, maximize)
            [
                inspect.Parameter("params", positional, annotation="list[Tensor]"),
                *(inspect.Parameter(name, positional, default=value) for name, value in cls.spec.defaults.items()),
                inspect.Parameter("foreach", keyword, default=None, annotation="bool | None"),
                inspect.Parameter("maximize", keyword, default=False, annotation="bool"),
                inspect.Parameter("_allow_empty_param_list", keyword, default=False, annotation="bool"),
            ]
        )

    def __init__(self, params: list[Tensor], *args: Any, **kwargs: Any) -> None:
        if not hasattr(type(self), "spec"):
            raise TypeError("FunctionalOptimizer is generic; build FunctionalSGD, FunctionalAdam, ... instead")
        try:
            bound = self.__signature__.bind(params, *args, **kwargs)
        except TypeError as exc:  # unknown or repeated arguments: say which class refused them
            raise TypeError(f"{type(self).__name__}(): {exc}") from None
        bound.apply_defaults()
        options = dict(bound.arguments)
        params = list(options.pop("params"))
        allow_empty = options.pop("_allow_empty_param_list")
        if not params and not allow_empty:
            raise ValueError(
                f"optimizer got an empty parameter list ({type(self).__name__}); "
                "use as_functional_optim() for an optimizer driven by step_param() alone"
            )
        self.spec.torch_cls([torch.empty(1, device="meta", requires_grad=True)], **options)  # raises as torch does
        self.defaults: dict[str, Any] = dict(options, **self.spec.fixed)
        self.param_group: kernels.ParamGroup = {"params": params, **self.defaults}
        self.state: dict[Tensor, dict[str, Tensor]] = {}
        if self.spec.eager_state:
            for param in params:
                self._state_of(param)

    def step(self, gradients: list[Tensor | None]) -> None:
        """Update every parameter of ``param_group`` with its gradient, in one kernel call; None skips one.

        Args:
            gradients: one gradient (or None) per parameter of ``param_group["params"]``, in its order.

        Raises:
            ValueError: the number of gradients differs from the number of parameters.
        """
        params: list[Tensor] = self.param_group["params"]
        if len(gradients) != len(params):
            raise ValueError(
                "the gradients passed in does not equal to the size of the parameters!"
                f"Params length: {len(params)}. Gradients length: {len(gradients)} "
                f"({type(self).__name__}.step(): pass one gradient per parameter, None to skip it)"
            )
        stepped = [(param, grad) for param, grad in zip(params, gradients, strict=True) if grad is not None]
        self._update([param for param, _ in stepped], [grad for _, grad in stepped])

    def step_param(self, param: Tensor, grad: Tensor | None) -> None:
        """Update one parameter, which need not be in ``param_group``; with grad None only its state is created.

        Args:
            param: the parameter, updated in place; its state is created on first use, as ``torch.optim`` does.
            grad: its gradient, or None.
        """
        if grad is None:
            self._state_of(param)
        else:
            self._update([param], [grad])

    def _state_of(self, param: Tensor) -> dict[str, Tensor]:
        """The parameter's state, created on first use as torch.optim's ``_init_group`` creates it."""
        state = self.state.setdefault(param, {})
        if not state:
            optional = self.spec.optional
            for key, init in self.spec.state.items():
                if key not in optional or self.param_group[optional[key]]:
                    state[key] = init(param, self.param_group)
        return state

    def _update(self, params: list[Tensor], grads: list[Tensor]) -> None:
        if not params:
            return
        spec, group = self.spec, self.param_group
        states = [self._state_of(param) for param in params]
        lists: dict[str, list[Tensor | None]] = {}
        for key in spec.kernel_state:
            flag = spec.optional.get(key)
            lists[key] = [state.get(key) for state in states] if flag is None or group[flag] else []
        kwargs: dict[str, Any] = {}
        for name in self.defaults:  # the hyperparameters only: other param_group entries are not the kernel's
            value = group[name]
            if name in spec.pairs:
                first, second = spec.pairs[name]
                kwargs[first], kwargs[second] = value
            elif name in spec.kernel_params:
                kwargs[name] = value
        if "has_complex" in spec.kernel_params:
            kwargs["has_complex"] = any(torch.is_complex(param) for param in params)
        if "has_sparse_grad" in spec.kernel_params:
            kwargs["has_sparse_grad"] = any(grad.is_sparse for grad in grads)
        with torch.no_grad():
            spec.kernel(params, grads, *lists.values(), **kwargs)
        for key, tensors in lists.items():  # SGD's kernel creates `momentum_buffer` and returns it in its list
            for state, tensor in zip(states, tensors, strict=False):  # a disabled optional list is empty
                if tensor is not None:
                    state[key] = tensor


class FunctionalSGD(FunctionalOptimizer, spec=kernels.SGD):
    """``torch.optim.SGD`` taking gradients: its hyperparameters and defaults, then ``foreach``, ``maximize``."""


class FunctionalAdam(FunctionalOptimizer, spec=kernels.ADAM):
    """``torch.optim.Adam`` taking gradients: its hyperparameters and defaults, then ``foreach``, ``maximize``."""


class FunctionalAdamW(FunctionalOptimizer, spec=kernels.ADAMW):
    """``torch.optim.AdamW`` taking gradients: its hyperparameters and defaults, then ``foreach``, ``maximize``."""


class FunctionalAdagrad(FunctionalOptimizer, spec=kernels.ADAGRAD):
    """``torch.optim.Adagrad`` taking gradients: its hyperparameters and defaults, then ``foreach``, ``maximize``."""


class FunctionalAdadelta(FunctionalOptimizer, spec=kernels.ADADELTA):
    """``torch.optim.Adadelta`` taking gradients: its hyperparameters and defaults, then ``foreach``, ``maximize``."""


class FunctionalAdamax(FunctionalOptimizer, spec=kernels.ADAMAX):
    """``torch.optim.Adamax`` taking gradients: its hyperparameters and defaults, then ``foreach``, ``maximize``."""


class FunctionalRMSprop(FunctionalOptimizer, spec=kernels.RMSPROP):
    """``torch.optim.RMSprop`` taking gradients: its hyperparameters and defaults, then ``foreach``, ``maximize``."""


class FunctionalRprop(FunctionalOptimizer, spec=kernels.RPROP):
    """``torch.optim.Rprop`` taking gradients: its hyperparameters and defaults, then ``foreach``, ``maximize``."""


functional_optim_map: dict[Any, type] = {cls.spec.torch_cls: cls for cls in FunctionalOptimizer.__subclasses__()}
"""Optimizer class (or any key) -> its functional class, as ``torch.distributed.optim.utils`` has it; add entries
with ``register_functional_optim``."""

_BUILT_IN = tuple(functional_optim_map)


def register_functional_optim(key: Any, optim: type) -> None:
    """Map ``key`` to the functional optimizer class ``optim``, unless ``key`` already has one (torch's rule).

    Args:
        key: what users will pass, usually an optimizer class (need not be a ``torch.optim.Optimizer``).
        optim: a class with torch's protocol (``step(gradients)``, ``step_param``, ``param_group``, ``state``);
            ZeRO's overlap mode steps ``FunctionalOptimizer`` subclasses only.

    Raises:
        TypeError: ``key`` is unhashable, or ``optim`` is not a class.

    Example:
        ```python
        register_functional_optim(MyOptimizer, MyFunctionalOptimizer)
        opt = as_functional_optim(MyOptimizer, lr=0.1)
        ```
    """
    if not isinstance(optim, type):
        raise TypeError(f"register_functional_optim() takes a class as optim, got {optim!r}")
    if key not in functional_optim_map:
        functional_optim_map[key] = optim


def registered_functional_optim(optim_cls: Any) -> type | None:
    """The class registered for ``optim_cls``, ``optim_cls`` itself when a ``distoptim.functional`` class, else None."""
    if isinstance(optim_cls, type) and issubclass(optim_cls, FunctionalOptimizer):
        return optim_cls if hasattr(optim_cls, "spec") else None
    try:
        return functional_optim_map.get(optim_cls)
    except TypeError:  # unhashable: nothing is registered under it
        return None


def functional_class_for(optim_cls: type) -> type[FunctionalOptimizer] | None:
    """The ``FunctionalOptimizer`` class for a ``torch.optim`` class (exact class: a subclass may change the math),
    a key registered with one, or a functional class itself; else None. Never raises.

    Args:
        optim_cls: any class (``torch.optim.Adam``, ``FunctionalAdam``, ...).

    Example:
        ```python
        assert functional_class_for(torch.optim.AdamW) is FunctionalAdamW
        ```
    """
    found = registered_functional_optim(optim_cls)
    if isinstance(found, type) and issubclass(found, FunctionalOptimizer) and hasattr(found, "spec"):
        return found
    return None


def as_functional_optim(optim_cls: type, *args: Any, **kwargs: Any) -> Any:
    """The functional counterpart of ``optim_cls`` with an empty parameter list, to be driven by ``step_param``.

    Args:
        optim_cls: a ``torch.optim`` or ``distoptim.functional`` class, or a key given to ``register_functional_optim``.
        *args: ``optim_cls``'s hyperparameters by position, without ``params``; omitted ones take its defaults.
        **kwargs: the same by name (``lr=1e-3`` ...), plus ``foreach`` and ``maximize``.

    Raises:
        ValueError: ``optim_cls`` has no functional counterpart, or it refuses a hyperparameter.
        TypeError: an unknown hyperparameter.

    Example:
        ```python
        opt = as_functional_optim(torch.optim.SGD, lr=0.1, momentum=0.9)
        opt.step_param(weight, weight.grad)     # update one parameter with the gradient handed to it
        ```
    """
    functional_cls = registered_functional_optim(optim_cls)
    if functional_cls is None:
        supported = ", ".join(f"torch.optim.{cls.__name__}" for cls in _BUILT_IN)
        raise ValueError(
            f"Optimizer {optim_cls} does not have a functional counterpart! supported: {supported} (or their "
            "Functional* classes); register your own with distoptim.utils.register_functional_optim"
        )
    return functional_cls([], *args, _allow_empty_param_list=True, **kwargs)
