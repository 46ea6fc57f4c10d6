"""Between the two checkpoint formats, offline, on one process: a sharded DCP checkpoint's optimizer part and
``torch.optim``'s state dict (``python -m distoptim checkpoint DIR --to-torch optim.pt`` or ``--from-torch optim.pt``).

Conversion holds the whole state in memory: it is for leaving and joining the format, not for training."""

from __future__ import annotations

import argparse
import pickle
import sys
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from distoptim._flat import flat_view
from distoptim.checkpoint import checksums
from distoptim.checkpoint import dcp_state as sharded
from distoptim.checkpoint.dcp import check_files, read_metadata, underlying_error
from distoptim.zero import codecs
from distoptim.zero.state_formats import FORMAT_KEY, check_format, tensor_format

__all__ = ["dcp_to_torch_optim", "main", "parameter_shapes", "torch_optim_to_dcp"]

PARAMETER_SHAPED = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_inf", "square_avg", "acc_delta", "sum", "ax", "momentum_buffer"}
    | {"grad_avg", "prev", "step_size", "variance", "master_weight"}
)
"""The state entries of torch.optim's optimizers (and distoptim's master weights) shaped like their parameter."""
FACTORS = ("row_var", "col_var")
"""Adafactor's factored second moment of a parameter of shape ``(..., m, n)``: ``(..., m, 1)`` and ``(..., 1, n)``."""

Shapes = Sequence[Sequence[int] | Tensor] | Mapping[str, Tensor]


def dcp_to_torch_optim(directory: str | Path, key: str = "optim") -> dict[str, Any]:
    """The ``torch.optim`` state dict of the optimizer saved under ``key`` in a sharded checkpoint."""
    if not (Path(directory) / ".metadata").is_file():
        raise ValueError(f"{directory} is not a torch.distributed.checkpoint directory (it has no .metadata)")
    manifest = checksums.read_manifest(Path(directory))
    if manifest is None:
        print(
            f"warning: {directory} has no {checksums.MANIFEST}: its files cannot be checked for damage", file=sys.stderr
        )
    check_files(Path(directory), (read_metadata(Path(directory)).storage_data or {}).values(), manifest)
    with tempfile.TemporaryDirectory() as temporary:
        scratch = str(Path(temporary) / "flat.pt")
        try:
            dcp_to_torch_save(str(directory), scratch)
        except (Exception, CheckpointException) as error:  # DCP's CheckpointException is a BaseException
            cause = underlying_error(error)
            raise ValueError(f"{directory} cannot be read: {type(cause).__name__}: {cause}") from cause
        flat: dict[str, Any] = torch.load(scratch, weights_only=False)
    saved = flat.get(key)
    if not isinstance(saved, dict) or sharded.PARAM_GROUPS not in saved:
        keys = sorted(flat)
        raise ValueError(f"{directory} holds no distoptim optimizer under {key!r} (its keys: {keys[:8]}); pass --key")
    layouts = pickle.loads(saved[sharded.LAYOUTS])
    state: dict[int, dict[str, Any]] = {}
    for name, value in saved.items():
        if name.startswith("state."):
            index, _, entry = name.removeprefix("state.").partition(".")
            state.setdefault(int(index), {})[entry] = _reshaped(value, layouts[int(index)])
    for index, entry in state.items():
        _decode(entry, index, layouts[index])
    own = (sharded.TRAINED, sharded.STATE_KEYS)  # what a sharded save adds to the groups
    groups = [{k: v for k, v in group.items() if k not in own} for group in sharded.saved_param_groups(saved)]
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def _decode(entry: dict[str, Any], index: int, layout: tuple[Any, ...] | None) -> None:
    """Decode ``entry``'s encoded keys (``exp_avg.int8`` and its scales, ``exp_avg.bf16``) in place to fp32."""
    for name in [k for k in entry if k.endswith((".bf16", ".int8"))]:
        key, fmt = name.rsplit(".", 1)
        names = codecs.encoded_names(key, fmt)
        if missing := [n for n in names if n not in entry]:
            raise ValueError(f"parameter {index}'s state has {name} but not {missing}: the checkpoint is incomplete")
        encoded = {n: entry.pop(n) for n in names}
        order = None if layout is None or len(layout) < 3 else tuple(layout[2])
        if order is not None:  # codes saved by logical index: lay them in the memory order their blocks follow
            codes = encoded[name]
            encoded[name] = torch.empty_strided(codes.shape, order, dtype=codes.dtype).copy_(codes)
        entry[key] = codecs.decode(key, encoded, fmt, torch.float32).contiguous()


def torch_optim_to_dcp(
    state_dict: dict[str, Any],
    directory: str | Path,
    key: str = "optim",
    shapes: Shapes | None = None,
    state_format: str | None = None,
) -> int:
    """Write ``state_dict`` (``torch.optim``'s format) as a sharded checkpoint for ``load_sharded_state_dict``; return
    how many data files were written. ``shapes`` (where the state cannot tell): the parameters' shapes, or the
    parameters (whose memory order int8 blocks follow) in the optimizer's order, or a model state dict when the
    groups carry ``param_names``; ``state_format``: default each group's ``"state_format"``, else fp32."""
    found = parameter_shapes(state_dict, shapes)
    groups = [dict(group) for group in state_dict["param_groups"]]
    given = [None] * len(found) if shapes is None else _given(shapes, groups, len(found))
    orders = [sharded.memory_order(item) if isinstance(item, Tensor) else None for item in given]
    formats: list[str] = []
    for number, group in enumerate(groups):
        fmt = check_format(group.get(FORMAT_KEY, "fp32") if state_format is None else state_format, f"group {number}")
        if state_format is not None:
            group[FORMAT_KEY] = state_format
        formats += [fmt] * len(group["params"])
    layouts = [None if shape is None else sharded.layout_of(shape, order) for shape, order in zip(found, orders)]
    state = {i: _encoded(entry, found[i], orders[i], formats[i]) for i, entry in sorted(state_dict["state"].items())}
    for group in groups:  # as a sharded save names them: a load whose template lacks one refuses it
        group[sharded.STATE_KEYS] = sharded.keys_by_name(group["params"], state)
    payload: dict[str, Any] = {sharded.PARAM_GROUPS: pickle.dumps(groups), sharded.LAYOUTS: pickle.dumps(layouts)}
    for index, entry in state.items():
        payload.update((f"state.{index}.{name}", value) for name, value in entry.items())
    with warnings.catch_warnings():  # dcp warns that it "assumes" one process even where no_dist=True says so
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        metadata = dcp.save({key: payload}, storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)
    files = [written.relative_path for written in (metadata.storage_data or {}).values()]
    checksums.write_manifest(Path(directory), checksums.checksums(Path(directory), files))
    return len(set(files))


def _encoded(
    entry: dict[str, Any], shape: tuple[int, ...] | None, order: tuple[int, ...] | None, fmt: str
) -> dict[str, Any]:
    """``entry`` with its encodable parameter-shaped keys encoded in ``fmt``, as ``StateFormats.encode_entry`` does."""
    out: dict[str, Any] = {}
    for name, value in entry.items():
        encodable = shape is not None and codecs.is_encodable(name, value) and tuple(value.shape) == shape
        own = tensor_format(value, fmt) if encodable else "fp32"
        if own == "fp32":
            out[name] = value
            continue
        laid = value if order is None else torch.empty_strided(value.shape, order, dtype=value.dtype).copy_(value)
        out.update(codecs.encode(name, laid, own))
    return out


def parameter_shapes(state_dict: dict[str, Any], shapes: Shapes | None = None) -> list[tuple[int, ...] | None]:
    """Each parameter's shape (None: no state), from ``shapes`` where given, else from its state's parameter-shaped
    entries or Adafactor's factors; a state that does not show it is refused: never a guess."""
    groups = state_dict["param_groups"]
    count = sum(len(group["params"]) for group in groups)
    given = None if shapes is None else [_shape_of(item) for item in _given(shapes, groups, count)]
    found: list[tuple[int, ...] | None] = [None] * count
    for index, entry in sorted(state_dict["state"].items()):
        if not 0 <= index < count:
            raise ValueError(f"the state has an entry for parameter {index}, but the param groups hold {count}")
        found[index] = _shape_in(entry, index, given is None)
        if given is not None and found[index] not in (None, given[index]):
            raise ValueError(
                f"parameter {index}'s state is for shape {found[index]}, but the shapes given say {given[index]}: "
                "give the shapes of this optimizer's parameters, in its order"
            )
    return found if given is None else list(given)


def _shape_in(entry: dict[str, Any], index: int, needed: bool) -> tuple[int, ...] | None:
    """The parameter shape that ``entry`` shows, or None (no tensor state, or none that shows it and not ``needed``)."""
    tensors = {name: value for name, value in entry.items() if isinstance(value, Tensor) and value.dim() > 0}
    seen = {tuple(value.shape) for name, value in tensors.items() if name in PARAMETER_SHAPED}
    if all(name in tensors for name in FACTORS):
        row, col = tensors[FACTORS[0]].shape, tensors[FACTORS[1]].shape
        seen.add((*row[:-1], col[-1]))
    if len(seen) > 1:
        raise ValueError(f"parameter {index}'s state has parameter-shaped entries of shapes {sorted(seen)}")
    if seen:
        return seen.pop()
    if tensors and needed:
        shown = {name: tuple(value.shape) for name, value in tensors.items()}
        raise ValueError(
            f"parameter {index}'s state ({shown}) does not show the parameter's shape; give the parameters' shapes: "
            "--params FILE (a torch.save'd list of the shapes or of the parameters, in the optimizer's order, or the "
            "model's state_dict() when the param groups carry param_names)"
        )
    return None


def _given(shapes: Shapes, groups: list[dict[str, Any]], count: int) -> list[Any]:
    """``shapes``' items (shapes or tensors) in the optimizer's order, one a parameter."""
    if isinstance(shapes, Mapping):
        names = [name for group in groups for name in group.get("param_names", ())]
        if len(names) != count:
            raise ValueError(
                "a state dict of the model gives shapes by name, but these param groups carry no param_names (the "
                "optimizer was not built from named parameters): give a list of the shapes, in the optimizer's order"
            )
        if unknown := [name for name in names if name not in shapes]:
            raise ValueError(f"the model's state dict has no {unknown[:4]} (parameters the optimizer names)")
        return [shapes[name] for name in names]
    listed = list(shapes)
    if len(listed) != count:
        raise ValueError(f"{len(listed)} shapes given for the {count} parameters of the param groups")
    return listed


def _shape_of(item: Sequence[int] | Tensor) -> tuple[int, ...]:
    return tuple(item.shape) if isinstance(item, Tensor) else tuple(int(n) for n in item)


def _reshaped(value: Any, layout: tuple[tuple[int, ...], tuple[int, ...] | None] | None) -> Any:
    """A saved state tensor as ``torch.optim`` keeps it; distoptim 0.2's flat state reshaped by its layout's strides."""
    if not isinstance(value, Tensor) or value.dim() == 0 or layout is None or layout[1] is None:
        return value
    whole = torch.empty_strided(layout[0], layout[1], dtype=value.dtype)
    flat_view(whole).copy_(value)
    return whole


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distoptim checkpoint", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="the sharded (torch.distributed.checkpoint) checkpoint")
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--to-torch", type=Path, metavar="FILE", help="write its optimizer as a torch.optim dict")
    direction.add_argument("--from-torch", type=Path, metavar="FILE", help="write DIRECTORY from a torch.optim dict")
    parser.add_argument("--key", default="optim", help="where the optimizer is in the checkpoint (default: optim)")
    parser.add_argument("--params", type=Path, metavar="FILE", help="with --from-torch: the parameters' shapes")
    parser.add_argument("--state-format", choices=codecs.FORMATS, help="with --from-torch: the format to encode in")
    args = parser.parse_args(argv)
    for flag, value in (("--params", args.params), ("--state-format", args.state_format)):
        if value is not None and args.from_torch is None:
            parser.error(f"{flag} goes with --from-torch")
    try:
        if args.to_torch is not None:
            optim = dcp_to_torch_optim(args.directory, args.key)
            torch.save(optim, args.to_torch)
            print(f"wrote {args.to_torch}: torch.optim state dict, {_counts(optim)}; from key {args.key!r}")
        else:
            optim = torch.load(args.from_torch, weights_only=False)
            shapes = None if args.params is None else torch.load(args.params, weights_only=False)
            files = torch_optim_to_dcp(optim, args.directory, args.key, shapes, args.state_format)
            print(
                f"wrote {args.directory}: sharded checkpoint (torch.distributed.checkpoint, {files} data "
                f"file{'s' * (files != 1)}), {_counts(optim)}; under key {args.key!r}"
            )
    except (Exception, CheckpointException) as error:  # one line saying what is wrong, not a traceback
        cause = underlying_error(error)
        what = "" if isinstance(cause, (ValueError, OSError)) else f"{type(cause).__name__}: "
        print(f"python -m distoptim checkpoint: error: {what}{cause}", file=sys.stderr)
        return 1
    return 0


def _counts(optim: dict[str, Any]) -> str:
    """``12 parameters in 2 param groups, 30 state entries for 10 of them``."""
    groups = optim["param_groups"]
    params = sum(len(group["params"]) for group in groups)
    entries = sum(len(entry) for entry in optim["state"].values())
    return (
        f"{params} parameters in {len(groups)} param group{'s' * (len(groups) != 1)}, "
        f"{entries} state entries for {len(optim['state'])} of them"
    )
