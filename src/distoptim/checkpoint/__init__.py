"""Crash-safe sharded checkpoints: ``torch.distributed.checkpoint`` into a directory that appears only when complete.

``save(state, path)``: every rank writes its shard (DCP) into a hidden sibling that rank 0 renames to ``path`` once
all have finished, with a manifest (each file's size and CRC-32) written last; ``async_save=True`` returns a future.
``load(state, path)`` checks the manifest, the keys and the shapes on every rank first and raises one ``ValueError``
everywhere otherwise (never a hang, never a partial load). The contract, recovery and formats:
``docs/guides/checkpoints.md``.

Modules: ``files`` (save/load), ``dcp`` (DCP coordinated over distoptim's collectives), ``dcp_state`` and ``boxes``
(the optimizer's layout-independent state), ``consolidated`` (``torch.optim``'s format on one rank), ``convert``
(``python -m distoptim checkpoint``), ``checksums`` (the manifest)."""

from distoptim.checkpoint.files import load, save

__all__ = ["load", "save"]
