"""MLA prefill over a cached context longer than ``prefill_slice``: the context goes through kv_b_proj
in slices merged by online softmax. Same outputs as the one-shot path, and kv_b_proj never sees more
than a slice of rows."""

import pytest
import torch

from kimitui.engine.layers.attn_metadata import AttentionMetadata, PrefillChunk
from kimitui.engine.layers.mla import PREFILL_SLICE, MLAttention
from tests.helpers.mla import random_mla_layer

SLICE = 64
BLOCK = 16


def _layer(seed: int = 0, heads: int = 4) -> MLAttention:
    return random_mla_layer(heads, seed)


def _cache(layer: MLAttention, context_len: int, seed: int):
    """A random flat cache and a shuffled block table holding ``context_len`` tokens."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-context_len // BLOCK)
    num_blocks = blocks + 3
    table = torch.randperm(num_blocks, generator=g)[:blocks].int()
    flat = torch.randn(num_blocks * BLOCK, layer.kv_lora_rank + layer.rope_dim, generator=g)
    return table, flat


def _queries(layer: MLAttention, n: int, seed: int):
    g = torch.Generator().manual_seed(seed + 1000)
    return (
        torch.randn(n, layer.num_heads, layer.nope, generator=g),
        torch.randn(n, layer.num_heads, layer.rope_dim, generator=g),
    )


def _rows_seen(layer: MLAttention) -> list[int]:
    rows: list[int] = []
    layer.kv_b_proj.register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[0]))
    return rows


def test_the_default_slice_is_the_module_constant():
    assert _layer().prefill_slice == PREFILL_SLICE


@pytest.mark.parametrize(
    "context_len,n",
    [
        (1, 1),
        (63, 63),
        (63, 1),
        (64, 64),
        (64, 7),
        (65, 65),
        (65, 1),
        (65, 2),
        (65, 30),
        (300, 300),
        (300, 1),
        (300, 37),
        (300, 64),
        (300, 236),
        (300, 237),
        (300, 250),
    ],
)
def test_sliced_prefill_matches_the_one_shot_path(context_len, n):
    layer = _layer()
    table, flat = _cache(layer, context_len, seed=context_len * 7 + n)
    q_nope, q_pe = _queries(layer, n, seed=n)
    with torch.inference_mode():
        want = layer._prefill(q_nope, q_pe, context_len, table, BLOCK, flat)  # one shot: 4096 > 300
        layer.prefill_slice = SLICE
        rows = _rows_seen(layer)
        got = layer._prefill(q_nope, q_pe, context_len, table, BLOCK, flat)
    assert got.shape == want.shape == (n, layer.num_heads, layer.v_dim)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if context_len <= SLICE:  # short contexts keep the one-shot path, bit for bit
        assert torch.equal(got, want)
        assert rows == [context_len]
    else:
        assert max(rows) <= SLICE
        assert sum(rows) == context_len  # each cached token expanded exactly once


def test_kv_b_proj_rows_stay_bounded_by_the_slice_for_a_long_context():
    layer = _layer(seed=3)
    layer.prefill_slice = SLICE
    context_len, n = 1000, 40
    table, flat = _cache(layer, context_len, seed=5)
    q_nope, q_pe = _queries(layer, n, seed=5)
    rows = _rows_seen(layer)
    with torch.inference_mode():
        got = layer._prefill(q_nope, q_pe, context_len, table, BLOCK, flat)
    assert rows == [SLICE] * (context_len // SLICE) + [context_len % SLICE]
    assert torch.isfinite(got).all()


def test_a_layer_forward_with_cached_context_matches_across_slice_sizes():
    """Through forward: a chunk of 50 rows after 250 cached tokens (rope, cache write, o_proj)."""
    layer = _layer(seed=1)
    cached, n = 250, 50
    context_len = cached + n
    table, flat = _cache(layer, context_len, seed=9)
    cache = flat.view(-1, BLOCK, flat.shape[-1])
    pos = torch.arange(cached, context_len)
    slots = table[pos // BLOCK].long() * BLOCK + pos % BLOCK
    meta = AttentionMetadata(
        positions=pos, slot_mapping=slots, block_size=BLOCK, prefills=[PrefillChunk(0, n, context_len, table)]
    )
    x = torch.randn(n, 64, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want = layer(x, meta, cache.clone())
        layer.prefill_slice = SLICE
        got = layer(x, meta, cache.clone())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sliced_prefill_in_bfloat16_stays_close_to_float32():
    layer = _layer(seed=4)
    layer.prefill_slice = SLICE
    context_len, n = 200, 20
    table, flat = _cache(layer, context_len, seed=4)
    q_nope, q_pe = _queries(layer, n, seed=4)
    with torch.inference_mode():
        want = layer._prefill(q_nope, q_pe, context_len, table, BLOCK, flat)
        layer.kv_b_proj.to(torch.bfloat16)  # the only weight the naive path uses
        got = layer._prefill(q_nope.bfloat16(), q_pe.bfloat16(), context_len, table, BLOCK, flat)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05)
