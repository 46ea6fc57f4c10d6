"""The int8 codec across several spans and with kept buffers (``codecs.Scratch``): the same bits as a reference
written here from the scheme (per-block absmax, division, ``torch.bucketize`` on the map's midpoints)."""

from __future__ import annotations

import pytest
import torch

from distoptim.zero import codecs


def _reference(key: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, scales and decoded values of ``x`` (flat, fp32) computed block by block with plain torch ops."""
    table, midpoints = codecs.dynamic_map(key in codecs.SIGNED)
    blocks = list(x.split(codecs.BLOCK))
    absmax = torch.stack([block.abs().amax() for block in blocks])
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    codes = torch.cat([torch.bucketize(block / scale, midpoints) for block, scale in zip(blocks, safe)])
    values = torch.cat([table[c] * scale for c, scale in zip(codes.split(codecs.BLOCK), absmax)])
    return codes.to(torch.uint8), absmax, values


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
def test_spans_and_scratch_give_the_reference_bits(key: str) -> None:
    generator = torch.Generator().manual_seed(0)
    count = 2 * codecs.SPAN + 3 * codecs.BLOCK + 17  # three spans, the last ending in a partial block
    x = torch.randn(count, generator=generator) * 10.0 ** torch.randint(-9, 2, (count,), generator=generator)
    x = x if key in codecs.SIGNED else x.abs()
    x[codecs.SPAN : codecs.SPAN + codecs.BLOCK] = 0.0  # an all-zero block
    codes, absmax, values = _reference(key, x)
    scratch = codecs.Scratch(limit=count)
    for given in (None, scratch, scratch):  # twice with the same buffers
        encoded = codecs.encode(key, x, "int8", given)
        assert torch.equal(encoded[f"{key}.int8"], codes)
        assert torch.equal(encoded[f"{key}.int8_absmax"], absmax)
        scratch.reset()
        assert torch.equal(codecs.decode(key, encoded, "int8", torch.float32, given), values)


def test_scratch_slices_are_disjoint_and_bounded() -> None:
    scratch, cpu = codecs.Scratch(limit=100), torch.device("cpu")
    first, second = (scratch.take("decoded exp_avg", 40, torch.float32, cpu) for _ in range(2))
    first.fill_(1.0)
    second.fill_(2.0)
    assert bool((first == 1.0).all()) and first.data_ptr() != second.data_ptr()
    beyond = scratch.take("decoded exp_avg", 40, torch.float32, cpu)  # past the limit: fresh memory
    assert beyond.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
    scratch.reset()
    assert scratch.take("decoded exp_avg", 40, torch.float32, cpu).untyped_storage().data_ptr() in (
        first.untyped_storage().data_ptr(),
        second.untyped_storage().data_ptr(),
    )
