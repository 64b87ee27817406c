"""``mla_decode_absorbed`` at many sequences: each sequence's output and written latent are the same
bits alone as among 16 (the W_UK and W_UV products run over all the step's sequences at once), and
the outputs match a float64 PyTorch reference."""

import pytest
import torch

from kimitui.kernels.cpu import few_rows as cpu_few_rows

needs_ext = pytest.mark.skipif(not cpu_few_rows.available(), reason="the C++ extension does not build here")

# r = 202: W_UK's columns run as 64-wide chunks, an 8-wide chunk and a 2-column scalar tail; v = 50
# leaves partial row tiles in W_UV.
HEADS, NOPE, ROPE, R, V, BLOCK = 3, 24, 8, 202, 50, 4
LENS = [9, 1, 0, 17, 4, 12, 5, 30, 2, 8, 3, 21, 6, 11, 7, 16]  # 0: an empty context gives zeros


def _case(dtype, heads=HEADS, lens=LENS):
    g = torch.Generator().manual_seed(7)
    f = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale  # noqa: E731
    seqs, max_blocks = len(lens), -(-max(lens) // BLOCK)
    num_blocks = seqs * max_blocks
    tables = torch.randperm(num_blocks, generator=g).int().view(seqs, max_blocks)
    pos = (torch.tensor(lens) - 1).clamp(min=0)
    slots = tables[torch.arange(seqs), pos // BLOCK].long() * BLOCK + pos % BLOCK
    angles = torch.arange(max(64, max(lens))).float()[:, None] * torch.linspace(0.05, 1, ROPE // 2)
    return dict(
        q=f(seqs, heads, NOPE + ROPE),
        kv=f(seqs, R + ROPE),
        kv_norm_weight=1 + f(R, scale=0.1),
        eps=1e-6,
        cos=angles.cos(),
        sin=angles.sin(),
        positions=pos,
        slots=slots,
        w_uk=f(heads, NOPE, R, scale=0.2).to(dtype),
        w_uv=f(heads, V, R, scale=0.2).to(dtype),
        cache=f(num_blocks * BLOCK, R + ROPE).to(dtype),
        block_tables=tables,
        context_lens=torch.tensor(lens, dtype=torch.int32),
        block_size=BLOCK,
        scale=0.3,
    )


def _rope(x, cos, sin):  # interleaved pairs (x[2p], x[2p+1]) turned by angle p
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).flatten(-2)


def _reference(a, cache):
    """float64 attention of each sequence over ``cache`` (already holding the newest latents)."""
    d = torch.float64
    lens = a["context_lens"].tolist()
    out = torch.zeros(len(lens), a["q"].shape[1], V, dtype=d)
    for b, n in enumerate(lens):
        if n == 0:
            continue
        p = a["positions"][b]
        q = a["q"][b].to(d)
        q_lat = torch.einsum("hn,hnr->hr", q[:, :NOPE], a["w_uk"].to(d))
        q_rope = _rope(q[:, NOPE:], a["cos"][p].to(d), a["sin"][p].to(d))
        idx = torch.arange(n)
        keys = cache[a["block_tables"][b, idx // BLOCK].long() * BLOCK + idx % BLOCK].to(d)
        scores = (q_lat @ keys[:, :R].T + q_rope @ keys[:, R:].T) * a["scale"]
        lat = scores.softmax(-1) @ keys[:, :R]
        out[b] = torch.einsum("hr,hvr->hv", lat, a["w_uv"].to(d))
    return out


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_gives_the_same_bits_alone_and_among_16(dtype):
    a = _case(dtype)
    cache = a["cache"].clone()
    batch = cpu_few_rows.mla_decode_absorbed(**{**a, "cache": cache})
    assert not batch[LENS.index(0)].any()
    for b in range(len(LENS)):
        alone_cache = a["cache"].clone()
        one = {k: a[k][b : b + 1] for k in ("q", "kv", "positions", "slots", "block_tables", "context_lens")}
        alone = cpu_few_rows.mla_decode_absorbed(**{**a, **one, "cache": alone_cache})
        assert torch.equal(alone[0], batch[b]), f"sequence {b}"
        assert torch.equal(alone_cache[a["slots"][b]], cache[a["slots"][b]])
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: the newest latent is rounded into the cache
    torch.testing.assert_close(batch.double(), _reference(a, cache), rtol=tol, atol=tol)


@needs_ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_passes_large_enough_to_split_over_threads_give_one_threads_bits(dtype):
    # 128 heads and contexts of hundreds of tokens: W_UK, W_UV (1.2 and 2.6 MB in bf16, twice that in
    # float32) and the attention pass are each past the size below which a pass stays on the calling
    # thread (kInlineBytes, 256 KiB), so with two threads they run as runs of items taken by either thread.
    lens = [300, 1, 0, 457, 64, 120, 5, 390]
    a = _case(dtype, heads=128, lens=lens)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            cache = a["cache"].clone()
            outs.append((cpu_few_rows.mla_decode_absorbed(**{**a, "cache": cache}), cache))
    finally:
        torch.set_num_threads(before)
    (one, one_cache), (two, two_cache) = outs
    assert torch.equal(one, two) and torch.equal(one_cache, two_cache)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(two.double(), _reference(a, two_cache), rtol=tol, atol=tol)
