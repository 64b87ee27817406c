"""PyTorch references: quantisation round trips, bit layouts, linear and MoE semantics."""

import pytest
import torch
import torch.nn.functional as F

from kimitui.kernels import reference as ref
from kimitui.kernels.cpu import moe as cpu_moe


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# --- FP8 block -------------------------------------------------------------------------------


def test_fp8_block_round_trip_partial_blocks():
    w = torch.randn(200, 300) * torch.logspace(-2, 1, 300)  # columns with very different ranges
    q, s = ref.quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (2, 3)
    deq = ref.dequant_fp8_block(q, s)
    # e4m3 keeps 3 mantissa bits (relative error <= 2^-4); subnormals lose absolute 2^-9 * scale.
    bound = w.abs() * 2**-4 + ref._expand_blocks(s, 128, 128, 200, 300) * 2**-9
    assert ((deq - w).abs() <= bound + 1e-12).all()


def test_fp8_block_dequant_matches_explicit_blocks():
    w = torch.randn(5, 7).to(torch.float8_e4m3fn)
    s = torch.rand(3, 3) + 0.5  # block (2, 3): ceil(5/2) x ceil(7/3)
    deq = ref.dequant_fp8_block(w, s, block=(2, 3), dtype=torch.bfloat16)
    expected = torch.empty(5, 7)
    for i in range(5):
        for j in range(7):
            expected[i, j] = w[i, j].float() * s[i // 2, j // 3]
    assert deq.dtype == torch.bfloat16
    torch.testing.assert_close(deq, expected.bfloat16())


def test_fp8_block_zero_block_is_exact():
    w = torch.zeros(4, 4)
    q, s = ref.quantize_fp8_block(w, block=(2, 2))
    assert torch.isfinite(s).all()
    assert (ref.dequant_fp8_block(q, s, block=(2, 2)) == 0).all()


# --- INT4 pack-quantized ---------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 7, 8, 13, 64, 100])
def test_int4_pack_unpack_exact(k):
    q = torch.randint(-8, 8, (6, k), dtype=torch.int8)
    packed = ref.pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (6, -(-k // 8))
    assert torch.equal(ref.unpack_int4(packed, k), q)


def test_int4_bit_layout_and_negative_words():
    # u = q + 8; column j at bits 4*(j % 8): u = 0..7 gives 0x76543210.
    q = (torch.arange(8, dtype=torch.int8) - 8).view(1, 8)
    assert ref.pack_int4(q).item() == 0x76543210
    # All u = 15 is 0xFFFFFFFF, i.e. int32 -1; u = 8 in the top nibble makes the word negative.
    assert ref.pack_int4(torch.full((1, 8), 7, dtype=torch.int8)).item() == -1
    top = torch.zeros(1, 8, dtype=torch.int8)
    assert ref.pack_int4(top).item() == 0x88888888 - 2**32
    words = torch.tensor([[-1, 0x88888888 - 2**32, -(2**31)]], dtype=torch.int32)
    q = ref.unpack_int4(words, 24)
    assert (q[0, :8] == 7).all() and (q[0, 8:16] == 0).all()
    assert q[0, 23] == 0 and (q[0, 16:23] == -8).all()  # 0x80000000: top nibble 8, rest 0


def test_int4_nibbles_byte_path_equals_shift_path(monkeypatch):
    words = torch.randint(-(2**31), 2**31 - 1, (3, 2, 5), dtype=torch.int32)
    fast = ref.int4_nibbles(words, 37)
    monkeypatch.setattr(ref.sys, "byteorder", "big")  # the word-shift path any byte order can use
    slow = ref.int4_nibbles(words, 37)
    assert fast.dtype == slow.dtype == torch.uint8 and fast.shape == (3, 2, 37)
    assert torch.equal(fast, slow)


def test_int4_quantize_convention_and_error():
    w = torch.randn(4, 50)
    packed, scale = ref.quantize_int4(w, group_size=32)
    assert scale.shape == (4, 2) and scale.dtype == torch.float32
    amax0 = w[:, :32].abs().amax(dim=1)
    torch.testing.assert_close(scale[:, 0], amax0 / 7.5)  # compressed-tensors: amax / (15 / 2)
    deq = ref.dequant_int4(packed, scale, 50, group_size=32)
    s = scale.repeat_interleave(32, dim=1)[:, :50]
    assert ((deq - w).abs() <= s / 2 + 1e-6).all()


def test_int4_quantize_bf16_scale():
    w = torch.randn(3, 64, dtype=torch.bfloat16)
    packed, scale = ref.quantize_int4(w)
    assert scale.dtype == torch.bfloat16
    deq = ref.dequant_int4(packed, scale, 64, dtype=torch.bfloat16)
    assert (deq.float() - w.float()).abs().max() <= scale.float().max() / 2 + 1e-2


# --- MXFP4 -----------------------------------------------------------------------------------


def test_mxfp4_decode_every_byte():
    packed = torch.arange(256, dtype=torch.uint8).view(4, 64)  # K = 128
    scale = torch.full((4, 4), 127, dtype=torch.uint8)
    deq = ref.dequant_mxfp4(packed, scale).view(-1, 2)
    lut = torch.tensor(ref.E2M1_VALUES)
    codes = torch.arange(256)
    torch.testing.assert_close(deq[:, 0], lut[codes & 0xF])  # low nibble = even column
    torch.testing.assert_close(deq[:, 1], lut[codes >> 4])


def test_mxfp4_scale_exponent():
    packed = torch.full((1, 16), 0x22, dtype=torch.uint8)  # every value 1.0
    for byte, factor in [(127, 1.0), (128, 2.0), (120, 2.0**-7), (0, 2.0**-127)]:
        scale = torch.tensor([[byte]], dtype=torch.uint8)
        assert (ref.dequant_mxfp4(packed, scale) == factor).all()
    assert ref.dequant_mxfp4(packed, torch.tensor([[255]], dtype=torch.uint8)).isnan().all()


def test_mxfp4_round_trip():
    w = torch.randn(8, 96) * 3
    packed, scale = ref.quantize_mxfp4(w)
    assert packed.shape == (8, 48) and scale.shape == (8, 3) and packed.dtype == scale.dtype == torch.uint8
    deq = ref.dequant_mxfp4(packed, scale)
    step = torch.exp2(scale.float() - 127).repeat_interleave(32, dim=1)
    assert ((deq - w).abs() <= torch.maximum(w.abs(), step) / 4 + 1e-6).all()
    # Representable values survive exactly.
    exact = ref.dequant_mxfp4(packed, scale)
    p2, s2 = ref.quantize_mxfp4(exact)
    assert torch.equal(ref.dequant_mxfp4(p2, s2), exact)


def test_mxfp4_rejects_ragged_k():
    with pytest.raises(ValueError, match="multiple of 32"):
        ref.quantize_mxfp4(torch.randn(2, 40))


# --- linear ----------------------------------------------------------------------------------


def test_linears_equal_dequant_then_matmul():
    x = torch.randn(2, 3, 64)  # [B, S, K]
    w = torch.randn(48, 64)
    q8, s8 = ref.quantize_fp8_block(w, block=(32, 32))
    torch.testing.assert_close(ref.linear_fp8_block(x, q8, s8, (32, 32)), x @ ref.dequant_fp8_block(q8, s8, (32, 32)).T)
    p4, s4 = ref.quantize_int4(w)
    torch.testing.assert_close(ref.linear_w4a16(x, p4, s4, 64), x @ ref.dequant_int4(p4, s4, 64).T)
    pm, sm = ref.quantize_mxfp4(w)
    out = ref.linear_mxfp4(x.bfloat16(), pm, sm)
    assert out.shape == (2, 3, 48) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), x @ ref.dequant_mxfp4(pm, sm).T, rtol=2e-2, atol=0.5)


def test_rms_norm_hf_convention():
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    weight = torch.rand(16, dtype=torch.bfloat16) + 0.5
    out = ref.rms_norm(x, weight, 1e-6)
    h = x.float() / torch.sqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, weight * h.bfloat16())


def test_reference_stays_on_device():
    # meta tensors catch any tensor silently created on the CPU.
    d = torch.device("meta")
    x = torch.empty(2, 64, device=d)
    assert ref.dequant_int4(torch.empty(4, 8, dtype=torch.int32, device=d), torch.empty(4, 2, device=d), 64).is_meta
    assert ref.linear_fp8_block(
        x, torch.empty(4, 64, dtype=torch.float8_e4m3fn, device=d), torch.empty(1, 1, device=d)
    ).is_meta
    assert ref.unpack_int4(torch.empty(4, 8, dtype=torch.int32, device=d), 64).is_meta


# --- MoE -------------------------------------------------------------------------------------


def _naive_moe(x, topk_ids, topk_weights, w13, w2):
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate_up = w13[e].float() @ x[t].float()
            h = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += topk_weights[t, j].float() * (w2[e].float() @ h)
    return out


def _routing(t=6, e=5, k=2):
    topk_ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])  # expert 4 may stay idle
    topk_ids[:, 0] = torch.arange(t) % 3  # make some experts shared by several tokens
    topk_ids[:, 1] = 3
    return topk_ids, torch.rand(t, k)


def test_moe_reference_matches_naive_loop():
    d, inter = 16, 12
    topk_ids, topk_weights = _routing()
    x = torch.randn(6, d)
    w13, w2 = torch.randn(5, 2 * inter, d) / 4, torch.randn(5, d, inter) / 4
    out = ref.moe_experts_reference(x, topk_ids, topk_weights, w13, w2)
    torch.testing.assert_close(out, _naive_moe(x, topk_ids, topk_weights, w13, w2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t", [1, 6])
def test_moe_reference_skips_pairs_computed_elsewhere(t):
    # id == E marks a pair another rank or host RAM computes: the single-token and grouped paths
    # both leave it out.
    d, inter, e = 16, 12, 5
    topk_ids, topk_weights = _routing(t=t)
    x = torch.randn(t, d)
    w13, w2 = torch.randn(e, 2 * inter, d) / 4, torch.randn(e, d, inter) / 4
    elsewhere = torch.zeros_like(topk_ids, dtype=torch.bool)
    elsewhere[:, 1] = True
    got = ref.moe_experts_reference(x, topk_ids.masked_fill(elsewhere, e), topk_weights, w13, w2)
    expected = _naive_moe(x, topk_ids, topk_weights.masked_fill(elsewhere, 0.0), w13, w2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_moe_quantised_references_match_naive_loop():
    d, inter, e = 64, 32, 5
    topk_ids, topk_weights = _routing(e=e)
    x = torch.randn(6, d)
    w13, w2 = torch.randn(e, 2 * inter, d) / 4, torch.randn(e, d, inter) / 4

    def stack(fn, w):
        parts = [fn(w[i]) for i in range(e)]
        return [torch.stack(p) for p in zip(*parts)]

    p13, s13 = stack(ref.quantize_int4, w13)
    p2, s2 = stack(ref.quantize_int4, w2)
    dq13 = ref.dequant_int4(p13, s13, d)
    dq2 = ref.dequant_int4(p2, s2, inter)
    got = ref.moe_experts_reference_w4a16(x, topk_ids, topk_weights, p13, s13, p2, s2, 32)
    torch.testing.assert_close(got, _naive_moe(x, topk_ids, topk_weights, dq13, dq2), rtol=1e-5, atol=1e-5)

    m13, ms13 = stack(ref.quantize_mxfp4, w13)
    m2, ms2 = stack(ref.quantize_mxfp4, w2)
    got = ref.moe_experts_reference_mxfp4(x, topk_ids, topk_weights, m13, ms13, m2, ms2)
    expected = _naive_moe(x, topk_ids, topk_weights, ref.dequant_mxfp4(m13, ms13), ref.dequant_mxfp4(m2, ms2))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    block = (16, 32)
    f13, fs13 = stack(lambda w: ref.quantize_fp8_block(w, block), w13)
    f2, fs2 = stack(lambda w: ref.quantize_fp8_block(w, block), w2)
    got = ref.moe_experts_reference_fp8(x, topk_ids, topk_weights, f13, fs13, f2, fs2, block)
    expected = _naive_moe(
        x, topk_ids, topk_weights, ref.dequant_fp8_block(f13, fs13, block), ref.dequant_fp8_block(f2, fs2, block)
    )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_linear_cpu_equals_f_linear_for_every_row_count():
    import torch.nn.functional as F

    from kimitui.kernels.cpu.linear import linear_cpu

    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 128, generator=g)
    for rows in (1, 2, 3, 4, 5, 8, 9, 17, 64, 65, 200):
        x = torch.randn(rows, 128, generator=g)
        torch.testing.assert_close(linear_cpu(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 3, 128, generator=g)  # leading dims kept
    torch.testing.assert_close(linear_cpu(x3, w), F.linear(x3, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("native", [True, False])
def test_linear_cpu_bf16_is_one_rounding_of_a_float32_product_without_native_bf16(monkeypatch, native):
    """Where oneDNN has no native bf16 product (AVX2 only), bf16 products of 6 rows or more run in
    float32 on the widened weight and round once; elsewhere they are F.linear's bf16 product."""
    import torch.nn.functional as F

    from kimitui.kernels.cpu import linear as cpu_linear

    monkeypatch.setattr(cpu_linear, "onednn_bf16_native", lambda: native)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g).bfloat16()
    for rows in (1, 5, 6, 40):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        got = cpu_linear.linear_cpu(x, w)
        assert got.dtype == torch.bfloat16
        widened = F.linear(x.float(), w.float()).bfloat16()
        want = widened if rows >= 6 and not native else F.linear(x, w)
        assert torch.equal(got, want)
        torch.testing.assert_close(got.double(), x.double() @ w.double().T, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not cpu_moe.int4pack_cpu_supported(64, 64, 32), reason="torch has no CPU int4 GEMM")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_int4pack_cpu_experts_equal_dequantised_experts(dtype, tol):
    d, inter, e = 64, 32, 5
    topk_ids, topk_weights = _routing(e=e)
    x = torch.randn(6, d)
    w13, w2 = torch.randn(e, 2 * inter, d) / 4, torch.randn(e, d, inter) / 4
    q13 = [ref.quantize_int4(w13[i]) for i in range(e)]
    q2 = [ref.quantize_int4(w2[i]) for i in range(e)]
    packs13 = [cpu_moe.prepack_int4_cpu(p, s, d, 32, dtype) for p, s in q13]
    packs2 = [cpu_moe.prepack_int4_cpu(p, s, inter, 32, dtype) for p, s in q2]
    got = cpu_moe.moe_experts_int4pack_cpu(
        x.to(dtype),
        topk_ids,
        topk_weights,
        torch.stack([p for p, _ in packs13]),
        torch.stack([s for _, s in packs13]),
        torch.stack([p for p, _ in packs2]),
        torch.stack([s for _, s in packs2]),
        32,
    )
    assert got.dtype == dtype
    dq13 = torch.stack([ref.dequant_int4(p, s, d) for p, s in q13])
    dq2 = torch.stack([ref.dequant_int4(p, s, inter) for p, s in q2])
    expected = _naive_moe(x, topk_ids, topk_weights, dq13, dq2)
    torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol * expected.abs().max().item())
