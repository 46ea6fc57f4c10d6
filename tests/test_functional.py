"""Functional optimizers against torch.optim: same parameters and same state, bit for bit, step by step."""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.distributed.optim import utils as torch_optim_utils

from distoptim import as_functional_optim as top_level_as_functional_optim
from distoptim import utils
from distoptim.functional import (
    FunctionalAdadelta,
    FunctionalAdagrad,
    FunctionalAdam,
    FunctionalAdamax,
    FunctionalAdamW,
    FunctionalOptimizer,
    FunctionalRMSprop,
    FunctionalRprop,
    FunctionalSGD,
    as_functional_optim,
    functional_class_for,
)
from distoptim.zero.validation import check_overlap_class

PAIRS: list[tuple[type[FunctionalOptimizer], type[torch.optim.Optimizer]]] = [
    (FunctionalSGD, torch.optim.SGD),
    (FunctionalAdam, torch.optim.Adam),
    (FunctionalAdamW, torch.optim.AdamW),
    (FunctionalAdagrad, torch.optim.Adagrad),
    (FunctionalAdadelta, torch.optim.Adadelta),
    (FunctionalAdamax, torch.optim.Adamax),
    (FunctionalRMSprop, torch.optim.RMSprop),
    (FunctionalRprop, torch.optim.Rprop),
]
TORCH_CLS = dict(PAIRS)

# (functional class, hyperparameters); every case runs with foreach off and on.
CASES: list[tuple[type[FunctionalOptimizer], dict[str, Any]]] = [
    (FunctionalSGD, {}),
    (FunctionalSGD, {"lr": 0.1, "weight_decay": 0.01}),
    (FunctionalSGD, {"lr": 0.1, "momentum": 0.9}),
    (FunctionalSGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.5, "weight_decay": 0.1}),
    (FunctionalSGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (FunctionalSGD, {"lr": 0.1, "momentum": 0.5, "maximize": True}),
    (FunctionalAdam, {}),
    (FunctionalAdam, {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}),
    (FunctionalAdam, {"amsgrad": True, "maximize": True}),
    (FunctionalAdam, {"weight_decay": 0.1, "decoupled_weight_decay": True, "amsgrad": True}),
    (FunctionalAdamW, {}),
    (FunctionalAdamW, {"lr": 0.01, "weight_decay": 0.1, "amsgrad": True}),
    (FunctionalAdamW, {"maximize": True, "betas": (0.5, 0.9)}),
    (FunctionalAdagrad, {}),
    (FunctionalAdagrad, {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.1}),
    (FunctionalAdagrad, {"initial_accumulator_value": 0.1, "eps": 1e-6, "maximize": True}),
    (FunctionalAdadelta, {}),
    (FunctionalAdadelta, {"lr": 0.5, "rho": 0.8, "eps": 1e-5, "weight_decay": 0.1}),
    (FunctionalAdadelta, {"maximize": True}),
    (FunctionalAdamax, {}),
    (FunctionalAdamax, {"lr": 0.01, "betas": (0.8, 0.99), "weight_decay": 0.1}),
    (FunctionalAdamax, {"maximize": True, "eps": 1e-6}),
    (FunctionalRMSprop, {}),
    (FunctionalRMSprop, {"momentum": 0.9, "weight_decay": 0.1}),
    (FunctionalRMSprop, {"centered": True, "alpha": 0.9}),
    (FunctionalRMSprop, {"centered": True, "momentum": 0.5, "maximize": True, "eps": 1e-6}),
    (FunctionalRprop, {}),
    (FunctionalRprop, {"lr": 0.1, "etas": (0.3, 1.5), "step_sizes": (1e-4, 1.0)}),
    (FunctionalRprop, {"maximize": True}),
]
SHAPES = [(3, 4), (5,), (2, 3, 2), (1,)]
STEPS = 20


def _case_id(case: tuple[type[FunctionalOptimizer], dict[str, Any]]) -> str:
    cls, kwargs = case
    return cls.__name__ + "".join(f"-{k}={v}" for k, v in kwargs.items())


def _params(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).requires_grad_() for shape in SHAPES]


def _gradients(steps: int, seed: int = 1) -> Iterator[list[torch.Tensor | None]]:
    """Per step one gradient per parameter, some None: which ones varies (parameter 0 first steps at step 1)."""
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        grads = [torch.randn(shape, generator=generator) for shape in SHAPES]
        yield [None if (step + 2 * i) % 3 == 0 else grad for i, grad in enumerate(grads)]


def _twins(
    cls: type[FunctionalOptimizer], kwargs: dict[str, Any]
) -> tuple[list[torch.Tensor], torch.optim.Optimizer, list[torch.Tensor], FunctionalOptimizer]:
    ref_params, params = _params(), _params()
    return ref_params, TORCH_CLS[cls](ref_params, **kwargs), params, cls(params, **kwargs)


def _torch_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    for param, grad in zip(params, grads, strict=True):
        param.grad = None if grad is None else grad.clone()
    optimizer.step()


def _clone(grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return [None if grad is None else grad.clone() for grad in grads]


def _assert_same_tensor(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, what
    assert actual.device == expected.device, what
    assert actual.shape == expected.shape, what
    assert actual.stride() == expected.stride(), what
    assert torch.equal(actual, expected), f"{what}: {actual} != {expected}"


def _assert_same(
    ref_params: list[torch.Tensor],
    ref_state: dict[Any, Any],
    params: list[torch.Tensor],
    state: dict[torch.Tensor, dict[str, torch.Tensor]],
    when: str,
) -> None:
    for i, (ref_param, param) in enumerate(zip(ref_params, params, strict=True)):
        _assert_same_tensor(param.detach(), ref_param.detach(), f"{when}: param {i}")
        expected, actual = ref_state.get(ref_param, {}), state.get(param, {})
        assert list(actual) == list(expected), f"{when}: state keys of param {i}"
        for key in expected:
            _assert_same_tensor(actual[key], expected[key], f"{when}: state[{key!r}] of param {i}")


@pytest.mark.parametrize("foreach", [False, True], ids=["loop", "foreach"])
@pytest.mark.parametrize("case", CASES, ids=[_case_id(case) for case in CASES])
def test_matches_torch_optim(case: tuple[type[FunctionalOptimizer], dict[str, Any]], foreach: bool) -> None:
    cls, kwargs = case
    kwargs = {**kwargs, "foreach": foreach}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ref_params, ref_opt, params, opt = _twins(cls, kwargs)
        for step, grads in enumerate(_gradients(STEPS)):
            _torch_step(ref_opt, ref_params, grads)
            opt.step(_clone(grads))
            _assert_same(ref_params, ref_opt.state, params, opt.state, f"step {step}")


@pytest.mark.parametrize("foreach", [None, True], ids=["default", "foreach"])
@pytest.mark.parametrize("cls", [cls for cls, _ in PAIRS], ids=[cls.__name__ for cls, _ in PAIRS])
def test_step_param_agrees_with_step(cls: type[FunctionalOptimizer], foreach: bool | None) -> None:
    kwargs: dict[str, Any] = {"lr": 0.05, "weight_decay": 0.01} if cls is not FunctionalRprop else {"lr": 0.05}
    kwargs["foreach"] = foreach
    params, single_params = _params(), _params()
    whole, single = cls(params, **kwargs), as_functional_optim(TORCH_CLS[cls], **kwargs)
    for step, grads in enumerate(_gradients(10)):
        whole.step(_clone(grads))
        for param, grad in zip(single_params, _clone(grads), strict=True):
            if grad is not None:
                single.step_param(param, grad)
        # Adagrad's state exists from construction in `whole`; `single` creates it at a parameter's first step.
        pairs = zip(params, single_params, strict=True)
        stepped = {p: whole.state[p] for p, q in pairs if q in single.state and p in whole.state}
        _assert_same(params, stepped, single_params, single.state, f"step {step}")
    assert len(single.state) == len(params)
    _assert_same(params, whole.state, single_params, single.state, "end")


@pytest.mark.parametrize("cls", [cls for cls, _ in PAIRS], ids=[cls.__name__ for cls, _ in PAIRS])
def test_lr_change_in_param_group_applies_to_next_step(cls: type[FunctionalOptimizer]) -> None:
    kwargs: dict[str, Any] = {"lr": 0.05}
    ref_params, ref_opt, params, opt = _twins(cls, kwargs)
    unchanged_params = _params()
    unchanged = cls(unchanged_params, **kwargs)
    for step, grads in enumerate(_gradients(8)):
        if step == 4:
            ref_opt.param_groups[0]["lr"] = 0.2
            opt.param_group["lr"] = 0.2
        _torch_step(ref_opt, ref_params, grads)
        opt.step(_clone(grads))
        unchanged.step(_clone(grads))
        _assert_same(ref_params, ref_opt.state, params, opt.state, f"step {step}")
    moved = any(not torch.equal(a, b) for a, b in zip(params, unchanged_params, strict=True))
    # Rprop's lr is only its initial step size (torch.optim.Rprop ignores later changes too).
    assert moved == (cls is not FunctionalRprop)


@pytest.mark.parametrize("cls", [cls for cls, _ in PAIRS], ids=[cls.__name__ for cls, _ in PAIRS])
def test_state_interchangeable_with_torch_optim(cls: type[FunctionalOptimizer]) -> None:
    """torch.optim's state, copied into the functional optimizer half-way, continues the same run (and back)."""
    kwargs: dict[str, Any] = {"lr": 0.05}
    ref_params, ref_opt, params, opt = _twins(cls, kwargs)
    gradients = list(_gradients(12))
    for grads in gradients[:6]:
        _torch_step(ref_opt, ref_params, grads)
    with torch.no_grad():
        for param, ref_param in zip(params, ref_params, strict=True):
            param.copy_(ref_param)
    opt.state = {param: copy.deepcopy(ref_opt.state[ref]) for param, ref in zip(params, ref_params, strict=True)}
    for step, grads in enumerate(gradients[6:]):
        _torch_step(ref_opt, ref_params, grads)
        opt.step(_clone(grads))
        _assert_same(ref_params, ref_opt.state, params, opt.state, f"step {step} after the swap")
    back_params = [param.detach().clone().requires_grad_() for param in params]
    back = TORCH_CLS[cls](back_params, **kwargs)
    state = {i: copy.deepcopy(opt.state[param]) for i, param in enumerate(params)}
    back.load_state_dict({"state": state, "param_groups": ref_opt.state_dict()["param_groups"]})
    for step, grads in enumerate(_gradients(3, seed=7)):
        _torch_step(back, back_params, grads)
        opt.step(_clone(grads))
        _assert_same(back_params, back.state, params, opt.state, f"step {step} after loading into torch.optim")


@pytest.mark.parametrize(("cls", "torch_cls"), PAIRS, ids=[cls.__name__ for cls, _ in PAIRS])
def test_hyperparameters_and_defaults_match_torch(
    cls: type[FunctionalOptimizer], torch_cls: type[torch.optim.Optimizer]
) -> None:
    torch_params = inspect.signature(torch_cls).parameters
    ours = inspect.signature(cls).parameters
    assert next(iter(ours)) == "params"
    for name, param in ours.items():
        if name in ("params", "_allow_empty_param_list"):
            continue
        assert name in torch_params, f"{cls.__name__} takes {name!r}, {torch_cls.__name__} does not"
        assert param.default == torch_params[name].default, name
    opt = cls(_params())
    assert set(opt.param_group) >= {"params", "foreach", "maximize"} | set(ours) - {"_allow_empty_param_list"}


def test_positional_hyperparameters_follow_torch_order() -> None:
    opt = FunctionalSGD(_params(), 0.1, 0.9, 0.5, 0.01)  # nesterov apart: torch.optim refuses it with dampening
    assert {k: opt.param_group[k] for k in ("lr", "momentum", "dampening", "weight_decay", "nesterov")} == {
        "lr": 0.1,
        "momentum": 0.9,
        "dampening": 0.5,
        "weight_decay": 0.01,
        "nesterov": False,
    }
    assert FunctionalSGD(_params(), 0.1, 0.9, 0.0, 0.01, True).param_group["nesterov"] is True
    assert FunctionalAdam(_params(), 0.1, (0.5, 0.6)).param_group["betas"] == (0.5, 0.6)


def test_unknown_argument_is_refused() -> None:
    with pytest.raises(TypeError, match=r"FunctionalAdam.*lrr"):
        FunctionalAdam(_params(), lrr=0.1)


@pytest.mark.parametrize("cls", [cls for cls, _ in PAIRS], ids=[cls.__name__ for cls, _ in PAIRS])
def test_empty_param_list_is_refused(cls: type[FunctionalOptimizer]) -> None:
    with pytest.raises(ValueError, match=r"^optimizer got an empty parameter list"):  # torch's text first
        cls([])


def test_generic_base_is_not_built_directly() -> None:
    with pytest.raises(TypeError, match="generic"):
        FunctionalOptimizer(_params())


def test_gradient_count_mismatch_names_both_lengths() -> None:
    opt = FunctionalAdam(_params())
    torch_text = r"^the gradients passed in does not equal to the size of the parameters!Params length: 4\. "
    with pytest.raises(ValueError, match=torch_text + "Gradients length: 3"):
        opt.step([torch.zeros(1)] * 3)
    with pytest.raises(ValueError, match=torch_text + "Gradients length: 5"):
        opt.step([None] * 5)


def test_all_gradients_none_changes_nothing() -> None:
    params = _params()
    before = [p.detach().clone() for p in params]
    opt = FunctionalAdam(params)
    opt.step([None] * len(params))
    assert opt.state == {}
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))


def test_as_functional_optim_maps_torch_classes_and_refuses_others() -> None:
    assert top_level_as_functional_optim is as_functional_optim
    for cls, torch_cls in PAIRS:
        opt = as_functional_optim(torch_cls, lr=0.5)
        assert type(opt) is cls
        assert opt.param_group["params"] == []
        assert opt.param_group["lr"] == 0.5
    with pytest.raises(ValueError, match=r"NAdam.*torch\.optim\.SGD.*torch\.optim\.Adam,.*torch\.optim\.Rprop"):
        as_functional_optim(torch.optim.NAdam, lr=0.1)


def test_as_functional_optim_accepts_functional_classes() -> None:
    for cls, _ in PAIRS:
        opt = as_functional_optim(cls, 0.25)
        assert type(opt) is cls
        assert opt.param_group["lr"] == 0.25


def test_functional_class_for() -> None:
    for cls, torch_cls in PAIRS:
        assert functional_class_for(torch_cls) is cls
        assert functional_class_for(cls) is cls
    assert functional_class_for(torch.optim.NAdam) is None
    assert functional_class_for(FunctionalOptimizer) is None
    assert functional_class_for(int) is None

    class MyAdam(torch.optim.Adam):
        pass

    assert functional_class_for(MyAdam) is None  # a subclass may change the math


def test_refusals_start_with_torchs_texts() -> None:
    """Where torch's functional optimizers refuse, ours raise the same class with torch's text first."""
    torch_adam = torch_optim_utils.functional_optim_map[torch.optim.Adam]
    params = _params()
    cases = [(lambda cls: cls([]), "empty"), (lambda cls: cls(params).step([torch.zeros(1)] * 3), "count")]
    for build, what in cases:
        with pytest.raises(ValueError) as theirs:
            build(torch_adam)
        with pytest.raises(ValueError) as ours:
            build(FunctionalAdam)
        assert str(ours.value).startswith(str(theirs.value)), (what, str(ours.value), str(theirs.value))


def test_the_registry_matches_torchs_and_feeds_as_functional_optim() -> None:
    """``distoptim.utils`` mirrors ``torch.distributed.optim.utils``: the same keys, torch's no-overwrite rule, and
    a registered class is what ``as_functional_optim`` builds (torch's protocol: ``_allow_empty_param_list``)."""
    # torch's keys exactly (other test modules, imported in this process, may have registered classes of their own)
    built_in = {key for key in utils.functional_optim_map if key.__module__.startswith("torch.")}
    assert built_in == set(torch_optim_utils.functional_optim_map)
    assert utils.as_functional_optim is as_functional_optim

    class MyOptimizer:  # any key will do, as in torch
        pass

    class MyAdam(torch.optim.Adam):
        pass

    try:
        utils.register_functional_optim(MyOptimizer, torch_optim_utils.functional_optim_map[torch.optim.SGD])
        utils.register_functional_optim(MyOptimizer, FunctionalAdam)  # a key keeps its first class
        with pytest.warns(DeprecationWarning, match="TorchScript"):  # torch's own class says so when built
            opt = as_functional_optim(MyOptimizer, lr=0.5)
        assert type(opt) is torch_optim_utils.functional_optim_map[torch.optim.SGD]
        assert opt.defaults["lr"] == 0.5
        assert functional_class_for(MyOptimizer) is None  # ZeRO's overlap steps FunctionalOptimizer classes only
        utils.register_functional_optim(MyAdam, FunctionalAdam)  # found by ZeRO's overlap mode too
        assert functional_class_for(MyAdam) is FunctionalAdam
        assert type(as_functional_optim(MyAdam, lr=0.5)) is FunctionalAdam
        assert check_overlap_class(MyAdam) is FunctionalAdam
    finally:
        utils.functional_optim_map.pop(MyOptimizer, None)
        utils.functional_optim_map.pop(MyAdam, None)
    utils.register_functional_optim(torch.optim.SGD, FunctionalAdam)
    assert utils.functional_optim_map[torch.optim.SGD] is FunctionalSGD
    with pytest.raises(
        ValueError, match=r"^Optimizer <class 'torch\.optim\.nadam\.NAdam'> does not have a functional "
    ):
        as_functional_optim(torch.optim.NAdam)
    with pytest.raises(
        ValueError, match=r"^Optimizer <class 'torch\.optim\.nadam\.NAdam'> does not have a functional "
    ):
        torch_optim_utils.as_functional_optim(torch.optim.NAdam)
    with pytest.raises(TypeError, match="takes a class"):
        utils.register_functional_optim(MyOptimizer, FunctionalAdam(torch.zeros(1)))  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", [cls for cls, _ in PAIRS], ids=[cls.__name__ for cls, _ in PAIRS])
def test_step_param_with_no_gradient_creates_state_and_leaves_param(cls: type[FunctionalOptimizer]) -> None:
    kwargs: dict[str, Any] = {"momentum": 0.9} if cls in (FunctionalSGD, FunctionalRMSprop) else {}
    opt = as_functional_optim(TORCH_CLS[cls], **kwargs)
    param = torch.randn(3, 2, requires_grad=True)
    before = param.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step_param(param, None)
    assert param in opt.state
    assert torch.equal(param.detach(), before)
    if cls is not FunctionalSGD:  # SGD's momentum buffer is created by the kernel from the first gradient
        assert torch.equal(opt.state[param]["step"], torch.tensor(0.0))
    # the state is then used, as torch.optim would have created it, by the first real step
    ref = TORCH_CLS[cls]([before.clone().requires_grad_()], **kwargs)
    grad = torch.randn(3, 2)
    _torch_step(ref, ref.param_groups[0]["params"], [grad])
    opt.step_param(param, grad.clone())
    _assert_same(ref.param_groups[0]["params"], ref.state, [param], opt.state, "first step")


def test_initial_state_layout_matches_torch() -> None:
    """Adagrad's `sum` starts at initial_accumulator_value, Rprop's `step_size` at lr; `step` is a float32 scalar."""
    adagrad = as_functional_optim(torch.optim.Adagrad, initial_accumulator_value=0.3)
    rprop = as_functional_optim(torch.optim.Rprop, lr=0.07)
    param = torch.randn(4, 3).t()  # non-contiguous: state keeps the parameter's strides
    adagrad.step_param(param, None)
    rprop.step_param(param, None)
    assert torch.equal(adagrad.state[param]["sum"], torch.full_like(param, 0.3))
    assert adagrad.state[param]["sum"].stride() == param.stride()
    assert torch.equal(rprop.state[param]["step_size"], torch.full_like(param, 0.07))
    assert list(rprop.state[param]) == ["step", "prev", "step_size"]
    step = rprop.state[param]["step"]
    assert step.dtype == torch.float32 and step.dim() == 0 and step.device.type == "cpu"


@pytest.mark.parametrize("cls", [cls for cls, _ in PAIRS], ids=[cls.__name__ for cls, _ in PAIRS])
def test_complex_parameters_match_torch(cls: type[FunctionalOptimizer]) -> None:
    """Complex parameters reach the kernels' complex path (`has_complex`) and get torch.optim's complex state."""
    generator = torch.Generator().manual_seed(3)
    ref_params = [torch.randn(4, dtype=torch.complex64, generator=generator).requires_grad_() for _ in range(2)]
    params = [param.detach().clone().requires_grad_() for param in ref_params]
    kwargs: dict[str, Any] = {"lr": 0.05, "initial_accumulator_value": 0.1} if cls is FunctionalAdagrad else {}
    ref_opt, opt = TORCH_CLS[cls](ref_params, **kwargs), cls(params, **kwargs)
    for step in range(5):
        grads: list[torch.Tensor | None] = [torch.randn(4, dtype=torch.complex64, generator=generator)] * 2
        _torch_step(ref_opt, ref_params, grads)
        opt.step(_clone(grads))
        _assert_same(ref_params, ref_opt.state, params, opt.state, f"step {step}")
