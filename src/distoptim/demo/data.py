"""The demo's text as tokens (one per byte, so the vocabulary is 256), split into training and held-out parts."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from distoptim.demo.source import HELD_OUT_FRACTION, MAX_BYTES, find_text_files

__all__ = ["load_text", "sample", "split_text"]


def load_text(source: Path) -> Tensor:
    """The bytes of the files of ``source`` (see ``find_text_files``), at most ``MAX_BYTES``, as 1-D ``uint8``."""
    chunks: list[bytes] = []
    total = 0
    for path in find_text_files(source):
        chunks.append(path.read_bytes()[: MAX_BYTES - total])
        total += len(chunks[-1])
        if total >= MAX_BYTES:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def split_text(text: Tensor) -> tuple[Tensor, Tensor]:
    """The first ``1 - HELD_OUT_FRACTION`` of ``text`` for training, the rest held out."""
    cut = int(len(text) * (1 - HELD_OUT_FRACTION))
    return text[:cut], text[cut:]


def sample(text: Tensor, batch: int, length: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``batch`` random windows of ``length`` tokens from ``text``, and the same windows shifted by one (targets)."""
    starts = torch.randint(0, len(text) - length, (batch,), generator=generator)
    windows = torch.stack([text[start : start + length + 1] for start in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]
