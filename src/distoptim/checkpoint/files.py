"""``save`` and ``load``: crash-safe DCP checkpoints into a directory that appears only when complete."""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, overload

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from distoptim.checkpoint import checksums
from distoptim.checkpoint import dcp as _dcp
from distoptim.checkpoint import dcp_state as sharded
from distoptim.comm import agreement
from distoptim.comm import collectives as comm
from distoptim.comm.groups import attached, backends_of, gloo_twin

__all__ = ["load", "save"]

METADATA = ".metadata"  # DCP's index, written by its coordinator after every rank's data: its presence = complete


def _pending() -> list[Future[None]]:
    """The latest asynchronous save, kept with the default group (as its gloo group is)."""
    return attached(comm.default_group(None), "pending asynchronous save", list)


@overload
def save(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: comm.Group | None = None,
    async_save: Literal[False] = False,
) -> None: ...


@overload
def save(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: comm.Group | None = None,
    async_save: Literal[True],
) -> Future[None]: ...


def save(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: comm.Group | None = None,
    async_save: bool = False,
) -> Future[None] | None:
    """Save ``state_dict`` (every rank its own shard) to the directory ``path``, replacing any checkpoint there only
    once the new one is complete (collective).

    Args:
        state_dict: any dict DCP takes; ``Stateful`` values are saved by their state dicts.
        path: the checkpoint's directory, on a file system every rank sees.
        process_group: the ranks saving together; default None: the default group (a gloo twin with ``async_save``).
        async_save: write from a CPU copy in a background thread and return a ``Future`` (default False: write now).

    Raises:
        ValueError: on every rank when the save failed on any (``async_save``: the future raises it); the old one stays.

    Example:
        ```python
        checkpoint.save({"model": model.state_dict(), "optim": zero.sharded_state_dict()}, "ckpt/step-100")
        pending = checkpoint.save(state, "ckpt/step-200", async_save=True)   # training goes on
        pending.result()                                                      # before the next save, or exit
        ```
    """
    _wait_for_pending_save()
    group = _async_group(process_group) if async_save else comm.default_group(process_group)
    final = Path(path)
    _on_leader(group, "preparing the checkpoint directory", lambda: _fresh(_sibling(final, "partial")))
    state = _stateful_to_state_dict(state_dict)
    if not async_save:
        _write(state, final, group)
        return None
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="distoptim-checkpoint")
    _pending()[:] = [writer.submit(_write, _staged(state), final, group)]
    writer.shutdown(wait=False)  # its thread ends with the save: one save at a time, each waiting for the last
    return _pending()[0]


def _wait_for_pending_save() -> None:
    """Block until the latest asynchronous save has finished; warn (once) if it failed."""
    pending = _pending()
    error = pending.pop().exception() if pending else None
    if error is not None:
        warnings.warn(f"an earlier asynchronous checkpoint save failed: {type(error).__name__}: {error}", stacklevel=3)


def _write(state: dict[str, Any], final: Path, group: comm.Group) -> None:
    """Write ``state`` into ``final``'s partial sibling, then rename it into place (on rank 0, after every rank)."""
    partial, previous = _sibling(final, "partial"), _sibling(final, "previous")
    _dcp.save(state, partial, group)
    _on_leader(group, f"moving the finished checkpoint into {final}", lambda: _replace(partial, final, previous))


def _async_group(process_group: comm.Group | None) -> comm.Group:
    """The group an asynchronous save coordinates over: ``process_group``, or a gloo twin of the default group."""
    if process_group is not None:
        group = comm.default_group(process_group)
        if "cpu" not in backends_of(group):
            raise ValueError(
                "save(async_save=True) coordinates its ranks from a background thread and needs a group with a CPU "
                "backend that nothing else uses meanwhile: pass process_group=dist.new_group(backend='gloo'), or "
                "leave process_group unset for one made for it"
            )
        return group
    return gloo_twin(comm.default_group(None), "async_checkpoint")


def _staged(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``state`` on the CPU, made by DCP's stager as ``dcp.async_save`` makes it."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(False, False, False, False))  # plain copies, in this thread
    try:
        return stager.stage(state)  # type: ignore[return-value]
    finally:
        stager.close()


def load(state_dict: dict[str, Any], path: str | os.PathLike[str], *, process_group: comm.Group | None = None) -> None:
    """Load the checkpoint at ``path`` into ``state_dict`` in place (collective), as ``dcp.load`` does; then call
    ``zero.load_sharded_state_dict(state_dict[...])`` for each optimizer in it.

    Args:
        state_dict: what to load, laid out as saved (at any world size and partition); filled in place.
        path: the checkpoint's directory.
        process_group: the ranks loading together; default None: the default group.

    Raises:
        ValueError: on every rank, for an incomplete or damaged checkpoint, or one of another model or optimizer.

    Example:
        ```python
        state = {"model": model.state_dict(), "optim": zero.sharded_state_dict()}
        checkpoint.load(state, "ckpt/step-100")
        model.load_state_dict(state["model"])
        zero.load_sharded_state_dict(state["optim"])
        ```
    """
    _wait_for_pending_save()
    group, final = comm.default_group(process_group), Path(path)
    state = _stateful_to_state_dict(state_dict)
    what = f"loading the checkpoint at {final}"
    checked = agreement.run_agreed(lambda: _checked_source(state, final), group, what, errors=(BaseException,))
    _dcp.load(state, *checked, group)
    for key, value in state_dict.items():
        if isinstance(value, Stateful):
            value.load_state_dict(state[key])
        else:
            state_dict[key] = state[key]


def _stateful_to_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    return {key: value.state_dict() if isinstance(value, Stateful) else value for key, value in state_dict.items()}


def _checked_source(
    state_dict: dict[str, Any], final: Path
) -> tuple[Path, Metadata, dict[str, checksums.Entry] | None]:
    """The checkpoint for ``final`` (or the one a save died replacing), checked complete, undamaged and holding
    each entry ``state_dict`` asks for in its shape; its index as checked (the load reads no other) and manifest."""
    source = final
    if not final.exists() and _complete(_sibling(final, "previous")):  # a save died between its two renames
        source = _sibling(final, "previous")
        warnings.warn(f"{final} is missing (a save was interrupted while replacing it): loading {source}", stacklevel=5)
    if not _complete(source):
        if _sibling(final, "partial").exists():
            raise ValueError(
                f"{final} is not a complete checkpoint: a save into it did not finish (its partial files are in "
                f"{_sibling(final, 'partial')}); load an earlier checkpoint"
            )
        if final.is_dir():
            raise ValueError(
                f"{final} is not a checkpoint: it has no {METADATA} (written by another tool, or partially)"
            )
        raise ValueError(f"no checkpoint at {final}: the directory does not exist")
    manifest = checksums.read_manifest(source)
    if manifest is None:
        warnings.warn(
            f"the checkpoint at {source} has no {checksums.MANIFEST} (it was written by dcp.save or an older "
            "distoptim): its files cannot be checked for damage; save it again with distoptim.checkpoint.save",
            stacklevel=5,
        )
    metadata = _dcp.read_metadata(source)
    saved = set(metadata.state_dict_metadata)
    leaves = dict(_leaves(state_dict, "", saved))
    if missing := sorted(set(leaves) - saved):
        raise ValueError(
            f"the checkpoint at {final} lacks {len(missing)} of the entries asked for, e.g. {missing[:4]}: it was "
            "saved from another model or optimizer (check the keys, the optimizer class and its settings)"
        )
    for key, value in leaves.items():
        stored = metadata.state_dict_metadata[key]
        if not isinstance(value, torch.Tensor) or not isinstance(stored, TensorStorageMetadata):
            continue
        if value.shape == stored.size:
            continue
        hint = "it was saved from another model or with other parameters (check the model's configuration)"
        if len(stored.size) == 1 and value.dim() > 1 and stored.size.numel() == value.numel():
            hint = (
                "it was saved by distoptim 0.2, which kept parameter-shaped optimizer state flat: convert it with "
                "'python -m distoptim checkpoint DIR --to-torch optim.pt' and load that with load_state_dict"
            )
        raise ValueError(
            f"the checkpoint at {final} holds {key} with shape {tuple(stored.size)}, but the state to load has shape "
            f"{tuple(value.shape)}: {hint}"
        )
    return source, metadata, manifest


def _sibling(path: Path, role: str) -> Path:
    return path.with_name(f".{path.name}.{role}")


def _fresh(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    directory.parent.mkdir(parents=True, exist_ok=True)


def _replace(partial: Path, final: Path, previous: Path) -> None:
    """Move ``partial`` to ``final``; an older checkpoint there is parked at ``previous`` until the move is done."""
    if not _complete(partial) or not (partial / checksums.MANIFEST).is_file():
        raise RuntimeError(f"the save finished without writing {partial / METADATA} and {checksums.MANIFEST}")
    if not final.exists() and _complete(previous):  # an earlier save died between the renames: restore it first
        previous.rename(final)
    shutil.rmtree(previous, ignore_errors=True)
    if final.exists():
        final.rename(previous)
    partial.rename(final)
    shutil.rmtree(previous, ignore_errors=True)


def _on_leader(group: comm.Group, what: str, action: Callable[[], None]) -> None:
    """Run ``action`` on rank 0; every rank raises if it failed, and none returns before it is done."""
    leader = comm.group_rank(group) == 0
    agreement.run_agreed(action if leader else lambda: None, group, what, errors=(BaseException,))


def _complete(directory: Path) -> bool:
    return (directory / METADATA).is_file()


def _leaves(state: Mapping[str, Any], prefix: str, saved: set[str]) -> Iterator[tuple[str, Any]]:
    """The entries of nested dicts under the keys DCP gives them (lists that hold tensors are DCP's to check), each
    sharded optimizer state pruned first of what a checkpoint of keys ``saved`` cannot have (``prune_unsaved``)."""
    for key, value in state.items():
        if sharded.is_sharded_state(value):
            sharded.prune_unsaved(value, f"{prefix}{key}.", saved)
        if isinstance(value, Mapping):
            yield from _leaves(value, f"{prefix}{key}.", saved)
        elif not isinstance(value, (list, tuple)):
            yield f"{prefix}{key}", value
