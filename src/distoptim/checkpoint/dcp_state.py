"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP): every rank saves and loads its fragments only,
each state tensor as the boxes of the parameter's shape its fragment covers (``memory_range_boxes``), so that a
checkpoint is independent of world size, partition and memory layout. ``docs/guides/internals.md``."""

from __future__ import annotations

import pickle
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from distoptim._flat import is_dense
from distoptim.checkpoint.boxes import memory_range_boxes
from distoptim.checkpoint.consolidated import check_hyperparameters, loaded_hyperparameters
from distoptim.zero.codecs import BLOCK, SCALES_SUFFIX
from distoptim.zero.shard import MASTER_KEY, LocalShard, LocalTensor
from distoptim.zero.state_formats import block_sizes

if TYPE_CHECKING:  # DCP is imported where it is used: importing it costs a third of distoptim's import time
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem

__all__ = [
    "APART",
    "SAVED_APART",
    "STATE_KEYS",
    "TRAINED",
    "FragmentTensor",
    "check_state_keys",
    "held_keys",
    "install_loaded",
    "is_sharded_state",
    "keys_by_name",
    "load_param_groups",
    "prune_unsaved",
    "saved_param_groups",
    "sharded_state",
    "template_state",
]

CHUNK_BYTES = 4 << 20
"""The largest DCP chunk a save writes: a load reads a chunk whole, so this bounds its extra memory."""
PARAM_GROUPS = "param_groups"
LAYOUTS = "param_layouts"
"""Each parameter's ``(shape, None)``, or ``(shape, None, strides)`` where int8 blocks follow a non-row-major memory
order (``memory_order``); distoptim 0.2 saved ``(shape, strides)`` with its state flat (``convert`` reads those)."""
TRAINED = "trained_params"
"""In each group of ``PARAM_GROUPS``: its parameters with trained state (a load must not drop them); not a setting."""
STATE_KEYS = "state_keys"
"""In each group of ``PARAM_GROUPS``: ``{key: [parameters]}``, the state keys saved for its parameters (a load whose
template lacks one would drop it); not a setting."""
APART = "saved_apart"
"""In each group of ``PARAM_GROUPS`` of a save made after a step raised once a shard was stepped: a load refuses it."""
SAVED_APART = (
    "this checkpoint was saved after a zero.step() that raised once some rank's local optimizer had begun to step its "
    "shard, before the parameters were synced: its optimizer state and the model's parameters are apart. Load a "
    "checkpoint saved before that step"
)


class FragmentTensor(Tensor):
    """A tensor of ``shape`` of which this rank holds ``pieces`` (``(offsets, local)`` boxes, views of ``source``),
    through DCP's checkpointable protocol as DTensor implements it; ``saved=False``: a placeholder only a load fills.
    Holds no data; supports only ``new_empty`` (DCP's staging for ``async_save``)."""

    _pieces: list[tuple[tuple[int, ...], Tensor]]
    source: Tensor
    saved: bool

    @staticmethod
    def __new__(
        cls, pieces: list[tuple[tuple[int, ...], Tensor]], shape: tuple[int, ...], source: Tensor, saved: bool = True
    ) -> FragmentTensor:
        wrapper = Tensor._make_wrapper_subclass(cls, shape, dtype=source.dtype, device=source.device)
        wrapper._pieces, wrapper.source, wrapper.saved = pieces, source, saved
        return wrapper

    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        if func is torch.ops.aten.new_empty.default:  # the staging copies the attributes (pieces, source) over
            fragment, device = args[0], (kwargs or {}).get("device") or args[0].device
            shell = fragment.source.new_empty(0, device=device)
            return FragmentTensor([], tuple(fragment.shape), shell, fragment.saved)
        raise NotImplementedError(f"{func} is not supported on a checkpoint fragment (save or load it with DCP)")

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(at), sizes=local.shape) for at, local in self._pieces]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        if not self.saved:
            return []
        items: list[WriteItem] = []
        for position, (chunk, (_, local)) in enumerate(zip(self.__create_chunk_list__(), self._pieces)):
            data = TensorWriteData(chunk=chunk, properties=TensorProperties.create_from_tensor(local), size=self.size())
            index = MetadataIndex(fqn, chunk.offsets, position)
            items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data))
        return items

    def __get_tensor_shard__(self, index: MetadataIndex) -> Tensor:
        offsets, hint = tuple(index.offset or ()), index.index  # the hint: the chunk's position, where DCP knows it
        if hint is not None and hint < len(self._pieces) and self._pieces[hint][0] == offsets:
            return _on_own_storage(self._pieces[hint][1])
        return _on_own_storage(next(local for at, local in self._pieces if at == offsets))

    def __repr__(self) -> str:  # type: ignore[override]
        boxes = [(at, tuple(local.shape)) for at, local in self._pieces]
        return f"FragmentTensor(shape={tuple(self.shape)}, boxes={boxes})"


def _on_own_storage(box: Tensor) -> Tensor:
    """``box`` over a shared storage of exactly its bytes (DCP copies a tensor whose storage is larger to write it)."""
    size = box.numel() * box.element_size()
    if box.untyped_storage().nbytes() == size or not is_dense(box):
        return box
    begin = box.storage_offset() * box.element_size()
    return box.new_empty(0).set_(box.untyped_storage()[begin : begin + size], 0, box.shape, box.stride())


@dataclass(eq=False)
class Placeholder:
    """A non-tensor value a fresh optimizer would have: a load may replace it, a save leaves it out."""

    value: Any

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return []


def sharded_state(
    shard: LocalShard,
    state: dict[Tensor, dict[str, Any]],
    placeholders: dict[Tensor, dict[str, Any]],
    param_groups: bytes,
    params: list[Tensor],
) -> dict[str, Any]:
    """``{"state.<index>.<name>": piece or scalar, "param_groups": pickled, "param_layouts": pickled}`` for this
    rank's fragments: their state, or for a fragment without any, ``placeholders`` that only a load fills."""
    layouts = [layout_of(tuple(p.shape), memory_order(p)) for p in params]
    exported: dict[str, Any] = {PARAM_GROUPS: param_groups, LAYOUTS: pickle.dumps(layouts)}
    for local in (t for t in shard.locals if t.param.numel() > 0):  # zero-sized: nothing to keep
        saved = local.tensor in state
        entry = dict(state[local.tensor] if saved else placeholders.get(local.tensor, {}))
        for name, value in entry.items():
            scales = name.endswith(SCALES_SUFFIX) and isinstance(value, Tensor)
            exported[f"state.{local.index}.{name}"] = (_scales_saved if scales else _as_saved)(value, local, saved)
        if local.master:
            exported[f"state.{local.index}.{MASTER_KEY}"] = _as_saved(local.tensor, local, True)
    return exported


def memory_order(tensor: Tensor) -> tuple[int, ...] | None:
    """The strides of ``tensor``'s memory order, by which int8 blocks are laid; None where that is row-major."""
    return None if tensor.is_contiguous() or not is_dense(tensor) else tuple(tensor.stride())


def layout_of(shape: tuple[int, ...], order: tuple[int, ...] | None) -> tuple[Any, ...]:
    """A parameter's entry in ``LAYOUTS``, from its shape and ``memory_order``."""
    return (shape, None) if order is None else (shape, None, order)


def _as_saved(value: Any, local: LocalTensor, saved: bool) -> Any:
    """A state tensor as a fragment of the boxes its piece covers; else as it is (a placeholder unless ``saved``)."""
    if isinstance(value, Tensor) and (value.dim() > 0 or not saved):  # a saved scalar (a step) is saved as it is
        piece = value.detach()
        if local.whole or piece.dim() == 0:
            return FragmentTensor(_boxes(piece, piece, 0, piece.numel()), piece.shape, value, saved)
        if piece.dim() != 1 or piece.numel() != local.length or (local.length > 1 and piece.stride() != (1,)):
            raise ValueError(
                f"the optimizer state of parameter {local.index} holds a tensor of shape {tuple(piece.shape)} for a "
                f"piece of {local.length} elements: a parameter split across ranks (partition='even') needs an "
                "elementwise optimizer, whose state is shaped like the piece"
            )
        return FragmentTensor(_boxes(piece, local.param, local.offset, local.length), local.param.shape, value, saved)
    return value if saved else Placeholder(value)


def _scales_saved(value: Tensor, local: LocalTensor, saved: bool) -> FragmentTensor:
    """An int8 state's scales as a fragment of the parameter's blocks (an even partition cuts between blocks)."""
    blocks = -(-local.param.numel() // BLOCK)
    return FragmentTensor([((local.offset // BLOCK,), value.detach())], (blocks,), value, saved)


def _boxes(piece: Tensor, like: Tensor, offset: int, length: int) -> list[tuple[tuple[int, ...], Tensor]]:
    """``piece`` (``like``'s ``[offset, offset + length)``) as (offsets, view) boxes of at most ``CHUNK_BYTES``."""
    if not is_dense(like) or not is_dense(piece):
        return [((0,) * piece.dim(), piece)] if piece.numel() > 0 else []
    limit = CHUNK_BYTES // piece.element_size()
    base = piece.storage_offset()
    return [
        (box.offsets, piece.as_strided(box.sizes, like.stride(), base + box.start))
        for box in memory_range_boxes(like.shape, like.stride(), offset, length, limit)
    ]


def template_state(
    shard: LocalShard, step: Callable[[], Any], state: dict[Tensor, dict[str, Any]]
) -> dict[Tensor, dict[str, Any]]:
    """The state a fresh optimizer would make for each local tensor without any (one step on zero gradients), for
    a load to fill in; returned, not kept: state, values and ``.grad`` are as before afterwards."""
    missing = [t for t in shard.locals if not state.get(t.tensor)]
    if not missing:
        return {}
    values = [t.tensor.detach().clone() for t in missing]
    grads = [t.tensor.grad for t in shard.locals]
    for local in shard.locals:  # only the missing ones take part in the step
        local.tensor.grad = torch.zeros_like(local.tensor) if local in missing else None
    try:
        step()
    finally:
        with torch.no_grad():
            for local, value in zip(missing, values):
                local.tensor.copy_(value)
        for local, grad in zip(shard.locals, grads):
            local.tensor.grad = grad
    return {t.tensor: state.pop(t.tensor) for t in missing if t.tensor in state}


def load_param_groups(
    saved: dict[str, Any], param_groups: list[dict[str, Any]], optimizer_class: type
) -> list[dict[str, Any]]:
    """Each param group's hyperparameters from a loaded sharded checkpoint, once checked to be this optimizer's."""
    if not is_sharded_state(saved) or not saved[PARAM_GROUPS]:
        raise ValueError(
            "this is not a loaded sharded optimizer state: pass the dict that zero.sharded_state_dict() returned, "
            "after dcp.load(...) filled it in"
        )
    groups = saved_param_groups(saved)
    if len(groups) != len(param_groups):
        raise ValueError(f"the checkpoint has {len(groups)} param groups but this optimizer has {len(param_groups)}")
    params = [p for group in param_groups for p in group["params"]]
    shapes = [tuple(p.shape) for p in params]
    saved_layouts = pickle.loads(saved[LAYOUTS])
    saved_shapes = [shape if layout is None else layout[0] for layout, shape in zip(saved_layouts, shapes)]
    if len(saved_layouts) != len(shapes) or saved_shapes != shapes:  # None: unknown (converted, no state)
        raise ValueError(
            f"the checkpoint was saved for other parameters (shapes {_shown(saved_shapes)}) than this optimizer's "
            f"({_shown(shapes)}); load a checkpoint of this model, with its parameters in this order"
        )
    # int8 blocks of another memory order would take other elements' scales (global parameters: every rank alike)
    for index, (block, layout, param) in enumerate(zip(block_sizes(param_groups), saved_layouts, params)):
        own = memory_order(param)
        saved_order = None if layout is None or len(layout) < 3 else tuple(layout[2])
        if block != 1 and layout is not None and saved_order != own:
            raise ValueError(
                f"parameter {index}'s int8 state was saved in blocks of memory order (strides) "
                f"{saved_order or 'row-major'}, but this optimizer's parameter is laid out {own or 'row-major'}: int8 "
                "blocks follow the memory order; lay the parameter out as when saved, or go through a consolidated "
                "checkpoint"
            )
    for number, (group, own_group) in enumerate(zip(groups, param_groups)):
        check_hyperparameters(group, own_group, number, optimizer_class)
    return [loaded_hyperparameters(group) for group in groups]


def saved_param_groups(saved: dict[str, Any]) -> list[dict[str, Any]]:
    """The param groups of a sharded save, refused where it was saved apart (``APART``)."""
    groups: list[dict[str, Any]] = pickle.loads(saved[PARAM_GROUPS])
    if any(group.get(APART) for group in groups):
        raise ValueError(SAVED_APART)
    return groups


def _shown(shapes: list[tuple[int, ...]]) -> str:
    return f"{shapes[:4]}{' ...' if len(shapes) > 4 else ''}, {len(shapes)} in all"


def is_sharded_state(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(value.get(key), bytes) for key in (PARAM_GROUPS, LAYOUTS))


def prune_unsaved(exported: dict[str, Any], prefix: str, saved: Collection[str]) -> None:
    """Drop from ``exported`` the entries the checkpoint (keys ``saved``, ``exported`` under ``prefix``) cannot have:
    state of a parameter that had none, master weights the saving run did not keep."""
    saved_entries = [_index_and_name(key[len(prefix) :]) for key in saved if key.startswith(f"{prefix}state.")]
    stateful = {index for index, name in saved_entries if name != MASTER_KEY}
    for key in [key for key in exported if key.startswith("state.") and f"{prefix}{key}" not in saved]:
        index, name = _index_and_name(key)
        if name == MASTER_KEY or index not in stateful:
            del exported[key]


def _index_and_name(key: str) -> tuple[str, str]:
    _, index, name = key.split(".", 2)
    return index, name


def held_keys(shard: LocalShard, state: dict[Tensor, dict[str, Any]]) -> dict[int, list[str]]:
    """The state keys ``sharded_state`` saves for each local parameter (its master weights too), by index."""
    held = {}
    for local in (t for t in shard.locals if t.param.numel() > 0):
        if keys := sorted(state.get(local.tensor, ())) + ([MASTER_KEY] if local.master else []):
            held[local.index] = keys
    return held


def keys_by_name(params: list[int], held: Mapping[int, Collection[str]]) -> dict[str, list[int]]:
    """A group's ``STATE_KEYS`` entry: each key of ``held`` (keys by parameter index) with the ``params`` holding it."""
    named: dict[str, list[int]] = {}
    for index in params:
        for name in sorted(held.get(index, ())):
            named.setdefault(name, []).append(index)
    return named


def check_state_keys(
    shard: LocalShard, saved_groups: list[dict[str, Any]], own_groups: list[dict[str, Any]], loaded: dict[str, Any]
) -> None:
    """Refuse a load whose template (``loaded``) has no entry for a key the checkpoint saved for one of this rank's
    parameters (``STATE_KEYS``; none in older saves): DCP loads only the entries asked for, so it would be dropped."""
    saved = {(i, name) for group in saved_groups for name, held in (group.get(STATE_KEYS) or {}).items() for i in held}
    asked = {(int(i), name) for i, name in (_index_and_name(key) for key in loaded if key.startswith("state."))}
    dropped = sorted((i, name) for i, name in saved - asked if name != MASTER_KEY)  # usually none; masters: a warning
    for number, pieces in enumerate(shard.groups):
        for local in (t for t in pieces if t.param.numel() > 0):
            if missing := [name for index, name in dropped if index == local.index]:
                own, theirs = own_groups[number], saved_groups[number]
                changed = [
                    f"{k}={theirs[k]!r} (here {own[k]!r})"
                    for k in own
                    if k in theirs and repr(own[k]) != repr(theirs[k])
                ]
                raise ValueError(
                    f"load_sharded_state_dict: the checkpoint holds optimizer state {missing} for parameter "
                    f"{local.index}, which this optimizer does not make with its hyperparameters (param group "
                    f"{number} was saved with {', '.join(changed[:4]) or 'other settings'}), so the load would drop "
                    "it: build the optimizer with the checkpoint's hyperparameters (e.g. momentum=0.9, amsgrad=True) "
                    "before calling sharded_state_dict(), or load a consolidated checkpoint (load_state_dict)"
                )


def install_loaded(shard: LocalShard, state: dict[Tensor, dict[str, Any]], loaded: dict[str, Any]) -> None:
    """Make the local optimizer's state what a load filled into ``sharded_state``'s dict; a fragment without entries
    starts without state, a master copy not loaded from its parameter (with a warning)."""
    unmastered = []
    for local in (t for t in shard.locals if t.param.numel() > 0):
        head = f"state.{local.index}."
        entry = {key[len(head) :]: _unwrapped(value) for key, value in loaded.items() if key.startswith(head)}
        if local.master and entry.pop(MASTER_KEY, None) is None:
            unmastered.append(local.index)
            with torch.no_grad():
                local.tensor.copy_(local.param_piece())
        if entry:
            state[local.tensor] = entry
        else:
            state.pop(local.tensor, None)
    if unmastered:
        warnings.warn(
            f"the checkpoint has no master weights for parameters {sorted(set(unmastered))[:5]}; their master copies "
            "start from the (rounded) parameters, so the run does not continue bit for bit",
            stacklevel=3,
        )


def _unwrapped(value: Any) -> Any:
    if isinstance(value, FragmentTensor):
        return value.source
    return value.value if isinstance(value, Placeholder) else value
