"""Kimi K3's SiTU activation in every CPU MoE path against a float64 oracle written out here: the
reference (kernels.reference), the PyTorch CPU paths (kernels.cpu_moe, torch's int4 GEMM included),
the float32 C++ MoE (kernels.cpu_few_rows) and the packed INT4 / MXFP4 C++ MoE (kernels.cpu_quant_moe,
every instruction set path), each also through the CPU backend's op."""

from __future__ import annotations

import pytest
import torch

from kimitui.kernels import reference as R
from kimitui.kernels.activation import GatedActivation
from kimitui.kernels.cpu import few_rows as cpu_few_rows
from kimitui.kernels.cpu import moe as cpu_moe
from kimitui.kernels.cpu import quant_moe as cpu_quant_moe
from kimitui.kernels.cpu.backend import CpuBackend
from kimitui.kernels.settings import KernelSettings
from tests.helpers.moe_oracle import moe64

# beta 0.5 with up bounded at 0.75; Moonshot's default beta 1.0 with up unbounded
ACTS = [GatedActivation("situ", 0.5, 0.75), GatedActivation("situ", 1.0, None)]
ACT_IDS = ["beta0.5_lin0.75", "beta1_unbounded"]


def _case(t, e=5, d=64, inter=32, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g)
    ids = torch.randint(0, e + 1, (t, k), generator=g)  # id e: computed elsewhere, adds nothing
    weights = torch.rand(t, k, generator=g)
    # gate and up reach several betas (std ~2): the tanh bounds matter, not only their linear part
    w13, w2 = torch.randn(e, 2 * inter, d, generator=g) / 4, torch.randn(e, d, inter, generator=g) / 4
    return x, ids, weights, w13, w2


def _err(got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def _stack(quantize, w):
    return [torch.stack(p) for p in zip(*[quantize(w[i]) for i in range(w.shape[0])])]


@pytest.mark.parametrize("act", ACTS, ids=ACT_IDS)
@pytest.mark.parametrize("t", [1, 9])
def test_dense_paths(act, t):
    x, ids, w, w13, w2 = _case(t, seed=t)
    want = moe64(x, ids, w, w13, w2, act)
    silu = R.moe_experts_reference(x, ids, w, w13, w2)
    assert _err(silu, want) > 1e-2  # SiTU is not SwiGLU here: the oracle can tell them apart
    assert _err(R.moe_experts_reference(x, ids, w, w13, w2, act), want) < 1e-5
    assert _err(cpu_moe.moe_experts(x, ids, w, w13, w2, act), want) < 1e-5
    if cpu_few_rows.available():
        got = cpu_few_rows.moe(x, ids, w, w13, w2, act="situ", beta=act.beta, linear_beta=act.linear_beta)
        assert _err(got, want) < 1e-5
        # a batch large enough for the BLAS branch of an expert (kGemmPairs pairs)
        xb, idb, wb, _, _ = _case(200, seed=5)
        got = cpu_few_rows.moe(xb, idb, wb, w13, w2, act="situ", beta=act.beta, linear_beta=act.linear_beta)
        assert _err(got, moe64(xb, idb, wb, w13, w2, act)) < 1e-5
    for cpu_kernels in (True, False):
        ops = CpuBackend(KernelSettings(cpu_kernels=cpu_kernels))
        assert _err(ops.moe_experts(x, ids, w, w13, w2, activation=act), want) < 1e-5


@pytest.mark.parametrize("act", ACTS, ids=ACT_IDS)
def test_quantised_pytorch_paths(act):
    x, ids, w, w13, w2 = _case(7, seed=3)
    p13, s13 = _stack(R.quantize_int4, w13)
    p2, s2 = _stack(R.quantize_int4, w2)
    d13, d2 = R.dequant_int4(p13, s13, 64, 32, torch.float64), R.dequant_int4(p2, s2, 32, 32, torch.float64)
    want = moe64(x, ids, w, d13, d2, act)
    assert _err(R.moe_experts_reference_w4a16(x, ids, w, p13, s13, p2, s2, 32, act), want) < 1e-5
    assert _err(cpu_moe.moe_experts_w4a16(x, ids, w, p13, s13, p2, s2, 32, act), want) < 1e-5
    m13, ms13 = _stack(R.quantize_mxfp4, w13)
    m2, ms2 = _stack(R.quantize_mxfp4, w2)
    want = moe64(x, ids, w, R.dequant_mxfp4(m13, ms13, torch.float64), R.dequant_mxfp4(m2, ms2, torch.float64), act)
    assert _err(R.moe_experts_reference_mxfp4(x, ids, w, m13, ms13, m2, ms2, act), want) < 1e-5
    assert _err(cpu_moe.moe_experts_mxfp4(x, ids, w, m13, ms13, m2, ms2, act), want) < 1e-5
    block = (16, 32)
    f13, fs13 = _stack(lambda m: R.quantize_fp8_block(m, block), w13)
    f2, fs2 = _stack(lambda m: R.quantize_fp8_block(m, block), w2)
    want = moe64(
        x,
        ids,
        w,
        R.dequant_fp8_block(f13, fs13, block, torch.float64),
        R.dequant_fp8_block(f2, fs2, block, torch.float64),
        act,
    )
    assert _err(R.moe_experts_reference_fp8(x, ids, w, f13, fs13, f2, fs2, block, act), want) < 1e-5
    assert _err(cpu_moe.moe_experts_fp8(x, ids, w, f13, fs13, f2, fs2, block, act), want) < 1e-5
    ops = CpuBackend(KernelSettings(cpu_kernels=False))
    assert _err(ops.moe_experts_fp8(x, ids, w, f13, fs13, f2, fs2, block, activation=act), want) < 1e-5


@pytest.mark.skipif(not cpu_moe.int4pack_cpu_supported(64, 64, 32), reason="no torch CPU int4 GEMM")
def test_int4pack_path():
    act = ACTS[0]
    x, ids, w, w13, w2 = _case(6, seed=4)
    p13, s13 = _stack(R.quantize_int4, w13)
    p2, s2 = _stack(R.quantize_int4, w2)
    want = moe64(
        x, ids, w, R.dequant_int4(p13, s13, 64, 32, torch.float64), R.dequant_int4(p2, s2, 32, 32, torch.float64), act
    )
    packed = (
        *cpu_moe.prepack_int4_stack(p13, s13, 64, 32, torch.bfloat16),
        *cpu_moe.prepack_int4_stack(p2, s2, 32, 32, torch.bfloat16),
    )
    got = cpu_moe.moe_experts_int4pack_cpu(x.bfloat16(), ids, w, *packed, 32, act)
    assert _err(got, want) < 3e-2  # bf16 activations and products


QUANT_ISAS = cpu_quant_moe.supported_isas() if cpu_quant_moe.available() else []


@pytest.mark.skipif(not QUANT_ISAS, reason="the C++ extension does not build here")
@pytest.mark.parametrize("isa", QUANT_ISAS)
@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
@pytest.mark.parametrize("act", ACTS, ids=ACT_IDS)
def test_packed_cxx_moe(isa, fmt, act):
    x, ids, w, w13, w2 = _case(9, d=96, inter=64, seed=6)
    if fmt == "int4":
        parts13 = [R.quantize_int4(w13[i], 32) for i in range(w13.shape[0])]
        parts2 = [R.quantize_int4(w2[i], 32) for i in range(w2.shape[0])]
        p13, s13 = torch.stack([p for p, _ in parts13]), torch.stack([s.bfloat16() for _, s in parts13])
        p2, s2 = torch.stack([p for p, _ in parts2]), torch.stack([s.bfloat16() for _, s in parts2])
        d13, d2 = R.dequant_int4(p13, s13, 96, 32, torch.float64), R.dequant_int4(p2, s2, 64, 32, torch.float64)
    else:
        p13, s13 = _stack(R.quantize_mxfp4, w13)
        p2, s2 = _stack(R.quantize_mxfp4, w2)
        d13, d2 = R.dequant_mxfp4(p13, s13, torch.float64), R.dequant_mxfp4(p2, s2, torch.float64)
    want = moe64(x, ids, w, d13, d2, act)
    for xs, idx, ws, ref in ((x, ids, w, want), (x[:1], ids[:1], w[:1], want[:1])):
        got = cpu_quant_moe.moe(
            xs, idx, ws, fmt, p13, s13, p2, s2, 32, isa_name=isa, act="situ", beta=act.beta, linear_beta=act.linear_beta
        )
        assert _err(got, ref) < 1e-5, (fmt, isa)
    ops = CpuBackend(KernelSettings(cpu_kernels=True))
    op = ops.moe_experts_w4a16 if fmt == "int4" else ops.moe_experts_mxfp4
    args = (p13, s13, p2, s2, 32) if fmt == "int4" else (p13, s13, p2, s2)
    assert _err(op(x, ids, w, *args, activation=act), want) < 1e-5


def test_bad_activation_is_named():
    x, ids, w, w13, w2 = _case(2)
    if cpu_few_rows.available():
        with pytest.raises(ValueError, match="gelu"):
            cpu_few_rows.moe(x, ids, w, w13, w2, act="gelu")
    if cpu_quant_moe.available():
        p13, s13 = _stack(R.quantize_mxfp4, w13)
        p2, s2 = _stack(R.quantize_mxfp4, w2)
        with pytest.raises(ValueError, match="betas"):
            cpu_quant_moe.moe(x, ids, w, "mxfp4", p13, s13, p2, s2, act="situ", beta=0.0)
