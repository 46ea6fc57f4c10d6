"""A rank killed while a checkpoint is being written: the previous checkpoint still loads, in new processes, and
training continues from it bit-exactly (the same bits as a run that never stopped).

- Consolidated (``consolidate_state_dict(to=0)`` then ``torch.save`` on rank 0): rank 0 dies half-way through the
  file. ``_training.atomic_save`` writes a temporary sibling and ``os.replace``s it over the old file only when
  complete, so the old file is untouched; the half-written temporary file does not load (without the rename it
  would have been the checkpoint).
- Sharded (``distoptim.checkpoint.save`` / ``load``, atomic by contract: a temporary sibling directory renamed into
  place once every rank has finished): a rank dies after writing its part, or rank 0 dies at one of the renames.
  ``load(path)`` then gives a complete checkpoint (the previous one when the kill came before the new one was
  moved), and refuses an incomplete leftover and a foreign directory with the same ``ValueError`` on every rank.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from tests._dist import run_on_ranks
from tests.faults import _training
from tests.faults._launcher import die, run_with_faults
from tests.faults._training import MODES, build, load, parameters, save, train
from tests.faults.test_peer_death import PEER_GONE, RAISE_WITHIN_S, assert_survivors_raised

# 2 ranks: at 3, DDP's first iteration after a restart reduces with its initial bucket layout, which on gloo can
# differ in the last bits from the rebuilt layout the uninterrupted run uses (plain torch.optim too; docs: errors)
WORLD_SIZE = 2
PREVIOUS, KILLED, LAST = 4, 6, 8  # steps: the complete checkpoint, the one being written when a rank dies, the end
DIES_AFTER_BYTES = 4096  # the consolidated checkpoint is about 30 kB


class _DyingFile(io.FileIO):
    """A file that SIGKILLs its process once ``DIES_AFTER_BYTES`` have reached the disk."""

    def write(self, data: Any) -> int:
        written = super().write(data)
        if self.tell() >= DIES_AFTER_BYTES:
            os.fsync(self.fileno())
            die()
        return written


def _consolidated_kill_body(rank: int, world_size: int, path: str) -> None:
    run = build(MODES["consolidated"])
    train(run, rank, range(PREVIOUS))
    save(run, path)
    train(run, rank, range(PREVIOUS, KILLED))
    if rank == 0:  # the only writer; the others wait for it in save()'s barrier
        mock.patch.object(_training, "open", lambda name, mode: _DyingFile(name, mode), create=True).start()
    save(run, path)


def _resume_body(
    rank: int, world_size: int, mode: str, path: str, accept: tuple[int, ...], refuse: tuple[str, ...] = ()
) -> list[str]:
    """Load ``path`` in fresh ranks: it must hold the run at one of the steps ``accept``; train on to ``LAST`` and
    compare with a run that never stopped. ``load`` must refuse each directory in ``refuse`` with a ``ValueError``
    naming it; the messages come back."""
    straight = build(MODES[mode])
    at: dict[int, list[torch.Tensor]] = {}
    for step in range(LAST):
        train(straight, rank, range(step, step + 1))
        at[step + 1] = parameters(straight)
    resumed = build(MODES[mode])
    load(resumed, path)
    loaded = parameters(resumed)
    matches = [step for step in accept if all(torch.equal(a, b) for a, b in zip(loaded, at[step]))]
    assert matches, f"the checkpoint at {path} holds none of the runs at steps {accept}"
    train(resumed, rank, range(matches[0], LAST))
    for index, (got, want) in enumerate(zip(parameters(resumed), at[LAST])):
        assert torch.equal(got, want), f"parameter {index} differs after resuming from step {matches[0]}"
    messages = []
    for directory in refuse:
        with pytest.raises(ValueError, match=re.escape(os.path.basename(directory))) as refused:
            load(build(MODES[mode]), directory)
        messages.append(str(refused.value))
    return messages


def test_consolidated_checkpoint_survives_a_kill_while_writing(tmp_path: Path) -> None:
    path = str(tmp_path / "checkpoint.pt")
    outcomes = run_with_faults(_consolidated_kill_body, WORLD_SIZE, path, timeout=45, group_timeout=60)
    assert_survivors_raised(outcomes, 0, PEER_GONE, RAISE_WITHIN_S)
    partial = f"{path}.tmp"
    assert 0 < os.path.getsize(partial) < os.path.getsize(path), "rank 0 did not die half-way through the file"
    with pytest.raises((RuntimeError, OSError)):  # what a plain torch.save(..., path) would have left as the checkpoint
        torch.load(partial, weights_only=True)
    run_on_ranks(_resume_body, WORLD_SIZE, "consolidated", path, (PREVIOUS,), timeout=90)


# ------------------------------------------------------------------------------------------------------- sharded
def _arm_sharded_kill(rank: int, where: str, path: str) -> None:
    """``write``: rank 1 dies once its own data is on disk, before the checkpoint is complete. ``park`` / ``swap``:
    rank 0 (which renames) dies at the rename that moves the old checkpoint away from ``path`` / the new one to it."""
    if where == "write" and rank == 1:
        from torch.distributed.checkpoint.filesystem import _FileSystemWriter

        real_write = _FileSystemWriter.write_data

        def write_then_die(self: Any, *args: Any, **kwargs: Any) -> Any:
            written = real_write(self, *args, **kwargs)
            written.wait()
            die()

        mock.patch.object(_FileSystemWriter, "write_data", write_then_die).start()
    if where in ("park", "swap") and rank == 0:
        target, argument = os.path.realpath(path), 0 if where == "park" else 1
        for name in ("rename", "replace"):
            real = getattr(os, name)

            def rename_or_die(*args: Any, real: Any = real, **kwargs: Any) -> Any:
                if os.path.realpath(args[argument]) == target:
                    die()
                return real(*args, **kwargs)

            mock.patch.object(os, name, rename_or_die).start()


def _sharded_kill_body(rank: int, world_size: int, path: str, where: str) -> None:
    run = build(MODES["even"])
    train(run, rank, range(PREVIOUS))
    save(run, path)  # distoptim.checkpoint.save
    train(run, rank, range(PREVIOUS, KILLED))
    _arm_sharded_kill(rank, where, path)
    save(run, path)


SHARDED_KILLS = [
    pytest.param("write", 1, (PREVIOUS,), id="write"),
    pytest.param("park", 0, (PREVIOUS,), id="park"),
    pytest.param("swap", 0, (PREVIOUS,), id="swap"),  # the old checkpoint, parked beside the path, still loads
]


@pytest.mark.parametrize(("where", "victim", "accept"), SHARDED_KILLS)
def test_sharded_checkpoint_survives_a_kill_while_writing(
    tmp_path: Path, where: str, victim: int, accept: tuple[int, ...]
) -> None:
    path = str(tmp_path / "checkpoint")
    outcomes = run_with_faults(_sharded_kill_body, WORLD_SIZE, path, where, timeout=45, group_timeout=60)
    assert_survivors_raised(outcomes, victim, PEER_GONE, RAISE_WITHIN_S)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a checkpoint")
    incomplete = tuple(str(d) for d in sorted(tmp_path.iterdir()) if d.is_dir() and not (d / ".metadata").exists())
    assert (where == "write") == (len(incomplete) == 2), incomplete  # the write kill leaves a partial directory
    messages = run_on_ranks(_resume_body, WORLD_SIZE, "even", path, accept, incomplete, timeout=90)
    assert messages[0] == messages[1]  # one verdict, on every rank
