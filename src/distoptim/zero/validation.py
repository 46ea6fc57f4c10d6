"""Checks on what the user passed: every rank raises the same clear error, not hangs, when one fails or two differ."""

from __future__ import annotations

import enum
import inspect
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from distoptim._flat import is_dense
from distoptim.comm import collectives as comm
from distoptim.comm import p2p
from distoptim.comm.agreement import STEPPING_ONLY, Fingerprint, agree_across_ranks
from distoptim.comm.groups import control_group
from distoptim.comm.objects import all_gather_objects
from distoptim.functional import FunctionalOptimizer, functional_class_for
from distoptim.zero.elementwise import class_name, is_coupled, is_elementwise, torch_class_of
from distoptim.zero.local_optimizer import CLASS_KEY, build_local_optimizer, check_eps_from_first_dtype, group_class
from distoptim.zero.param_input import normalize_param_groups
from distoptim.zero.partition import MODES
from distoptim.zero.state_formats import FORMAT_KEY, check_format

__all__ = [
    "check_construction",
    "check_overlap_class",
    "check_unowned_have_no_grad",
    "refuse_sparse_gradients",
    "step_fingerprint",
    "unmatched_parameters",
]

ParamGroups = list[dict[str, Any]]


_EMPTY = inspect.Parameter.empty


def check_optimizer_class(optimizer_class: Any) -> type[Optimizer]:
    """The ``torch.optim`` class to build local optimizers with (a functional class's own), or a TypeError; a class
    coupling every parameter in one step (LBFGS) is refused at every world size: each rank would step its own."""
    expected = (
        "optimizer_class must be a torch.optim.Optimizer subclass such as torch.optim.AdamW, "
        "or a distoptim.functional class such as distoptim.functional.FunctionalAdamW"
    )
    if isinstance(optimizer_class, (Optimizer, FunctionalOptimizer)):
        name = type(optimizer_class).__name__
        raise TypeError(
            f"{expected}; got an instance of {name}: pass the class, with its hyperparameters as keyword arguments, "
            f"e.g. ZeroRedundancyOptimizer(params, {name}, lr=...)"
        )
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, (Optimizer, FunctionalOptimizer))):
        raise TypeError(f"{expected}; got {type(optimizer_class).__name__} {optimizer_class!r}")
    if not issubclass(optimizer_class, FunctionalOptimizer):
        cls = optimizer_class
    elif (functional_cls := functional_class_for(optimizer_class)) is None:
        raise TypeError(f"{expected}; got the generic {optimizer_class.__name__}, use one of its subclasses")
    else:
        cls = functional_cls.spec.torch_cls
    if is_coupled(cls):
        name = class_name(cls)
        raise ValueError(
            f"{name} couples every parameter in one step (its curvature history and line search span all of them), "
            f"but ZeroRedundancyOptimizer steps each rank's shard on its own: use {name} without "
            "ZeroRedundancyOptimizer, or an optimizer that updates each parameter on its own (torch.optim.AdamW ...)"
        )
    if (closure := inspect.signature(cls.step).parameters.get("closure")) is not None and closure.default is _EMPTY:
        raise TypeError(
            f"{class_name(cls)}.step requires a closure (it evaluates the model inside its step, as SAM or LBFGS do), "
            "but ZeroRedundancyOptimizer runs the closure once, before it steps each rank's shard on its own: use an "
            "optimizer whose step takes closure=None"
        )
    return cls


def unmatched_parameters(named: Iterable[tuple[str, Tensor]], zero: Any) -> tuple[list[str], list[str]]:
    """The trainable parameters of ``named`` that ``zero`` does not hold (by name), and ``zero``'s trainable ones that
    ``named`` lacks (by place in its groups): a model wrapper and the optimizer must train the same parameters."""
    named = list(named)
    held, present = set(zero.global_params), {p for _, p in named}
    extra = [f"'{name}'" for name, p in named if p.requires_grad and p not in held]
    missing = [
        f"param_groups[{g}]['params'][{i}] {tuple(p.shape)}"
        for g, group in enumerate(zero.param_groups)
        for i, p in enumerate(group["params"])
        if p.requires_grad and p not in present
    ]
    return extra, missing


def refuse_sparse_gradients(module: torch.nn.Module, who: str, instead: str = "keep DDP's default all-reduce") -> None:
    """Refuse a module whose embeddings make sparse gradients (``sparse=True``), which no dense bucket can hold."""
    sparse = [
        f"'{name}'"
        for name, child in module.named_modules()
        if isinstance(child, (torch.nn.Embedding, torch.nn.EmbeddingBag))
        and child.sparse
        and child.weight.requires_grad
    ]
    if sparse:
        raise ValueError(
            f"{who} reduces dense gradients only, but {', '.join(sparse[:3])} (nn.Embedding or nn.EmbeddingBag with "
            f"sparse=True) makes sparse gradients. Build it with sparse=False (its gradient is then dense), or "
            f"{instead}"
        )


def try_optimizer_class(
    optimizer_class: type[Optimizer], groups: ParamGroups, defaults: dict[str, Any], master_dtype: torch.dtype | None
) -> None:
    """Build a throwaway local optimizer over meta-device stand-ins (else the parameters): its refusals raise here."""
    check_group_classes(groups, optimizer_class)
    with warnings.catch_warnings():  # the real construction warns once, not twice
        warnings.simplefilter("ignore")
        try:
            optim = build_local_optimizer(_stand_in_groups(groups), optimizer_class, defaults)
        except (TypeError, ValueError):
            raise
        except Exception:
            optim = build_local_optimizer([dict(group) for group in groups], optimizer_class, defaults)
    check_eps_from_first_dtype(optim.param_groups, optimizer_class, master_dtype)


def check_group_classes(groups: ParamGroups, optimizer_class: type) -> None:
    """Each group's own ``optimizer_class`` is a class we can shard, and a Muon group holds matrices only."""
    for index, group in enumerate(groups):
        cls = optimizer_class
        if CLASS_KEY in group:
            try:
                cls = check_optimizer_class(group[CLASS_KEY])
            except TypeError as error:
                raise TypeError(f"param group {index}: 'optimizer_class': {error}") from None
        if not issubclass(cls, torch.optim.Muon):
            continue
        for position, param in enumerate(group["params"]):
            if param.dim() == 2:
                continue
            what = (
                "a vector or scalar (a bias, a norm's weight)"
                if param.dim() < 2
                else "a convolution's weight or another tensor of more than 2 dimensions (flattening it to a matrix "
                "is not supported)"
            )
            raise ValueError(
                f"Muon only supports 2D parameters whereas we found a parameter with size: {param.size()}. "
                f"param group {index} (torch.optim.Muon), parameter {position} has shape {tuple(param.shape)}: "
                f"{what}. Muon orthogonalizes matrices only: put this parameter in a group of an elementwise "
                "optimizer (the constructor's optimizer_class, torch.optim.AdamW ...)"
            )


def check_overlap_class(optimizer_class: type, groups: Sequence[dict[str, Any]] = ()) -> type[FunctionalOptimizer]:
    """The functional class stepping every group in overlap mode, or a ValueError naming the supported ones."""
    functional_cls = functional_class_for(optimizer_class)
    if functional_cls is None:
        name = getattr(optimizer_class, "__qualname__", repr(optimizer_class))
        raise ValueError(
            "Using `ddp_with_overlap=True` requires using a functional optimizer, but there is no supported "
            f"functional optimizer equivalent for {optimizer_class}. {name} has none; use one of SGD, Adam, AdamW, "
            "Adagrad, Adadelta, Adamax, RMSprop, Rprop (or their distoptim.functional classes)"
        )
    for index, group in enumerate(groups):
        cls = group.get(CLASS_KEY)
        if cls is not None and group_class(group, optimizer_class) is not torch_class_of(optimizer_class):
            name = getattr(cls, "__qualname__", repr(cls))
            raise ValueError(
                f"overlap_with_ddp=True steps every group with one functional optimizer "
                f"({functional_cls.__qualname__}), but param group {index} names optimizer_class={name}: build it "
                "with overlap_with_ddp=False (or use ShardedDataParallel for ZeRO-2) to step groups "
                "with their own classes"
            )
    return functional_cls


def check_partition(partition: Any, optimizer_class: type, groups: ParamGroups) -> None:
    """``partition`` is a mode the plan knows, and an even one cuts dense parameters only."""
    if partition not in MODES:
        raise ValueError(f"partition must be one of {', '.join(map(repr, MODES))}, got {partition!r}")
    if partition != "even":
        return
    for index, group in enumerate(groups):
        if not is_elementwise(group_class(group, optimizer_class)):
            continue  # never cut: its parameters are placed whole (partition.py)
        for position, param in enumerate(group["params"]):
            if not is_dense(param):
                raise ValueError(
                    f"partition='even': param group {index}, parameter {position} (shape {tuple(param.shape)}, strides "
                    f"{param.stride()}) does not fill its memory densely, so it cannot be cut into pieces; make it "
                    "contiguous (param.data = param.data.contiguous()) or use partition='greedy'"
                )


def check_state_formats(groups: ParamGroups, state_format: Any, first: int = 0) -> None:
    """Each group's ``state_format`` (its own, or the constructor's) is a format (``first``: the first one's index)."""
    check_format(state_format, "ZeroRedundancyOptimizer")
    for index, group in enumerate(groups, start=first):
        check_format(group.get(FORMAT_KEY, state_format), f"param group {index}")


def _stand_in_groups(groups: ParamGroups) -> ParamGroups:
    # one twin per parameter, so that a parameter given twice is still seen twice
    twins = {param: _stand_in(param) for param in dict.fromkeys(p for group in groups for p in group["params"])}
    return [{**group, "params": [twins[p] for p in group["params"]]} for group in groups]


def _stand_in(param: Tensor) -> Tensor:
    twin = torch.empty(param.shape, dtype=param.dtype, device="meta", requires_grad=param.requires_grad)
    if param.is_leaf:
        return twin
    twin = twin.view(param.shape)  # a non-leaf, as the parameter is: optimizers refuse those
    if param.retains_grad:
        twin.retain_grad()
    return twin


def check_construction(
    params: Any,
    optimizer_class: Any,
    group: comm.Group,
    defaults: dict[str, Any],
    *,
    parameters_as_bucket_view: bool,
    overlap_with_ddp: bool,
    partition: str,
    master_dtype: torch.dtype | None,
    replicate_group: comm.Group | None,
    state_format: str = "fp32",
) -> tuple[type[Optimizer], ParamGroups, torch.device, type[FunctionalOptimizer] | None, comm.Collectives]:
    """ZeroRedundancyOptimizer's arguments checked on this rank, then agreed (all ranks raise or none does)."""
    local: Fingerprint | BaseException
    device = None  # the communication device, once the parameters are known
    try:
        local_class = check_optimizer_class(optimizer_class)
        groups = normalize_param_groups(params)
        device = comm.comm_device(group, [p.device for g in groups for p in g["params"]])
        functional_cls = check_overlap_class(optimizer_class, groups) if overlap_with_ddp else None
        collectives = comm.choose_collectives(group)
        try_optimizer_class(local_class, groups, defaults, master_dtype)
        check_partition(partition, local_class, groups)
        if master_dtype is not None and not (isinstance(master_dtype, torch.dtype) and master_dtype.is_floating_point):
            raise TypeError(
                "master_dtype must be a floating-point torch.dtype such as torch.float32, or None, "
                f"got {master_dtype!r}"
            )
        check_state_formats(groups, state_format)
        if replicate_group is not None and not isinstance(replicate_group, torch.distributed.ProcessGroup):
            raise TypeError(
                f"replicate_group must be a torch.distributed.ProcessGroup or None, got {replicate_group!r}"
            )
        settings = {
            "optimizer_class": f"{local_class.__module__}.{local_class.__qualname__}",
            "parameters_as_bucket_view": parameters_as_bucket_view,
            "overlap_with_ddp": overlap_with_ddp,
            "partition": partition,
            "master_dtype": str(master_dtype),
            "state_format": state_format,
            comm.ENVIRONMENT: collectives.value,
            "p2p.STAGING_BYTES": p2p.STAGING_BYTES,  # sets the chunks every rank cuts its messages into
            "replicas": 1 if replicate_group is None else comm.group_size(replicate_group),
            **defaults,
        }
        local = fingerprint(groups, defaults, settings)
    except Exception as error:
        local = error
    hybrid = [replicate_group] if isinstance(replicate_group, torch.distributed.ProcessGroup) else []
    agree_across_ranks(local, [group, *hybrid], "ZeroRedundancyOptimizer construction")  # every shard group raises
    assert device is not None and not isinstance(local, BaseException)  # agreed: every rank succeeded
    if replicate_group is not None:
        check_replicas(group, replicate_group, local)
    return local_class, groups, device, functional_cls, collectives


def check_replicas(group: comm.Group, replicate_group: comm.Group, settings: Fingerprint) -> None:
    """Hybrid sharding: ``replicate_group`` holds the rank at this rank's position of each shard group (collective)."""
    mine = (comm.group_rank(group), comm.group_size(group))
    positions = all_gather_objects(mine, control_group(replicate_group), torch.device("cpu"))
    ours = set(torch.distributed.get_process_group_ranks(group))
    theirs = set(torch.distributed.get_process_group_ranks(replicate_group))
    local: Fingerprint | BaseException = settings
    if any(position != mine for position in positions) or ours & theirs != {torch.distributed.get_rank()}:
        local = ValueError(
            f"replicate_group must hold one rank of each shard group, each at the same position in its group as this "
            f"rank (rank {mine[0]} of {mine[1]}), and share only this rank with process_group; its members are at "
            f"(rank, size) {positions}. Build the groups as a 2-D mesh: shard groups along one dimension, replicate "
            "groups along the other"
        )
    agree_across_ranks(local, [group, replicate_group], "ZeroRedundancyOptimizer construction (replicas)")


def check_unowned_have_no_grad(unowned: Iterable[Tensor]) -> None:
    """A frozen, unowned parameter with a gradient would be updated by a plain optimizer but by nobody here."""
    if any(param.grad is not None for param in unowned):
        raise RuntimeError(
            "a parameter with requires_grad=False has a gradient, so a plain optimizer would update it, but "
            "ZeroRedundancyOptimizer shards trainable parameters only and nobody owns this one. Set "
            "requires_grad=True on it (on every rank) and it is sharded at the next step(), or set its .grad to None"
        )


def fingerprint(
    groups: ParamGroups, defaults: dict[str, Any], settings: dict[str, Any] | None = None, first_group: int = 0
) -> Fingerprint:
    """What every rank must agree on: ``settings``, the groups' hyperparameters and their parameters' metadata."""
    entries: Fingerprint = {f"settings: {key!r} {{}}": _canonical(value) for key, value in (settings or {}).items()}
    if settings is not None:
        entries["{} param groups"] = len(groups)
    for index, group in enumerate(groups, start=first_group):
        entries[f"param group {index} has {{}} parameters"] = len(group["params"])
        hyperparameters = {**defaults, **{k: v for k, v in group.items() if k != "params"}}
        for key in sorted(hyperparameters):
            entries[f"param group {index}: {key!r} {{}}"] = _canonical(hyperparameters[key])
        for position, p in enumerate(group["params"]):
            label = f"param group {index}, parameter {position}: (shape, dtype, device, requires_grad) {{}}"
            entries[label] = (tuple(p.shape), str(p.dtype), p.device.type, bool(p.requires_grad))
            entries[f"param group {index}, parameter {position}: strides {{}}"] = tuple(p.stride())
    return entries


def _canonical(value: Any) -> Any:
    """``value`` as plain data that compares (and hashes) the same on every rank when it means the same."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)):  # 1 and 1.0 alike; an int beyond a float's 2**53 exactly
        return float(value) if isinstance(value, float) or abs(value) <= 2**53 else value
    if isinstance(value, (tuple, list)):
        return tuple(_canonical(item) for item in value)
    if isinstance(value, dict):
        return tuple(sorted((str(key), _canonical(item)) for key, item in value.items()))
    if isinstance(value, Tensor):  # a device tensor's value is not read: that would stall the CPU on the device
        shown = value.detach().tolist() if value.device.type == "cpu" else f"on {value.device.type}"
        return ("tensor", str(value.dtype), tuple(value.shape), _canonical(shown))
    if isinstance(value, type):  # an optimizer_class key: by name
        return class_name(value)
    if isinstance(value, (torch.dtype, torch.device, complex, enum.Enum)):
        return repr(value)
    return f"<{type(value).__module__}.{type(value).__qualname__}>"  # opaque objects: only their type is comparable


def step_fingerprint(trainable: tuple[int, ...], param_groups: ParamGroups) -> Fingerprint:
    """What every rank steps with alike: the trainable parameters; the hyperparameters among stepping ranks (Join)."""
    hyperparameters: Fingerprint = {
        f"param group {index}: {key!r} {{}}": _canonical(value)
        for index, group in enumerate(param_groups)
        for key, value in group.items()
        if key != "params"
    }
    return {"the parameters that require grad, by index: {}": trainable, STEPPING_ONLY: hyperparameters}
