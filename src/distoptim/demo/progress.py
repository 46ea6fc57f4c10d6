"""A one-line progress bar: redrawn in place on a terminal, a line every tenth of the run otherwise."""

from __future__ import annotations

from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    """``update(step, **figures)`` draws ``[#####.....] step 40/200 loss 2.31`` on ``stream``."""

    def __init__(self, stream: TextIO, total: int, width: int = 30) -> None:
        self.stream = stream
        self.total = total
        self.width = width
        self.interactive = stream.isatty()
        self._last_tenth = -1

    def update(self, step: int, **figures: str) -> None:
        filled = self.width * step // self.total
        bar = "#" * filled + "." * (self.width - filled)
        extra = "".join(f"  {name} {value}" for name, value in figures.items())
        line = f"[{bar}] step {step}/{self.total}{extra}"
        if self.interactive:
            self.stream.write(f"\r{line}\033[K")
        elif (tenth := 10 * step // self.total) != self._last_tenth:
            self._last_tenth = tenth
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.interactive:
            self.stream.write("\n")
            self.stream.flush()
