"""Optimizer state kept in fewer bits between steps (``state_format``; a small parameter's in fp32) around torch.optim's
own step: the tensors with a gradient step in chunks of at most ``CHUNK_NUMEL`` encoded elements, each chunk's state
decoded for its step (the others' ``.grad`` held back) and encoded again (``docs/guides/state-formats.md``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from distoptim._flat import is_dense
from distoptim.zero import codecs
from distoptim.zero.shard import LocalShard

__all__ = [
    "FORMAT_KEY",
    "StateFormats",
    "block_sizes",
    "check_format",
    "decoded",
    "is_trained",
    "needs_formats",
    "tensor_format",
]

FORMAT_KEY = "state_format"
CHUNK_NUMEL = 1 << 22  # encoded elements decoded at once in a step (and the buffers kept for them)


def check_format(value: Any, where: str) -> str:
    if value not in codecs.FORMATS:
        raise ValueError(f"{where}: state_format must be one of {', '.join(map(repr, codecs.FORMATS))}, got {value!r}")
    return str(value)


def group_format(group: dict[str, Any]) -> str:
    return str(group.get(FORMAT_KEY, "fp32"))


def needs_formats(groups: Iterable[dict[str, Any]]) -> bool:
    """Whether any group keeps its state in fewer bits (the local optimizer then steps through ``StateFormats``)."""
    return any(group_format(group) != "fp32" for group in groups)


def tensor_format(param: Tensor, fmt: str) -> str:
    """The format a parameter's state is kept in, decided on the whole parameter."""
    return fmt if param.is_floating_point() and param.numel() >= codecs.MIN_NUMEL else "fp32"


def block_sizes(groups: Sequence[dict[str, Any]]) -> list[int]:
    """Each parameter's quantization block (global order; 1 where its state is not blockwise)."""
    return [
        codecs.BLOCK if tensor_format(p, group_format(group)) == "int8" else 1
        for group in groups
        for p in group["params"]
    ]


class StateFormats:
    """The format of each local tensor's state, and the step that decodes, steps and encodes chunk by chunk."""

    def __init__(self, shard: LocalShard, global_groups: Sequence[dict[str, Any]]) -> None:
        self.formats = {
            piece.tensor: tensor_format(piece.param, group_format(group))
            for group, local in zip(global_groups, shard.groups)
            for piece in local
        }
        self.group_formats = [group_format(group) for group in global_groups]
        self.scratch = codecs.Scratch(CHUNK_NUMEL)  # a chunk's decoded state, the codecs' temporaries: kept

    def encode_entry(self, tensor: Tensor, entry: dict[str, Any], made_too: bool = False) -> None:
        """Encode ``entry`` (one tensor's state) in place, in ``tensor``'s format; the state a class makes at
        construction (Adagrad's ``sum`` at step 0) only ``made_too``: a first step encodes it (issue 43)."""
        fmt = self.formats.get(tensor, "fp32")
        if fmt == "fp32" or not (made_too or is_trained(entry)):
            return
        for key in [k for k, v in entry.items() if codecs.is_encodable(k, v) and v.shape == tensor.shape]:
            entry.update(codecs.encode(key, _laid_as(entry.pop(key), tensor), fmt, self.scratch))

    def as_kept(self, state: dict[Tensor, dict[str, Any]]) -> dict[Tensor, dict[str, Any]]:
        """``state`` as a step leaves it (encoded copies): a checkpoint's keys do not depend on whether a step ran."""
        kept = {tensor: dict(entry) for tensor, entry in state.items()}
        for tensor, entry in kept.items():
            self.encode_entry(tensor, entry, made_too=True)  # a load makes step-0 entries plain again
        return kept

    def encode_all(self, state: dict[Tensor, dict[str, Any]]) -> None:
        for tensor, entry in state.items():
            self.encode_entry(tensor, entry)

    def check_unchanged(self, groups: Sequence[dict[str, Any]]) -> None:
        """Refuse a group whose ``state_format`` was edited since it was added (the partition was cut for it)."""
        for index, (group, fmt) in enumerate(zip(groups, self.group_formats)):
            if group_format(group) != fmt:
                raise ValueError(
                    f"param group {index}: its 'state_format' was changed to {group_format(group)!r} after the group "
                    f"was added as {fmt!r}; a group's state format is fixed when it is added. Put it back, or build "
                    "the optimizer again and load a consolidated checkpoint into it (that converts the state)"
                )

    def step(
        self, parts: Sequence[Optimizer], groups: Sequence[dict[str, Any]], state: dict[Tensor, Any], kwargs: Any
    ) -> None:
        """Each part's step, chunk by chunk, with the chunk's state decoded for it (see the module's docstring)."""
        stepped = [p for group in groups for p in group["params"] if p.grad is not None]
        grads = [p.grad for p in stepped]
        starts, filled = [0], 0  # each chunk's first position in ``stepped``
        for position, tensor in enumerate(stepped):
            size = tensor.numel() if self.formats.get(tensor, "fp32") != "fp32" else 0
            if filled and filled + size > CHUNK_NUMEL:
                starts.append(position)
                filled = 0
            filled += size
        chunks = list(zip(starts, [*starts[1:], len(stepped)]))
        try:
            for start, end in chunks:
                if len(chunks) > 1:  # only the chunk's tensors hold their gradient
                    for position, tensor in enumerate(stepped):
                        tensor.grad = grads[position] if start <= position < end else None
                with self.decoded_for(stepped[start:end], state):
                    for part in parts:
                        part.step(**kwargs)
        finally:  # every gradient back, also where a chunk's step raised
            if len(chunks) > 1:
                for tensor, grad in zip(stepped, grads):
                    tensor.grad = grad

    @contextlib.contextmanager
    def decoded_for(self, tensors: Sequence[Tensor], state: dict[Tensor, Any]) -> Iterator[None]:
        """``tensors``' state decoded (into the scratch) for a step of them, and encoded again after."""
        self.scratch.reset()
        for tensor in tensors:
            if tensor in state:
                decode_entry(tensor, state[tensor], self.scratch)
        try:
            yield
        finally:
            for tensor in tensors:
                if tensor in state:
                    self.encode_entry(tensor, state[tensor], made_too=True)  # it stepped: trained


def is_trained(entry: dict[str, Any] | None) -> bool:
    """Whether ``entry`` is more than a fresh optimizer makes at construction (Adagrad's ``sum`` at ``step`` 0)."""
    return entry is not None and bool(entry) and float(entry.get("step", 1)) != 0


def _laid_as(value: Tensor, tensor: Tensor) -> Tensor:
    """``value`` laid out as ``tensor`` (a copy only where it is not): int8 blocks follow the parameter's memory
    order, also for state torch.optim cloned from a gradient laid out otherwise (SGD's momentum of a hand-set grad)."""
    if not is_dense(tensor):
        return value.contiguous()
    if value.stride() == tensor.stride():
        return value
    return value.new_empty_strided(tensor.shape, tensor.stride()).copy_(value)


def decode_entry(tensor: Tensor, entry: dict[str, Any], scratch: codecs.Scratch | None = None) -> None:
    """Decode ``entry``'s encoded keys in place, to ``tensor``'s dtype (into ``scratch``'s slices where given)."""
    for name in [k for k in entry if k.endswith((".bf16", ".int8"))]:
        key, fmt = name.rsplit(".", 1)
        encoded = {n: entry.pop(n) for n in codecs.encoded_names(key, fmt)}
        entry[key] = codecs.decode(key, encoded, fmt, tensor.dtype, scratch)


def decoded(state: dict[Tensor, dict[str, Any]]) -> dict[Tensor, dict[str, Any]]:
    """``state`` with every encoded entry decoded (copies; the others as they are): torch.optim's format."""
    out = {}
    for tensor, entry in state.items():
        if any(k.endswith((".bf16", ".int8")) for k in entry):
            entry = dict(entry)
            decode_entry(tensor, entry)
        out[tensor] = entry
    return out
