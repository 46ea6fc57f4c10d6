"""Between the two checkpoint formats, offline, on one process: a sharded DCP checkpoint's optimizer part and
``torch.optim``'s state dict (which plain optimizers, ``load_state_dict`` and torch's ZeroRedundancyOptimizer use).

``python -m distoptim checkpoint DIR --to-torch optim.pt`` writes the ``torch.optim`` dict of the optimizer saved
under ``--key`` (default ``optim``) in DIR; ``python -m distoptim checkpoint DIR --from-torch optim.pt`` writes a
sharded checkpoint DIR from one. Conversion holds the whole state in memory: it is for leaving and joining the
format, not for training.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from distoptim._flat import flat_view
from distoptim.checkpoint import checksums
from distoptim.checkpoint.dcp import check_files, read_metadata, underlying_error
from distoptim.checkpoint.dcp_state import LAYOUTS, PARAM_GROUPS

__all__ = ["dcp_to_torch_optim", "main", "torch_optim_to_dcp"]


def dcp_to_torch_optim(directory: str | Path, key: str = "optim") -> dict[str, Any]:
    """The ``torch.optim`` state dict of the optimizer saved under ``key`` in a sharded checkpoint."""
    if not (Path(directory) / ".metadata").is_file():
        raise ValueError(f"{directory} is not a torch.distributed.checkpoint directory (it has no .metadata)")
    manifest = checksums.read_manifest(Path(directory))
    if manifest is None:
        print(
            f"warning: {directory} has no {checksums.MANIFEST}: its files cannot be checked for damage", file=sys.stderr
        )
    else:
        checksums.verify(Path(directory), [".metadata"], manifest)
    metadata = read_metadata(Path(directory))
    storage = (metadata.storage_data or {}).values()
    check_files(Path(directory), storage)
    if manifest is not None:
        checksums.verify(Path(directory), [info.relative_path for info in storage], manifest)
    with _scratch() as scratch:
        try:
            dcp_to_torch_save(str(directory), scratch)
        except (Exception, CheckpointException) as error:  # DCP's CheckpointException is a BaseException
            cause = underlying_error(error)
            raise ValueError(f"{directory} cannot be read: {type(cause).__name__}: {cause}") from cause
        flat: dict[str, Any] = torch.load(scratch, weights_only=False)
    saved = flat.get(key)
    if not isinstance(saved, dict) or PARAM_GROUPS not in saved:
        keys = sorted(flat)
        raise ValueError(f"{directory} holds no distoptim optimizer under {key!r} (its keys: {keys[:8]}); pass --key")
    layouts = pickle.loads(saved[LAYOUTS])
    state: dict[int, dict[str, Any]] = {}
    for name, value in saved.items():
        if name.startswith("state."):
            index, _, entry = name.removeprefix("state.").partition(".")
            state.setdefault(int(index), {})[entry] = _reshaped(value, layouts[int(index)])
    return {"state": dict(sorted(state.items())), "param_groups": pickle.loads(saved[PARAM_GROUPS])}


def torch_optim_to_dcp(state_dict: dict[str, Any], directory: str | Path, key: str = "optim") -> None:
    """Write ``state_dict`` (``torch.optim``'s format) as a sharded checkpoint that ``load_sharded_state_dict`` takes.

    State tensors are saved as they are (parameter-shaped ones by their logical indices, as ZeRO saves them: the
    memory layout does not matter).
    """
    count = sum(len(group["params"]) for group in state_dict["param_groups"])
    layouts: list[tuple[tuple[int, ...], None] | None] = [None] * count  # None: unknown (no state)
    payload: dict[str, Any] = {PARAM_GROUPS: pickle.dumps(state_dict["param_groups"])}
    for index, entry in sorted(state_dict["state"].items()):
        for name, value in entry.items():
            if isinstance(value, Tensor) and value.dim() > 0:
                layouts[index] = (tuple(value.shape), None)
            payload[f"state.{index}.{name}"] = value
    payload[LAYOUTS] = pickle.dumps(layouts)
    dcp.save({key: payload}, storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)
    written = (dcp.FileSystemReader(str(directory)).read_metadata().storage_data or {}).values()
    checksums.write_manifest(Path(directory), checksums.checksums(Path(directory), [w.relative_path for w in written]))


def _reshaped(value: Any, layout: tuple[tuple[int, ...], tuple[int, ...] | None] | None) -> Any:
    """A saved state tensor as ``torch.optim`` keeps it: as saved, or, from a checkpoint of distoptim 0.2 (whose
    layouts carry strides: it saved parameter-shaped state flat, in memory order), reshaped by them."""
    if not isinstance(value, Tensor) or value.dim() == 0 or layout is None or layout[1] is None:
        return value
    whole = torch.empty_strided(layout[0], layout[1], dtype=value.dtype)
    flat_view(whole).copy_(value)
    return whole


class _scratch:
    """A temporary file path, removed afterwards."""

    def __enter__(self) -> str:
        import tempfile

        self.directory = tempfile.TemporaryDirectory()
        return str(Path(self.directory.name) / "flat.pt")

    def __exit__(self, *exc: object) -> None:
        self.directory.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distoptim checkpoint", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="the sharded (torch.distributed.checkpoint) checkpoint")
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--to-torch", type=Path, metavar="FILE", help="write its optimizer as a torch.optim dict")
    direction.add_argument("--from-torch", type=Path, metavar="FILE", help="write DIRECTORY from a torch.optim dict")
    parser.add_argument("--key", default="optim", help="where the optimizer is in the checkpoint (default: optim)")
    args = parser.parse_args(argv)
    try:
        if args.to_torch is not None:
            torch.save(dcp_to_torch_optim(args.directory, args.key), args.to_torch)
        else:
            torch_optim_to_dcp(torch.load(args.from_torch, weights_only=False), args.directory, args.key)
    except (Exception, CheckpointException) as error:  # one line saying what is wrong, not a traceback
        cause = underlying_error(error)
        what = "" if isinstance(cause, (ValueError, OSError)) else f"{type(cause).__name__}: "
        print(f"python -m distoptim checkpoint: error: {what}{cause}", file=sys.stderr)
        return 1
    return 0
