"""Per-rank memory of one benchmark variant: the peak resident growth, and the live tensor bytes by category.

``reset_peak()`` (before the variant is built) trims glibc's free heap, then resets the kernel's high-water mark
(``/proc/self/clear_refs``, "5": VmHWM := VmRSS) and returns the resident bytes at that moment; ``peak_growth``
is VmHWM less that, read after the run: what building and training the variant cost beyond the model and torch.

``census`` counts tensor bytes by storage, each storage once (views, flat buffers that parameters view into, a
DTensor's local shard): first the categories a harness names (``params``, ``grads``, ``state``, ``master``, in that
order: a storage counts in the first category that holds it), then ``buffers``: every other tensor the garbage
collector can reach (communication buckets, unsharded FSDP parameters, DeepSpeed's IPG buffers, staging buffers),
plus what the harness reports for buffers that live in C++ only (DDP's gradient buckets), less the tensors that were
alive before the variant was built (``tensors_alive``: the batch, and what the warm-up iteration on a tiny model left
in reference cycles through C++, which Python's collector cannot free). Storage bytes are what a
GPU would hold; on the CPU an allocated but untouched storage is not resident, so the census can exceed the RSS.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import re
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["CATEGORIES", "census", "peak_growth", "reset_peak", "rss_bytes", "tensors_alive"]

CATEGORIES = ("params", "grads", "state", "master", "buffers")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        match = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def rss_bytes() -> int:
    """Resident bytes of this process now (VmRSS)."""
    return _status_bytes("VmRSS")


def reset_peak() -> int:
    """Free what can be freed, reset the peak resident set to the current one, and return the current one."""
    gc.collect()
    with contextlib.suppress(OSError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # VmHWM := VmRSS
    return rss_bytes()


def peak_growth(base: int) -> int:
    """How far the peak resident set (VmHWM) rose above ``base`` since ``reset_peak``."""
    return max(_status_bytes("VmHWM") - base, 0)


def _storage(tensor: Any) -> tuple[int, int] | None:
    """(address, bytes) of the storage behind ``tensor`` (a DTensor's local shard), or None for no real storage."""
    if not isinstance(tensor, Tensor):
        return None
    local = getattr(tensor, "_local_tensor", None)  # a DTensor: what this rank holds
    if isinstance(local, Tensor):
        tensor = local
    try:
        if tensor.is_meta:
            return None
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # a tensor subclass without a plain storage
        return None


def _flatten(value: Any) -> Iterable[Any]:
    if isinstance(value, dict):
        for item in value.values():
            yield from _flatten(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _flatten(item)
    else:
        yield value


def _is_tensor(obj: object) -> bool:
    """Whether ``obj`` is a tensor; False for a weak proxy whose referent is gone (``torch.compile`` leaves some
    among the collector's objects, and ``isinstance`` on them raises)."""
    try:
        return isinstance(obj, Tensor)
    except ReferenceError:
        return False


def tensors_alive() -> list[weakref.ref[Tensor]]:
    """Weak references to every tensor the garbage collector can reach now (``census``'s ``before``)."""
    gc.collect()
    return [weakref.ref(obj) for obj in gc.get_objects() if _is_tensor(obj)]


def census(
    named: dict[str, Any], cpp_buffers: dict[int, int] | None = None, before: Sequence[weakref.ref[Tensor]] = ()
) -> dict[str, int]:
    """Bytes per category (``CATEGORIES``), each storage counted once; ``named`` maps categories to (nested
    lists/dicts of) tensors; ``buffers`` holds ``cpp_buffers`` (storages held in C++, address -> bytes; Python views
    of them are not counted again) and every other tensor the garbage collector can reach, except those of
    ``before`` still alive (the batch; what a warm-up left in reference cycles through C++)."""
    cpp_buffers = cpp_buffers or {}
    counts = dict.fromkeys(CATEGORIES, 0)
    seen: set[int] = {address for address in cpp_buffers if address > 0}

    def add(category: str, tensor: Any) -> None:
        found = _storage(tensor)
        if found is None or found[0] == 0 or found[0] in seen:
            return
        seen.add(found[0])
        counts[category] += found[1]

    with torch.no_grad():
        for category in CATEGORIES[:-1]:
            for tensor in _flatten(named.get(category, [])):
                add(category, tensor)
        for ref in before:
            found = _storage(ref())
            if found is not None:
                seen.add(found[0])
        for obj in gc.get_objects():
            if _is_tensor(obj):
                add("buffers", obj)
    counts["buffers"] += sum(cpp_buffers.values())
    return counts
