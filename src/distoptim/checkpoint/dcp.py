"""``torch.distributed.checkpoint``'s save and load (DCP's planner and files) coordinated over distoptim's own
collectives, so that a failure raises an ordinary exception on every rank. ``docs/guides/internals.md``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata

from distoptim.checkpoint import checksums
from distoptim.comm import agreement
from distoptim.comm import collectives as comm

__all__ = ["check_files", "load", "read_metadata", "save", "underlying_error"]

_T = TypeVar("_T")
_COORDINATOR = 0


def save(state_dict: dict[str, Any], directory: Path, group: comm.Group) -> None:
    """Write ``state_dict`` (this rank's part of it) into ``directory`` as ``dcp.save`` does (collective)."""
    writer, planner = dcp.FileSystemWriter(str(directory)), DefaultSavePlanner()
    rank, what = comm.group_rank(group), f"saving the checkpoint into {directory}"
    leader = rank == _COORDINATOR

    def local_plan() -> Any:
        planner.set_up_planner(state_dict=state_dict, storage_meta=writer.storage_meta(), is_coordinator=leader)
        writer.set_up_storage_writer(leader, rank=rank, use_collectives=True)
        return writer.prepare_local_plan(planner.create_local_plan())

    def global_plan(plans: list[Any]) -> tuple[list[Any], Metadata]:
        plans, metadata = planner.create_global_plan(plans)
        return writer.prepare_global_plan(plans), metadata

    plan, metadata = _planned(local_plan, global_plan, group, what)

    def write() -> tuple[Any, dict[str, checksums.Entry]]:
        results = writer.write_data(planner.finish_plan(plan), planner).wait()
        return results, checksums.checksums(directory, [result.storage_data.relative_path for result in results])

    everyone = _gathered(agreement.run_agreed(write, group, what), group)

    def finish() -> None:
        if everyone is not None and metadata is not None:  # on the coordinator: the manifest last, once complete
            writer.finish(metadata=metadata, results=[results for results, _ in everyone])
            checksums.write_manifest(directory, {name: entry for _, mine in everyone for name, entry in mine.items()})

    agreement.run_agreed(finish, group, what)


def load(
    state_dict: dict[str, Any],
    directory: Path,
    metadata: Metadata,
    manifest: dict[str, checksums.Entry] | None,
    group: comm.Group,
) -> None:
    """Fill ``state_dict`` in place from ``directory``, whose ``metadata`` was read and checked, as ``dcp.load`` does
    (collective); any failure is a ``ValueError`` on every rank, a damaged file's before anything is loaded."""
    reader, planner = dcp.FileSystemReader(str(directory)), DefaultLoadPlanner()
    rank, what = comm.group_rank(group), f"loading the checkpoint at {directory}"

    def local_plan() -> Any:
        planner.set_up_planner(state_dict, metadata, rank == _COORDINATOR)
        reader.set_up_storage_reader(metadata, rank == _COORDINATOR, rank=rank, use_collectives=True)
        return reader.prepare_local_plan(planner.create_local_plan())

    global_plan = lambda plans: (reader.prepare_global_plan(planner.create_global_plan(plans)), None)
    plan, _ = _planned(_as_value_error(local_plan, what), _as_value_error(global_plan, what), group, what)

    def checked_plan() -> Any:
        final = planner.finish_plan(plan)
        assert metadata.storage_data is not None
        check_files(directory, [metadata.storage_data[item.storage_index] for item in final.items], manifest)
        return final

    final = agreement.run_agreed(_as_value_error(checked_plan, what), group, what)  # before anything is read
    agreement.run_agreed(_as_value_error(lambda: reader.read_data(final, planner).wait(), what), group, what)


def _planned(
    local_plan: Callable[[], Any],
    global_plan: Callable[[list[Any]], tuple[list[Any], _T]],
    group: comm.Group,
    what: str,
) -> tuple[Any, _T | None]:
    """Each rank's part of the global plan the coordinator makes from every rank's; its extra there (else None)."""
    plans = _gathered(agreement.run_agreed(local_plan, group, what), group)
    coordinated = agreement.run_agreed(lambda: None if plans is None else global_plan(plans), group, what)
    if coordinated is None:
        return comm.receive_object(_COORDINATOR, group), None
    everyone, extra = coordinated
    for rank in range(1, comm.group_size(group)):
        comm.send_object(everyone[rank], rank, group)
    return everyone[_COORDINATOR], extra


def _gathered(mine: Any, group: comm.Group) -> list[Any] | None:
    """Every rank's ``mine`` on the coordinator, in rank order (None elsewhere)."""
    if comm.group_rank(group) != _COORDINATOR:
        comm.send_object(mine, _COORDINATOR, group)
        return None
    ranks = range(comm.group_size(group))
    return [mine if rank == _COORDINATOR else comm.receive_object(rank, group) for rank in ranks]


def _as_value_error(action: Callable[..., _T], what: str) -> Callable[..., _T]:
    """``action`` raising a ``ValueError`` that names its cause, whatever DCP raised."""

    def run(*args: Any) -> _T:
        try:
            return action(*args)
        except Exception as error:
            cause = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
            raise ValueError(f"{what} failed: {cause}") from error

    return run


def read_metadata(directory: Path) -> Metadata:
    try:
        return dcp.FileSystemReader(str(directory)).read_metadata()
    except Exception as error:
        raise ValueError(
            f"{directory / '.metadata'} cannot be read ({type(error).__name__}: {error}): the checkpoint is damaged; "
            "load another one"
        ) from error


def check_files(directory: Path, storage: Iterable[Any], manifest: dict[str, checksums.Entry] | None) -> None:
    """Every data file that ``storage`` (DCP's ``_StorageInfo`` entries: file, offset, length) names exists, holds
    the bytes the entries say it does and, with a ``manifest``, the bytes saved (``checksums.verify``)."""
    needed: dict[str, int] = {}
    for info in storage:
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    checksums.verify(directory, needed, manifest)


def underlying_error(error: BaseException) -> BaseException:
    """What a rank raised inside DCP, for DCP's ``CheckpointException`` (which wraps it); ``error`` itself else."""
    if isinstance(error, CheckpointException) and error.failures:
        cause, _ = next(iter(error.failures.values()))
        return cause
    return error
