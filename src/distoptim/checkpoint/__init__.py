"""Crash-safe sharded checkpoints: ``torch.distributed.checkpoint`` into a directory that appears only when complete.

``save(state, path)`` has every rank write its own shard (DCP) into a hidden sibling, ``.<name>.partial``, and
rank 0 renames it to ``path`` once every rank has finished, so a save that dies half way (a rank killed, a full
disk) leaves the previous checkpoint at ``path`` untouched. ``load(state, path)`` checks first, on every rank, that
``path`` is a complete checkpoint holding what ``state`` asks for in the shapes it asks for, and that every data
file it will read is there and unchanged since the save (its size and CRC-32 as the manifest that the save wrote
last records), and raises one ``ValueError`` everywhere otherwise, naming the file (never a hang, never a partial
load). A checkpoint without a manifest (``dcp.save``'s, an older distoptim's) loads with a warning that it cannot be
checked. A save that dies between moving the old checkpoint aside and the new one into place leaves the old one
complete beside ``path``: ``load`` then loads it (with a warning), and the next save puts it back first. ``path``
must be on a file system that every rank sees (as DCP needs for a load at another world size).

``save(..., async_save=True)`` copies the state to the CPU (DCP's staging) and returns a future at once; a thread
writes the copy and renames it into place, and the future completes when the checkpoint is at ``path`` (or fails,
with the error). It runs its collectives on a process group of its own, so training goes on meanwhile; a later
``save`` or ``load`` first waits for it. The files are DCP's, written and read by DCP's planner and storage
classes; the ranks coordinate over distoptim's collectives (``dcp``), which need no numpy and turn any failure
into one ordinary exception on every rank (``ValueError`` for a load).

The state is any dict DCP takes: ``{"model": model.state_dict(), "optim": zero.sharded_state_dict()}``. A
``ZeroRedundancyOptimizer``'s entries that a checkpoint cannot have (the state of a parameter that never had a
gradient before the save, master weights of a run without them) are dropped from the request, and
``load_sharded_state_dict`` starts those afresh, as a plain ``torch.optim`` load would.

The package: ``files`` (``save``/``load``), ``dcp`` (DCP's save and load coordinated over distoptim's collectives),
``dcp_state`` (a ``ZeroRedundancyOptimizer``'s layout-independent DCP state dict, with ``boxes``: which elements
of each parameter a rank holds), ``consolidated`` (``torch.optim``'s format gathered on one rank) and ``convert``
(between the two formats, ``python -m distoptim checkpoint``), with ``checksums`` (the manifest of every
file's size and CRC-32 that a save writes last and a load checks first). It may import ``comm`` and ``zero``'s
partition, shard, elementwise and local_optimizer (the group class key) modules; ``zero`` imports ``consolidated``
and ``dcp_state``.
"""

from distoptim.checkpoint.files import load, save

__all__ = ["load", "save"]
