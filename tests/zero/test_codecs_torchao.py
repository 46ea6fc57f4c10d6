"""Our int8 codec beside torchao's (``torchao.optim``'s 8-bit state, skipped where torchao is not installed): the
same dynamic maps up to the one difference ``codecs.dynamic_map`` states, the same block scales, and the same decoded
values wherever that difference does not decide the nearest code."""

from __future__ import annotations

import pytest
import torch

from distoptim.zero import codecs

quant_utils = pytest.importorskip("torchao.optim.quant_utils", exc_type=ImportError)

RELATIVE = 2e-7
"""How far a map value may be from torchao's: torchao builds its map in float32 steps, ours in float64."""


def _torchao_map(signed: bool) -> torch.Tensor:
    return torch.tensor(quant_utils.create_dynamic_map(signed), dtype=torch.float32)


def _unmatched(values: torch.Tensor, others: torch.Tensor) -> list[float]:
    gap = (values.double()[:, None] - others.double()[None, :]).abs().min(1).values
    return values[gap > RELATIVE * values.double().abs()].tolist()


@pytest.mark.parametrize("signed", [False, True])
def test_the_maps_are_torchaos_but_for_the_stated_difference(signed: bool) -> None:
    ours, theirs = codecs.dynamic_map(signed)[0], _torchao_map(signed)
    assert ours.numel() == theirs.numel() == 256
    assert _unmatched(ours, theirs) == ([-1.0] if signed else [])  # ours holds -1 ...
    smallest_negative = [float(theirs[theirs < 0].max())] if signed else []
    assert _unmatched(theirs, ours) == smallest_negative  # ... in place of the smallest negative value


@pytest.mark.parametrize("signed", [False, True])
def test_encoding_decodes_as_torchaos(signed: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    count = 64 * codecs.BLOCK
    magnitudes = torch.logspace(-9, 0, count)[torch.randperm(count, generator=generator)]  # every exponent of the map
    values = torch.randn(count, generator=generator) * magnitudes
    values = values if signed else values.abs()
    key = "exp_avg" if signed else "exp_avg_sq"
    ours = codecs.encode(key, values, "int8")
    normalized, scales = quant_utils.scale_tensor(values, codecs.BLOCK)
    qmap = _torchao_map(signed)
    theirs = quant_utils.dequant_with_qmap(quant_utils.quantize_8bit_with_qmap(normalized, qmap), qmap, scales)
    assert torch.equal(ours[f"{key}.int8_absmax"], scales)
    decoded = codecs.decode(key, ours, "int8", torch.float32)
    # where the maps differ the nearest code may too: below the midpoint of -1 and torchao's lowest code, and
    # between 0 and the midpoint of torchao's two negative codes nearest 0
    lowest, near_zero = float(qmap[0]), sorted(float(v) for v in qmap[qmap < 0])[-2:]
    exempt = (normalized < (lowest - 1) / 2) | ((normalized < 0) & (normalized > sum(near_zero) / 2)) if signed else 0
    same = ~torch.as_tensor(exempt, dtype=torch.bool).expand(count)
    gap = (decoded - theirs).abs()[same]
    assert same.sum() > 0.75 * count  # most elements are compared
    relative = gap / decoded.abs()[same].clamp(min=1e-45)
    assert float(relative.max()) <= 2 * RELATIVE, float(relative.max())  # the map's rounding and the product's
