"""Shapes of the GPT-shaped model, as plain data (no torch here: the command line checks sizes before spawning)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PRESETS", "GPTConfig", "config_for_params"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the model: ``vocab`` tokens, ``context`` positions, ``layers`` blocks of width ``width``."""

    vocab: int = 256
    context: int = 64
    layers: int = 4
    width: int = 128
    heads: int = 4

    def __post_init__(self) -> None:
        for name in ("vocab", "context", "layers", "width", "heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.width % self.heads:
            raise ValueError(f"width ({self.width}) must be a multiple of heads ({self.heads})")

    @property
    def num_params(self) -> int:
        """Parameter count, without building the model (embeddings, blocks, final norm, untied head)."""
        block = 12 * self.width**2 + 13 * self.width
        return (2 * self.vocab + self.context) * self.width + self.layers * block + 2 * self.width


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(context=32, layers=1, width=32, heads=2),
    "small": GPTConfig(context=64, layers=4, width=128, heads=4),
    "medium": GPTConfig(context=128, layers=6, width=256, heads=8),
}


def config_for_params(
    millions: float, *, width: int = 512, vocab: int = 8192, context: int = 256, heads: int = 8
) -> GPTConfig:
    """A config of the given ``width`` whose layer count brings the parameter count closest to ``millions``."""
    base = GPTConfig(vocab=vocab, context=context, layers=1, width=width, heads=heads)
    per_layer = 12 * width**2 + 13 * width
    fixed = base.num_params - per_layer
    layers = max(1, round((millions * 1e6 - fixed) / per_layer))
    return GPTConfig(vocab=vocab, context=context, layers=layers, width=width, heads=heads)
