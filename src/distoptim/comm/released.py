"""Waiting until gloo's worker thread has let go of the tensors of a collective that already returned.

gloo runs a collective in a worker thread of its own (``ProcessGroupGloo::runLoop``), which drops its reference to
the work, and so to the work's tensors, a moment after the caller's ``wait()`` has returned. A tensor made in Python
has a Python object, so that last drop takes the GIL; when the interpreter is finalizing by then (a script whose
last distributed call was a distoptim one returned and exited), taking the GIL ends the thread inside a C++
destructor and the process aborts ("terminate called without an active exception", SIGABRT: 3 runs in 32 of a
2-rank checkpoint save and load). ``release`` is called after the collectives that end distoptim's calls (the
agreement, the object exchanges): it releases the GIL until gloo holds none of the tensors, at no cost when gloo
already let go, and gives up after ``TIMEOUT_S`` (a peer that died: the error is the caller's to raise).
"""

from __future__ import annotations

import time

from torch import Tensor

__all__ = ["TIMEOUT_S", "release"]

TIMEOUT_S = 2.0


def release(*tensors: Tensor) -> None:
    """Return once no thread but the caller's holds ``tensors`` (CPU tensors just used by a blocking collective)."""
    deadline = None
    for tensor in tensors:
        while tensor._use_count() > 1:  # type: ignore[attr-defined]  # gloo's worker still holds it: let it take the GIL and drop it
            deadline = deadline or time.monotonic() + TIMEOUT_S
            if time.monotonic() > deadline:
                return
            time.sleep(1e-4)
