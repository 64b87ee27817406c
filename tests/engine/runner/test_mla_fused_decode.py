"""The fused CPU decode of an MLA layer (one ``mla_decode_absorbed`` call) against the same layer
run op by op (the reference backend, ``KIMITUI_KERNELS=reference``): same outputs, same cache contents."""

import pytest
import torch

from kimitui.engine.layers.attn_metadata import AttentionMetadata
from kimitui.engine.layers.mla import MLAttention
from kimitui.kernels.backend import REFERENCE
from kimitui.kernels.cpu import few_rows as cpu_few_rows
from kimitui.kernels.cpu.backend import CpuBackend
from tests.helpers.mla import random_mla_layer

needs_ext = pytest.mark.skipif(not cpu_few_rows.available(), reason="C++ CPU kernels did not build here")


def _layer(heads: int, seed: int = 0) -> MLAttention:
    return random_mla_layer(heads, seed, ops=CpuBackend())


def _decode_step(lens: list[int], block_size: int, num_blocks: int, seed: int):
    """Metadata for one decode per sequence (context lengths ``lens``, blocks in random order)."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(lens) // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:max_blocks] for _ in lens]).int()
    ctx = torch.tensor(lens, dtype=torch.int32)
    pos = ctx.long() - 1
    slots = tables[torch.arange(len(lens)), pos // block_size].long() * block_size + pos % block_size
    return AttentionMetadata(
        positions=pos,
        slot_mapping=slots,
        block_size=block_size,
        num_decode_tokens=len(lens),
        decode_block_tables=tables,
        decode_context_lens=ctx,
        decode_max_context_len=max(lens),
    )


@needs_ext
@pytest.mark.parametrize("heads,lens", [(4, [1]), (4, [5, 1, 17, 9]), (11, [3, 30])])
def test_fused_decode_matches_the_op_by_op_layer(heads, lens):
    layer = _layer(heads)
    block_size, num_blocks = 4, 40
    meta = _decode_step(lens, block_size, num_blocks, seed=heads)
    width = layer.kv_lora_rank + layer.rope_dim
    cache = torch.randn(num_blocks, block_size, width)
    x = torch.randn(len(lens), 64)
    assert layer.ops.mla_decode_fusable(x, cache, layer.w_uk, layer.w_uv)

    fused_cache = cache.clone()
    with torch.inference_mode():
        fused = layer(x, meta, fused_cache)
        for module in layer.modules():
            module.ops = REFERENCE
        assert not layer.ops.mla_decode_fusable(x, cache, layer.w_uk, layer.w_uv)
        want_cache = cache.clone()
        want = layer(x, meta, want_cache)
    torch.testing.assert_close(fused_cache, want_cache, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused, want, rtol=1e-4, atol=1e-5)
    # Only the newest slot of each sequence was written.
    changed = (fused_cache != cache).any(-1).view(-1).nonzero().view(-1)
    assert sorted(changed.tolist()) == sorted(meta.slot_mapping.tolist())


@needs_ext
def test_fused_decode_names_a_position_outside_the_rotary_table():
    layer = _layer(4)
    meta = _decode_step([3], 4, 8, seed=0)
    meta.positions = torch.tensor([10_000])
    cache = torch.zeros(8, 4, layer.kv_lora_rank + layer.rope_dim)
    with pytest.raises(RuntimeError, match="position 10000 of sequence 0 is outside the rotary cache"):
        layer(torch.randn(1, 64), meta, cache)
    assert not cache.any()  # rejected before anything was written
