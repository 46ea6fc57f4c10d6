"""How one optimizer-state tensor is stored between steps (pure tensor ops): fp32 as it is, bf16, or int8 (Dettmers
et al., 2022: an fp32 absmax scale per ``BLOCK`` elements in memory order, each element the nearest code of a dynamic
map; ``docs/guides/state-formats.md``). Only ``SIGNED`` and ``NON_NEGATIVE`` keys are encoded."""

from __future__ import annotations

import functools
import sys

import torch
from torch import Tensor

from distoptim._flat import flat_view, is_dense

__all__ = [
    "BLOCK",
    "FORMATS",
    "MIN_NUMEL",
    "NON_NEGATIVE",
    "SCALES_SUFFIX",
    "SIGNED",
    "SPAN",
    "Scratch",
    "decode",
    "dynamic_map",
    "encode",
    "encoded_names",
    "is_encodable",
]

FORMATS = ("fp32", "bf16", "int8")
BLOCK = 256  # elements per int8 block (torchao's block size)
MIN_NUMEL = 4096  # a parameter with fewer elements keeps fp32 state in every format
SIGNED = frozenset({"exp_avg", "momentum_buffer", "prev", "grad_avg"})
NON_NEGATIVE = frozenset({"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "acc_delta", "exp_inf"})
SCALES_SUFFIX = ".int8_absmax"


def encoded_names(key: str, fmt: str) -> tuple[str, ...]:
    """The state keys a key is stored under in ``fmt``: its codes (and, int8, its per-block scales)."""
    return (f"{key}.bf16",) if fmt == "bf16" else (f"{key}.int8", key + SCALES_SUFFIX)


def is_encodable(key: str, value: object) -> bool:
    """Whether state ``key`` holding ``value`` is stored encoded in a low-bit format (never a sparse one)."""
    dense_float = isinstance(value, Tensor) and value.is_floating_point() and value.layout == torch.strided
    return dense_float and (key in SIGNED or key in NON_NEGATIVE)


@functools.cache
def dynamic_map(signed: bool) -> tuple[Tensor, Tensor]:
    """The 256 sorted code values in [-1, 1] (signed) or [0, 1], and the 255 midpoints between neighbours: dynamic
    tree quantization with 7 exponent bits, plus 0, 1 and (signed) -1, so that a block's absmax decodes exactly."""
    values: list[float] = [0.0, 1.0] + ([-1.0] if signed else [])
    for i in range(7):
        count = 2**i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1.0, count + 1, dtype=torch.float64)
        centres = ((edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - 6)).tolist()
        values += centres + ([-c for c in centres[int(i == 0) :]] if signed else [])
    table = torch.tensor(sorted(values), dtype=torch.float32)
    return table, (table[:-1] + table[1:]) / 2


@functools.cache
def _code_tables(signed: bool, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """For each run of floats sharing their top 16 bits: how many midpoints lie below it, the one inside (or +inf);
    and the code values. On ``device``, copied there once (a copy per step would make the CPU wait)."""
    table, midpoints = dynamic_map(signed)
    top = torch.arange(1 << 16, dtype=torch.int64) << 16
    low, high = top.to(torch.int32).view(torch.float32), (top | 0xFFFF).to(torch.int32).view(torch.float32)
    low, high = torch.minimum(low, high), torch.maximum(low, high)  # negative floats run the other way
    below = torch.searchsorted(midpoints, low)  # midpoints < low
    inside = torch.searchsorted(midpoints, high, right=True) - below
    finite = low.isfinite() & high.isfinite()
    assert int(inside[finite].max()) <= 1
    after = torch.where(inside > 0, midpoints[below.clamp(max=254)], torch.full_like(low, float("inf")))
    return below.to(torch.uint8).to(device), after.to(device), table.to(device)  # below + 1 <= 255 before a midpoint


_HIGH_HALF = 1 if sys.byteorder == "little" else 0


class Scratch:
    """Flat temporaries kept between calls, one per role (``take``: consecutive slices until ``reset``, then fresh
    memory past ``limit``; ``Scratch()``: a call's own temporaries)."""

    def __init__(self, limit: int = 0) -> None:
        self.limit = limit
        self.buffers: dict[str, Tensor] = {}
        self.used: dict[str, int] = {}

    def get(self, role: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        buffer = self.buffers.get(role)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.device != device:
            buffer = self.buffers[role] = torch.zeros(numel, dtype=dtype, device=device)
        return buffer[:numel]

    def take(self, role: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        start = self.used.get(role, 0)
        if start + numel > self.limit:
            return torch.empty(numel, dtype=dtype, device=device)
        self.used[role] = start + numel
        return self.get(role, start + numel, dtype, device)[start:]

    def reset(self) -> None:
        self.used.clear()


def nearest_codes(
    normalized: Tensor, signed: bool, scratch: Scratch | None = None, out: Tensor | None = None
) -> Tensor:
    """The index of the nearest code to each element of ``normalized`` (fp32 in [-1, 1]; ties to the lower code)."""
    below, after, _ = _code_tables(signed, normalized.device)
    get, count, device = (scratch or Scratch()).get, normalized.numel(), normalized.device
    halves = normalized.view(torch.int16).view(-1, 2)[:, _HIGH_HALF]  # each float's top 16 bits
    run = get("int32", count, torch.int32, device).copy_(halves.view(torch.uint16))
    after_run = torch.index_select(after, 0, run, out=get("after", count, torch.float32, device))
    above = torch.lt(after_run, normalized, out=get("above", count, torch.bool, device))
    return torch.index_select(below, 0, run, out=out).add_(above.view(torch.uint8))


def _flat(tensor: Tensor) -> Tensor:
    return flat_view(tensor) if is_dense(tensor) else tensor.reshape(-1)


def _laid_like(flat: Tensor, like: Tensor) -> Tensor:
    """``flat`` (new, contiguous: ``like``'s elements in ``_flat``'s order) shaped and laid out as ``like``."""
    return flat.as_strided(like.shape, like.stride()) if is_dense(like) else flat.view(like.shape)


SPAN = 1 << 18  # elements encoded or decoded at once (a multiple of ``BLOCK``): the temporaries stay in cache


def _encode_span(flat: Tensor, absmax: Tensor, codes: Tensor, signed: bool, scratch: Scratch) -> None:
    """Blocks from ``flat``'s start into ``absmax`` and ``codes`` (slices of the outputs)."""
    count, full = flat.numel(), flat.numel() // BLOCK * BLOCK
    normalized = scratch.get("normalized", count, torch.float32, flat.device)
    torch.amax(torch.abs(flat[:full], out=normalized[:full]).view(-1, BLOCK), 1, out=absmax[: full // BLOCK])
    if full < count:
        absmax[-1] = flat[full:].abs().amax()
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    torch.div(flat[:full].view(-1, BLOCK), safe[: full // BLOCK, None], out=normalized[:full].view(-1, BLOCK))
    if full < count:
        torch.div(flat[full:], safe[-1], out=normalized[full:])
    nearest_codes(normalized, signed, scratch, out=codes)


def encode(key: str, value: Tensor, fmt: str, scratch: Scratch | None = None) -> dict[str, Tensor]:
    """``value`` (state ``key``) encoded in ``fmt``, as the entries ``encoded_names`` names."""
    if fmt == "bf16":
        return {f"{key}.bf16": value.to(torch.bfloat16, copy=True)}  # a copy: bf16 state decodes into the scratch
    flat = _flat(value).float()
    count = flat.numel()
    absmax, codes = flat.new_empty(-(-count // BLOCK)), torch.empty(count, dtype=torch.uint8, device=flat.device)
    for start in range(0, count, SPAN):
        end, blocks = min(start + SPAN, count), slice(start // BLOCK, -(-(start + SPAN) // BLOCK))
        _encode_span(flat[start:end], absmax[blocks], codes[start:end], key in SIGNED, scratch or Scratch())
    return {f"{key}.int8": _laid_like(codes, value), key + SCALES_SUFFIX: absmax}


def decode(key: str, entry: dict[str, Tensor], fmt: str, dtype: torch.dtype, scratch: Scratch | None = None) -> Tensor:
    """State ``key`` decoded from ``entry`` (``encode``'s output) to ``dtype`` (into ``scratch`` where given)."""
    codes, scratch = entry[f"{key}.bf16" if fmt == "bf16" else f"{key}.int8"], scratch or Scratch()
    count, device = codes.numel(), codes.device
    values = scratch.take(f"decoded {key}", count, dtype, device)
    if fmt == "bf16":
        return _laid_like(values.copy_(_flat(codes)), codes)
    absmax, table = entry[key + SCALES_SUFFIX], _code_tables(key in SIGNED, device)[2]
    decoded = values if dtype == torch.float32 else torch.empty(count, device=device, dtype=torch.float32)
    flat = _flat(codes)
    for start in range(0, count, SPAN):
        end = min(start + SPAN, count)
        indices = scratch.get("int32", end - start, torch.int32, device)
        torch.index_select(table, 0, indices.copy_(flat[start:end]), out=decoded[start:end])
    full = count // BLOCK * BLOCK
    decoded[:full].view(-1, BLOCK).mul_(absmax[: full // BLOCK, None])
    if full < count:
        decoded[full:].mul_(absmax[-1])
    return _laid_like(values if decoded is values else values.copy_(decoded), codes)
