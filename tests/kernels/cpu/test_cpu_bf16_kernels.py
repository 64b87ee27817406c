"""The C++ few-row CPU kernels with bf16 weights (and a bf16 latent cache): against float64
references, bit for bit against the float32 kernels on the widened weights (the widening is exact
and the sums run in the same order), a row's bits alone and in a batch, and the fused decode blocks
against their float32 selves."""

import pytest
import torch

from kimitui.kernels import reference as ref
from kimitui.kernels.cpu import few_rows as cpu_few_rows
from kimitui.kernels.cpu import linear as cpu_linear
from kimitui.kernels.cpu.backend import CpuBackend

needs_ext = pytest.mark.skipif(not cpu_few_rows.available(), reason="the C++ extension does not build here")
BF16 = torch.bfloat16
# rows from which bf16 linears run oneDNN's bf16 product instead (cpu_few_rows.cpp, kBf16BlasRows),
# where oneDNN's bf16 product is native; elsewhere (AVX2 only) the widening loops run up to the MoE's
# BLAS pair count (kGemmPairs) and linear's callers never pass more than 16 rows
NATIVE = cpu_linear.onednn_bf16_native()
BLAS_ROWS = 6 if NATIVE else 32
# where the CPU has AMX-BF16 tiles, bf16 experts of 1-512 pairs run them instead (cpu_moe_amx.cpp, on
# activations rounded to bf16; tests/kernels/cpu/test_cpu_moe_amx.py)
AMX = cpu_few_rows.available() and cpu_few_rows._module().moe_amx_usable()


def _bf16(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(BF16)


@needs_ext
@pytest.mark.parametrize("m", [1, 2, 3, 4, BLAS_ROWS - 1])
@pytest.mark.parametrize("n,k", [(1, 8), (7, 5), (64, 67), (130, 256)])
def test_bf16_weight_linear_matches_float64_and_the_float32_kernel(m, n, k):
    torch.manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k), _bf16(n, k, seed=n + k)
    got = cpu_few_rows.linear(x, w)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-4)
    assert torch.equal(got, cpu_few_rows.linear(x, w.float()))  # exact widening, same FMAs


@needs_ext
@pytest.mark.parametrize("m", [1, 4, 6, 16])
def test_bf16_activations_come_back_rounded_once(m):
    torch.manual_seed(m)
    x, w = torch.randn(m, 96).to(BF16), _bf16(40, 96, seed=3)
    got = cpu_few_rows.linear(x, w)
    assert got.dtype == BF16 and got.shape == (m, 40)
    want = x.double() @ w.double().T
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)  # one bf16 rounding of an fp32 sum
    if m < BLAS_ROWS:  # the widening loops: the float32 kernel's result, rounded
        assert torch.equal(got, cpu_few_rows.linear(x.float(), w.float()).to(BF16))
    else:  # oneDNN's bf16 product, as F.linear computes it
        assert torch.equal(got, torch.nn.functional.linear(x, w))


@needs_ext
@pytest.mark.parametrize("m,n,k", [(5, 72, 200), (4, 70, 1024), (3, 49, 67)])
def test_a_bf16_weight_row_gives_the_same_bits_alone_and_in_a_batch(m, n, k):
    torch.manual_seed(1)
    x, w = torch.randn(m, k), _bf16(n, k, seed=2)
    batch = cpu_few_rows.linear(x, w)
    for i in range(m):
        assert torch.equal(cpu_few_rows.linear(x[i : i + 1], w), batch[i : i + 1])


@needs_ext
@pytest.mark.parametrize("t", [1, 3, 17, 150])  # 17 and 150 tokens: experts with 6+ pairs run oneDNN's bf16 product
def test_bf16_moe_matches_float64_and_the_float32_kernel(t):
    torch.manual_seed(t)
    e, d, inter, top_k = 9, 44, 20, 3
    w13, w2 = _bf16(e, 2 * inter, d, scale=0.1, seed=1), _bf16(e, d, inter, scale=0.1, seed=2)
    x = torch.randn(t, d)
    weights, ids = torch.rand(t, e).topk(top_k)
    ids = ids[:, torch.randperm(top_k)]
    ids[0, 1] = e  # a pair computed elsewhere adds nothing
    got = cpu_few_rows.moe(x, ids, weights, w13, w2)
    want = ref.moe_experts_reference(x.double(), ids, weights.double(), w13.double(), w2.double())
    # no expert reaches the oneDNN row count, and no AMX tiles
    loops = not AMX and int(ids[ids < e].flatten().bincount().max()) < BLAS_ROWS
    tol = dict(rtol=1e-5, atol=1e-5) if loops else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.double(), want, **tol)
    if loops:  # the float32 kernel on the widened weights
        assert torch.equal(got, cpu_few_rows.moe(x, ids, weights, w13.float(), w2.float()))
    out_bf16 = cpu_few_rows.moe(x.to(BF16), ids, weights, w13, w2)
    assert out_bf16.dtype == BF16
    torch.testing.assert_close(out_bf16.double(), want, rtol=3e-2, atol=3e-2)


@needs_ext
def test_bf16_moe_token_gives_the_same_bits_alone_and_in_a_batch():
    torch.manual_seed(2)
    w13, w2 = _bf16(16, 64, 64, scale=0.1, seed=4), _bf16(16, 64, 32, scale=0.1, seed=5)
    x = torch.randn(6, 64)
    weights, ids = torch.rand(6, 16).topk(3)
    assert ids.flatten().bincount().max() < BLAS_ROWS  # every expert in the widening loops (or the AMX tiles)
    batch = cpu_few_rows.moe(x, ids, weights, w13, w2)
    for i in range(6):
        assert torch.equal(
            cpu_few_rows.moe(x[i : i + 1], ids[i : i + 1], weights[i : i + 1], w13, w2), batch[i : i + 1]
        )


@needs_ext
@pytest.mark.parametrize("heads", [5, 16])
def test_mla_decode_over_a_bf16_cache(heads):
    torch.manual_seed(heads)
    r, rope, block_size, seqs = 64, 16, 4, 3
    cache = _bf16(40, r + rope, seed=heads)
    tables = torch.randperm(10)[:9].view(seqs, 3).int()
    lens = torch.tensor([12, 1, 7], dtype=torch.int32)
    q = torch.randn(seqs, heads, r + rope)
    got = cpu_few_rows.mla_decode(q, cache, tables, lens, block_size, r, 0.2)
    want = ref.mla_decode_reference(q.double(), cache.double(), tables, lens, 12, block_size, r, 0.2)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, cpu_few_rows.mla_decode(q, cache.float(), tables, lens, block_size, r, 0.2))


def _absorbed_case(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    heads, nope, rope, r, v, block_size, seqs = 3, 16, 8, 32, 16, 4, 3
    f = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale  # noqa: E731
    cache = f(24, r + rope).to(dtype)
    w_uk, w_uv = f(heads, nope, r, scale=0.2).to(dtype), f(heads, v, r, scale=0.2).to(dtype)
    pos_table = torch.arange(16).float()[:, None] * torch.linspace(0.1, 1, rope // 2)
    args = dict(
        q=f(seqs, heads, nope + rope),
        kv=f(seqs, r + rope),
        kv_norm_weight=1 + f(r, scale=0.1),
        eps=1e-6,
        cos=pos_table.cos(),
        sin=pos_table.sin(),
        positions=torch.tensor([5, 0, 9]),
        slots=torch.tensor([21, 4, 13]),
        w_uk=w_uk,
        w_uv=w_uv,
        cache=cache,
        block_tables=torch.tensor([[3, 5, 1], [1, 0, 0], [4, 3, 2]], dtype=torch.int32),
        context_lens=torch.tensor([6, 1, 10], dtype=torch.int32),
        block_size=block_size,
        scale=0.3,
    )
    return args


@needs_ext
def test_mla_decode_absorbed_with_a_bf16_cache_and_weights():
    # the float32 kernel on the widened cache and weights writes the newest latents unrounded: the
    # bf16 kernel's written rows are those rounded, and its outputs within bf16 rounding of its own
    a16 = _absorbed_case(BF16)
    a32 = {k: (v.float() if isinstance(v, torch.Tensor) and v.dtype == BF16 else v) for k, v in a16.items()}
    a32["cache"] = a16["cache"].float()
    got = cpu_few_rows.mla_decode_absorbed(**a16)
    want = cpu_few_rows.mla_decode_absorbed(**a32)
    slots = a16["slots"]
    assert torch.equal(a16["cache"][slots], a32["cache"][slots].to(BF16))
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@needs_ext
def test_the_cpu_backend_builds_the_kernels_for_bf16_models():
    assert CpuBackend(dtype=BF16).cxx
    assert not CpuBackend(dtype=torch.float16).cxx
    ops = CpuBackend(dtype=BF16)
    x, w = torch.randn(3, 32).to(BF16), _bf16(16, 32)
    assert torch.equal(ops.linear(x, w), cpu_few_rows.linear(x, w))


@needs_ext
def test_the_bf16_ffn_block_is_the_float32_block_rounded_once():
    from kimitui.kernels.cpu.decode_block import FfnBlockWeights

    torch.manual_seed(3)
    e, d, inter, top_k = 8, 64, 32, 2
    w13, w2 = _bf16(e, 2 * inter, d, scale=0.1, seed=6), _bf16(e, d, inter, scale=0.1, seed=7)
    gate_up, down = _bf16(2 * inter, d, scale=0.1, seed=8), _bf16(d, inter, scale=0.1, seed=9)
    common = dict(
        norm=1 + torch.randn(d) * 0.1,
        norm_eps=1e-6,
        router=torch.randn(e, d) * 0.1,
        bias=torch.randn(e) * 0.01,
        top_k=top_k,
        n_group=1,
        topk_group=1,
        sigmoid=True,
        norm_topk_prob=True,
        scaling=2.5,
    )
    blk16 = FfnBlockWeights(gate_up=gate_up, down=down, w13=w13, w2=w2, **common)
    blk32 = FfnBlockWeights(gate_up=gate_up.float(), down=down.float(), w13=w13.float(), w2=w2.float(), **common)
    x = torch.randn(5, d).to(BF16)  # 5 rows: below the oneDNN row count, every product in the C++ loops
    c16, c32 = torch.zeros(e, dtype=torch.long), torch.zeros(e, dtype=torch.long)
    mod = cpu_few_rows._module()
    saved = mod.moe_amx_rows(1 << 40, 0)  # the routed experts in the widening loops too, not the AMX tiles
    try:
        got = cpu_few_rows.ffn_block(x, c16, blk16, torch.empty(0))
    finally:
        mod.moe_amx_rows(*saved)
    want = cpu_few_rows.ffn_block(x.float(), c32, blk32, torch.empty(0))
    assert got.dtype == BF16 and torch.equal(got, want.to(BF16)) and torch.equal(c16, c32)
    if AMX:  # the experts on the tiles: their activations rounded to bf16, within bf16's rounding
        got = cpu_few_rows.ffn_block(x, torch.zeros(e, dtype=torch.long), blk16, torch.empty(0))
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@needs_ext
@pytest.mark.skipif(not NATIVE, reason="oneDNN has no native bf16 product on this CPU: the widening loops run instead")
@pytest.mark.parametrize("m", [6, 11, 16])
def test_bf16_linear_from_six_rows_is_onednn_on_a_packed_weight_bit_for_bit(m):
    """From 6 rows a bf16 linear is oneDNN's product on a copy of the weight packed once
    (cpu_onednn_packed.cpp): the same bits as F.linear, packed once per weight, repacked after the
    weight changes in place."""
    mod = cpu_few_rows._module()
    w = torch.randn(96, 64).bfloat16()
    x = torch.randn(m, 64).bfloat16()
    assert torch.equal(cpu_few_rows.linear(x, w), torch.nn.functional.linear(x, w))
    packed = mod.onednn_packed_count()  # (a dead weight's entry at the same address is replaced)
    assert packed >= 1
    assert torch.equal(cpu_few_rows.linear(x, w), torch.nn.functional.linear(x, w))
    assert mod.onednn_packed_count() == packed  # found again, not packed twice
    w.mul_(-0.5)  # a changed weight must not reuse its stale packed copy
    assert torch.equal(cpu_few_rows.linear(x, w), torch.nn.functional.linear(x, w))
    xf = torch.randn(m, 64)
    assert torch.equal(cpu_few_rows.linear(xf, w), torch.nn.functional.linear(xf.bfloat16(), w).float())
    with torch.inference_mode():
        wi = torch.randn(32, 64).bfloat16()
        assert torch.equal(cpu_few_rows.linear(x, wi), torch.nn.functional.linear(x, wi))


@pytest.mark.parametrize("native", [True, False])
def test_cpu_backend_bf16_bmm_and_mla_decode_run_in_float32_without_native_bf16(monkeypatch, native):
    """Without oneDNN's native bf16 product (AVX2 only), the backend's bf16 bmm and MLA decode of
    many sequences compute in float32 and round once; elsewhere they are the bf16 operations."""
    monkeypatch.setattr(cpu_linear, "onednn_bf16_native", lambda: native)
    be = CpuBackend()
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(3, 20, 16, generator=g).to(BF16), torch.randn(3, 16, 24, generator=g).to(BF16)
    want = torch.bmm(a, b) if native else torch.bmm(a.float(), b.float()).to(BF16)
    assert torch.equal(be.bmm(a, b), want)
    out = torch.empty(20, 3, 24, dtype=BF16)
    be.bmm(a, b, out=out.transpose(0, 1))
    assert torch.equal(out.transpose(0, 1), want)
    seqs, heads, r, rope, block_size = 20, 4, 32, 8, 4  # more sequences than the C++ decode takes
    cache = torch.randn(seqs * 3 * block_size, r + rope, generator=g).to(BF16)
    tables = torch.randperm(seqs * 3, generator=g)[: seqs * 3].view(seqs, 3).int()
    lens = torch.randint(1, 3 * block_size + 1, (seqs,), generator=g).int()
    q = torch.randn(seqs, heads, r + rope, generator=g).to(BF16)
    args = (cache, tables, lens, int(lens.max()), block_size, r, 0.2)
    got = be.mla_decode(q, *args)
    assert got.dtype == BF16
    want = ref.mla_decode_reference(q if native else q.float(), *args)
    assert torch.equal(got, want.to(BF16))
    torch.testing.assert_close(
        got.double(), ref.mla_decode_reference(q.double(), cache.double(), *args[1:]), rtol=3e-2, atol=3e-2
    )
