"""Crash-safe sharded checkpoints: ``torch.distributed.checkpoint`` into a directory that appears only when complete.

``save`` writes every rank's shard, then a manifest of each file's CRC-32; ``load`` checks manifest, keys and shapes
on every rank first and raises one ``ValueError`` everywhere otherwise (``docs/guides/checkpoints.md``)."""

from distoptim.checkpoint.files import load, save

__all__ = ["load", "save"]
