"""Compiled Triton kernels vs reference on a real CUDA/ROCm device, bf16, Kimi-like tile shapes."""

import pytest
import torch

from kimitui.kernels import reference as ref
from kimitui.kernels.triton.backend import TritonBackend

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device"),
]


@pytest.fixture
def dev(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch.manual_seed(0)
    return torch.device("cuda")


def _close_bf16(got, expected):
    torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2 * expected.abs().max().item())


@pytest.mark.parametrize("m", [1, 7, 64])
def test_quantised_linears_bf16(dev, m):
    x = torch.randn(m, 7168, device=dev, dtype=torch.bfloat16)
    w = torch.randn(512, 7168, device=dev) / 64
    p, s = ref.quantize_int4(w.bfloat16())
    _close_bf16(TritonBackend().linear_w4a16(x, p, s, 7168), ref.linear_w4a16(x, p, s, 7168))
    q, si = ref.quantize_fp8_block(w)
    _close_bf16(TritonBackend().linear_fp8_block(x, q, si), ref.linear_fp8_block(x, q, si))
    pm, sm = ref.quantize_mxfp4(w)
    _close_bf16(TritonBackend().linear_mxfp4(x, pm, sm), ref.linear_mxfp4(x, pm, sm))


def test_rms_norm_bf16(dev):
    x = torch.randn(4, 7168, device=dev, dtype=torch.bfloat16)
    weight = torch.rand(7168, device=dev, dtype=torch.bfloat16)
    from kimitui.kernels.triton.rms_norm import rms_norm

    _close_bf16(rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("t", [1, 33])
def test_fused_moe_bf16(dev, t):
    e, d, inter, k = 64, 1024, 256, 8
    x = torch.randn(t, d, device=dev, dtype=torch.bfloat16)
    scores = torch.rand(t, e, device=dev)
    topk_weights, topk_ids = scores.topk(k, dim=-1)
    w13 = (torch.randn(e, 2 * inter, d, device=dev) / 32).bfloat16()
    w2 = (torch.randn(e, d, inter, device=dev) / 16).bfloat16()
    _close_bf16(
        TritonBackend().moe_experts(x, topk_ids, topk_weights, w13, w2),
        ref.moe_experts_reference(x, topk_ids, topk_weights, w13, w2),
    )
    packed = [ref.quantize_int4(w13[i]) for i in range(e)]
    p13, s13 = torch.stack([p for p, _ in packed]), torch.stack([s for _, s in packed])
    packed = [ref.quantize_int4(w2[i]) for i in range(e)]
    p2, s2 = torch.stack([p for p, _ in packed]), torch.stack([s for _, s in packed])
    _close_bf16(
        TritonBackend().moe_experts_w4a16(x, topk_ids, topk_weights, p13, s13, p2, s2),
        ref.moe_experts_reference_w4a16(x, topk_ids, topk_weights, p13, s13, p2, s2),
    )


@pytest.mark.parametrize("t", [1, 33])
def test_fused_moe_mxfp4_fp8_bf16_with_pairs_elsewhere(dev, t):
    e, d, inter, k = 16, 1024, 256, 4
    x = torch.randn(t, d, device=dev, dtype=torch.bfloat16)
    topk_weights, topk_ids = torch.rand(t, e, device=dev).topk(k, dim=-1)
    topk_ids[0, -1] = e  # a pair held by another rank
    w13 = torch.randn(e, 2 * inter, d, device=dev) / 32
    w2 = torch.randn(e, d, inter, device=dev) / 16

    def stack(fn, w):
        return [torch.stack(p) for p in zip(*[fn(w[i]) for i in range(e)])]

    m13, ms13 = stack(ref.quantize_mxfp4, w13)
    m2, ms2 = stack(ref.quantize_mxfp4, w2)
    _close_bf16(
        TritonBackend().moe_experts_mxfp4(x, topk_ids, topk_weights, m13, ms13, m2, ms2),
        ref.moe_experts_reference_mxfp4(x, topk_ids, topk_weights, m13, ms13, m2, ms2),
    )
    f13, fs13 = stack(ref.quantize_fp8_block, w13)
    f2, fs2 = stack(ref.quantize_fp8_block, w2)
    _close_bf16(
        TritonBackend().moe_experts_fp8(x, topk_ids, topk_weights, f13, fs13, f2, fs2),
        ref.moe_experts_reference_fp8(x, topk_ids, topk_weights, f13, fs13, f2, fs2),
    )


def test_mla_decode_bf16_k2_shapes(dev):
    # K2: kv_lora_rank 512, rope 64; 64 heads; scattered blocks; contexts from 1 to 3000 tokens.
    r, rope, heads, block = 512, 64, 64, 16
    lens = [1, 17, 700, 3000]
    blocks = [-(-n // block) for n in lens]
    perm = torch.randperm(sum(blocks), device=dev).to(torch.int32)
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32, device=dev)
    at = 0
    for i, n in enumerate(blocks):
        table[i, :n] = perm[at : at + n]
        at += n
    cache = torch.randn(sum(blocks) * block, r + rope, device=dev, dtype=torch.bfloat16)
    q = torch.randn(len(lens), heads, r + rope, device=dev, dtype=torch.bfloat16)
    ctx = torch.tensor(lens, dtype=torch.int32, device=dev)
    _close_bf16(
        TritonBackend().mla_decode(q, cache, table, ctx, max(lens), block, r, 0.04),
        ref.mla_decode_reference(q, cache, table, ctx, max(lens), block, r, 0.04),
    )
