"""Crash-safe sharded checkpoints: ``torch.distributed.checkpoint`` into a directory that appears only when complete.

``save(state, path)`` has every rank write its own shard (DCP) into a hidden sibling, ``.<name>.partial``, and
rank 0 renames it to ``path`` once every rank has finished, so a save that dies half way (a rank killed, a full
disk) leaves the previous checkpoint at ``path`` untouched. ``load(state, path)`` checks first, on every rank, that
``path`` is a complete checkpoint holding what ``state`` asks for, and raises one clear error everywhere otherwise
(never a hang, never a partial load). A save that dies between moving the old checkpoint aside and the new one into
place leaves the old one complete beside ``path``: ``load`` then loads it (with a warning), and the next save puts
it back first. ``path`` must be on a file system that every rank sees (as DCP needs for a
load at another world size).

The state is any dict DCP takes: ``{"model": model.state_dict(), "optim": zero.sharded_state_dict()}``. A
``ZeroRedundancyOptimizer``'s entries that a checkpoint cannot have (the state of a parameter that never had a
gradient before the save, master weights of a run without them) are dropped from the request, and
``load_sharded_state_dict`` starts those afresh, as a plain ``torch.optim`` load would.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

from distoptim import _agreement as agreement
from distoptim.zero import comm, sharded

__all__ = ["load", "save"]

METADATA = ".metadata"  # DCP's index, written by its coordinator after every rank's data: its presence = complete


def save(state_dict: dict[str, Any], path: str | os.PathLike[str], *, process_group: comm.Group | None = None) -> None:
    """Save ``state_dict`` (every rank its own shard) to the directory ``path``, replacing any checkpoint there only
    once the new one is complete (collective)."""
    group = comm.default_group(process_group)
    final = Path(path)
    partial, previous = _sibling(final, "partial"), _sibling(final, "previous")
    leader = comm.group_rank(group) == 0
    _on_leader(leader, group, "preparing the checkpoint directory", lambda: _fresh(partial))
    dcp.save(state_dict, checkpoint_id=partial, process_group=group)
    replace = lambda: _replace(partial, final, previous)
    _on_leader(leader, group, f"moving the finished checkpoint into {final}", replace)


def load(state_dict: dict[str, Any], path: str | os.PathLike[str], *, process_group: comm.Group | None = None) -> None:
    """Load the checkpoint at ``path`` into ``state_dict`` in place (collective), as ``dcp.load`` does; then call
    ``zero.load_sharded_state_dict(state_dict[...])`` for each optimizer in it. A directory that is not a complete
    checkpoint, or lacks something ``state_dict`` asks for, raises a ``ValueError`` on every rank."""
    group, final = comm.default_group(process_group), Path(path)
    check = lambda: _checked_source(state_dict, final)
    source = agreement.run_agreed(check, group, f"loading the checkpoint at {final}", errors=(BaseException,))
    dcp.load(state_dict, checkpoint_id=source, process_group=group)


def _checked_source(state_dict: dict[str, Any], final: Path) -> Path:
    """Where the checkpoint for ``final`` is (``final``, or the previous one a save died replacing), once it is known
    to be complete and to hold every entry ``state_dict`` asks for (entries it cannot have pruned first)."""
    source = final
    if not final.exists() and _complete(_sibling(final, "previous")):  # a save died between its two renames
        source = _sibling(final, "previous")
        warnings.warn(f"{final} is missing (a save was interrupted while replacing it): loading {source}", stacklevel=5)
    if not _complete(source):
        raise ValueError(_incomplete_message(final))
    saved = set(dcp.FileSystemReader(source).read_metadata().state_dict_metadata)
    _prune_unsaved_optimizer_state(state_dict, "", saved)
    missing = sorted(set(_leaf_keys(state_dict, "")) - saved)
    if missing:
        raise ValueError(
            f"the checkpoint at {final} lacks {len(missing)} of the entries asked for, e.g. {missing[:4]}: it was "
            "saved from another model or optimizer (check the keys, the optimizer class and its settings)"
        )
    return source


def _sibling(path: Path, role: str) -> Path:
    return path.with_name(f".{path.name}.{role}")


def _fresh(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    directory.parent.mkdir(parents=True, exist_ok=True)


def _replace(partial: Path, final: Path, previous: Path) -> None:
    """Move ``partial`` to ``final``; an older checkpoint there is parked at ``previous`` until the move is done."""
    if not _complete(partial):
        raise RuntimeError(f"the save finished without writing {partial / METADATA}")
    if not final.exists() and _complete(previous):  # an earlier save died between the renames: restore it first
        previous.rename(final)
    shutil.rmtree(previous, ignore_errors=True)
    if final.exists():
        final.rename(previous)
    partial.rename(final)
    shutil.rmtree(previous, ignore_errors=True)


def _on_leader(leader: bool, group: comm.Group, what: str, action: Callable[[], None]) -> None:
    """Run ``action`` on rank 0; every rank raises if it failed, and none returns before it is done."""
    agreement.run_agreed(action if leader else lambda: None, group, what, errors=(BaseException,))


def _complete(directory: Path) -> bool:
    return (directory / METADATA).is_file()


def _incomplete_message(final: Path) -> str:
    if _sibling(final, "partial").exists():
        return (
            f"{final} is not a complete checkpoint: a save into it did not finish (its partial files are in "
            f"{_sibling(final, 'partial')}); load an earlier checkpoint"
        )
    if final.is_dir():
        return f"{final} is not a checkpoint: it has no {METADATA} (written by another tool, or partially)"
    return f"no checkpoint at {final}: the directory does not exist"


def _prune_unsaved_optimizer_state(state: Mapping[str, Any], prefix: str, saved: set[str]) -> None:
    for key, value in state.items():
        if sharded.is_sharded_state(value):
            sharded.prune_unsaved(value, f"{prefix}{key}.", saved)
        elif isinstance(value, Mapping):
            _prune_unsaved_optimizer_state(value, f"{prefix}{key}.", saved)


def _leaf_keys(state: Mapping[str, Any], prefix: str) -> Iterator[str]:
    """The keys DCP gives the entries of nested dicts (lists that hold tensors are DCP's to check)."""
    for key, value in state.items():
        if isinstance(value, Mapping):
            yield from _leaf_keys(value, f"{prefix}{key}.")
        elif not isinstance(value, (list, tuple)):
            yield f"{prefix}{key}"
