"""The CPU backend's PyTorch paths (kernels.cpu_moe, kernels.cpu_linear) against the reference oracle."""

import pytest
import torch

from kimitui.kernels import reference as ref
from kimitui.kernels.cpu import moe as cpu_moe
from kimitui.kernels.cpu.backend import CpuBackend
from kimitui.kernels.settings import KernelSettings


def _case(t, e=6, d=32, inter=16, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    w13, w2 = torch.randn(e, 2 * inter, d, generator=g) / 4, torch.randn(e, d, inter, generator=g) / 4
    return x, ids, weights, w13, w2


# 1 token: the single-token loop; 9: one gather of every pair; 2100 x 2 pairs of 512 floats (8.6 MB):
# each expert gathers its own rows.
@pytest.mark.parametrize("t,d", [(1, 32), (9, 32), (2100, 512)])
def test_grouped_moe_matches_the_oracle(t, d):
    x, ids, weights, w13, w2 = _case(t, d=d, seed=t)
    ids[0, 1] = w13.shape[0]  # a pair computed elsewhere adds nothing
    want = ref.moe_experts_reference(x, ids, weights, w13, w2)
    torch.testing.assert_close(cpu_moe.moe_experts(x, ids, weights, w13, w2), want, rtol=1e-5, atol=1e-5)


def test_quantised_grouped_moe_matches_the_oracle():
    x, ids, weights, w13, w2 = _case(7, d=64, inter=32, seed=3)

    def stack(quantize, w):
        parts = [quantize(w[i]) for i in range(w.shape[0])]
        return [torch.stack(p) for p in zip(*parts)]

    p13, s13 = stack(ref.quantize_int4, w13)
    p2, s2 = stack(ref.quantize_int4, w2)
    torch.testing.assert_close(
        cpu_moe.moe_experts_w4a16(x, ids, weights, p13, s13, p2, s2, 32),
        ref.moe_experts_reference_w4a16(x, ids, weights, p13, s13, p2, s2, 32),
        rtol=1e-5,
        atol=1e-5,
    )
    m13, ms13 = stack(ref.quantize_mxfp4, w13)
    m2, ms2 = stack(ref.quantize_mxfp4, w2)
    torch.testing.assert_close(
        cpu_moe.moe_experts_mxfp4(x, ids, weights, m13, ms13, m2, ms2),
        ref.moe_experts_reference_mxfp4(x, ids, weights, m13, ms13, m2, ms2),
        rtol=1e-5,
        atol=1e-5,
    )
    f13, fs13 = stack(lambda w: ref.quantize_fp8_block(w, (16, 32)), w13)
    f2, fs2 = stack(lambda w: ref.quantize_fp8_block(w, (16, 32)), w2)
    torch.testing.assert_close(
        cpu_moe.moe_experts_fp8(x, ids, weights, f13, fs13, f2, fs2, (16, 32)),
        ref.moe_experts_reference_fp8(x, ids, weights, f13, fs13, f2, fs2, (16, 32)),
        rtol=1e-5,
        atol=1e-5,
    )


def test_cpu_backend_without_the_extension_matches_the_oracle():
    ops = CpuBackend(KernelSettings(cpu_kernels=False))
    assert not ops.cxx
    x, ids, weights, w13, w2 = _case(5, seed=9)
    torch.testing.assert_close(
        ops.moe_experts(x, ids, weights, w13, w2),
        ref.moe_experts_reference(x, ids, weights, w13, w2),
        rtol=1e-5,
        atol=1e-5,
    )
    w = torch.randn(40, 32)
    torch.testing.assert_close(ops.linear(x, w), ref.linear(x, w), rtol=1e-5, atol=1e-5)
    norm = torch.rand(32) + 0.5
    assert torch.equal(ops.rms_norm(x, norm, 1e-6), ref.rms_norm(x, norm, 1e-6))  # F.rms_norm: the same bits
    with pytest.raises(ValueError, match="input features"):
        p, s = ref.quantize_int4(w)
        ops.linear_w4a16(x, p, s, 64)
