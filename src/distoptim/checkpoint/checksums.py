"""A sharded checkpoint's manifest: every file's size and CRC-32 (DCP's files carry none), written after DCP's
``.metadata``, checked before a load; CRC-32 guards against damage, not tampering. ``docs/guides/checkpoints.md``."""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["MANIFEST", "checksum", "checksums", "read_manifest", "verify", "write_manifest"]

MANIFEST = ".checksums"
_FORMAT = "distoptim checksums 1"
_ALGORITHM = "crc32"
_CHUNK = 4 << 20

Entry = tuple[int, str]  # (size in bytes, checksum as 8 hex digits)


def checksum(path: Path) -> Entry:
    crc, size, buffer = 0, 0, bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            crc, size = zlib.crc32(view[:count], crc), size + count
    return size, f"{crc:08x}"


def checksums(directory: Path, names: Iterable[str]) -> dict[str, Entry]:
    return {name: checksum(directory / name) for name in sorted(set(names))}


def write_manifest(directory: Path, entries: Mapping[str, Entry]) -> None:
    """Write ``MANIFEST`` (``entries``, and ``.metadata``'s own, which it adds) into ``directory``, durably."""
    files = {**entries, **checksums(directory, [".metadata"])}
    text = json.dumps({"format": _FORMAT, "algorithm": _ALGORITHM, "files": dict(sorted(files.items()))}, indent=1)
    with open(directory / MANIFEST, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def read_manifest(directory: Path) -> dict[str, Entry] | None:
    """The entries of ``directory``'s manifest, ``.metadata`` checked against them; None when it has none; a
    ``ValueError`` when it cannot be read or ``.metadata`` does not match."""
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
        if saved["format"] != _FORMAT or saved["algorithm"] != _ALGORITHM:
            raise ValueError(f"unknown format {saved['format']!r} / {saved['algorithm']!r}")
        entries = {str(name): (int(size), str(crc)) for name, (size, crc) in saved["files"].items()}
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        raise ValueError(
            f"the checkpoint at {directory} is damaged: its manifest {MANIFEST} cannot be read ({error}); load "
            "another checkpoint"
        ) from error
    verify(directory, {".metadata": 0}, entries)
    return entries


def verify(directory: Path, needed: Mapping[str, int], manifest: Mapping[str, Entry] | None) -> None:
    """A ``ValueError`` naming the first file of ``needed`` (each name with the bytes it holds at least) that is
    missing or shorter, or, with a ``manifest``, that it does not list or whose size or checksum differs from it."""
    for name, size in sorted(needed.items()):
        path = directory / name
        if not path.is_file():
            raise ValueError(f"the checkpoint at {directory} is damaged: its data file {name} is missing")
        if os.path.getsize(path) < size:
            raise ValueError(
                f"the checkpoint at {directory} is damaged: its data file {name} holds {os.path.getsize(path)} bytes "
                f"where its metadata says at least {size} (the file was truncated)"
            )
    if manifest is None:
        return
    for name in sorted(needed):
        if name not in manifest:
            raise ValueError(f"the checkpoint at {directory} is damaged: its manifest does not list {name}")
        (size, crc), (actual_size, actual_crc) = manifest[name], checksum(directory / name)
        if actual_size != size:
            raise ValueError(
                f"the checkpoint at {directory} is damaged: its file {name} holds {actual_size} bytes where "
                f"{size} were saved (the file was truncated or overwritten); load another checkpoint"
            )
        if actual_crc != crc:
            raise ValueError(
                f"the checkpoint at {directory} is damaged: the bytes of its file {name} changed since the save "
                f"(CRC-32 {actual_crc}, saved {crc}); load another checkpoint"
            )
