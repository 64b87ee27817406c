"""The CPU's W4A8 expert products (kernels/cpu/csrc/cpu_quant_moe_w4a8.cpp, KIMITUI_CPU_W4A8): bit for bit
against the PyTorch specification of the same maths (kernels/cpu/quant_moe_w4a8.py) on every int8 path this
CPU runs, and within the int8 rounding's error of the float (bf16-activation) path."""

from __future__ import annotations

import pytest
import torch

from kimitui.kernels import reference as R
from kimitui.kernels.activation import GatedActivation
from kimitui.kernels.cpu import quant_moe as cpu_quant_moe
from kimitui.kernels.cpu import quant_moe_layout as layout
from kimitui.kernels.cpu import quant_moe_w4a8 as spec
from kimitui.kernels.cpu.backend import CpuBackend
from kimitui.kernels.settings import KernelSettings
from tests.helpers.moe_oracle import moe64

pytestmark = pytest.mark.skipif(not cpu_quant_moe.available(), reason="the C++ extension does not build here")

PATHS = cpu_quant_moe.supported_w4a8() if cpu_quant_moe.available() else []


def _weights(fmt, e, n, k, seed, group=32):
    """Checkpoint-layout packed weights [e, n, *], their scales, and float64 dequantised values."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=g)
    if fmt == "int4":
        parts = [R.quantize_int4(w[i], group) for i in range(e)]
        packed, scale = torch.stack([p for p, _ in parts]), torch.stack([s.to(torch.bfloat16) for _, s in parts])
        return packed, scale, R.dequant_int4(packed, scale, k, group, torch.float64)
    parts = [R.quantize_mxfp4(w[i]) for i in range(e)]
    packed, scale = torch.stack([p for p, _ in parts]), torch.stack([s for _, s in parts])
    return packed, scale, R.dequant_mxfp4(packed, scale, torch.float64)


def _activations(t, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * torch.logspace(-3, 2, t)[:, None]  # rows of very different sizes
    x[0, :32] = 0  # a group of zeros (scale 0)
    x[-1, 5] = 1e4  # one outlier dominating its group
    return x


# a partial last group (K 72), INT4 group 128 (scales repeated per 32 columns), rows past whole tiles
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt,n,k,group", [("int4", 40, 72, 32), ("int4", 33, 256, 128), ("mxfp4", 50, 96, 32)])
def test_one_matrix_is_bit_exact_against_the_specification(path, fmt, n, k, group):
    packed, scale, _ = _weights(fmt, 1, n, k, 1, group)
    tiles = layout.repack(fmt, packed, scale, k, group)
    codes, scales = spec.int_codes(fmt, packed[0], scale[0], k, group)
    for t in (1, 2, 5, 7):  # token blocks of 4 (AVX-512) and 3 (AVX-VNNI) with every remainder
        x = _activations(t, k, t)
        got = cpu_quant_moe.matmul_w4a8(x, tiles, n, fmt, path)
        want = spec.matmul(x, codes, scales, fmt == "mxfp4")
        assert torch.equal(got, want), f"{fmt} {path} tokens={t}: {(got - want).abs().max().item():.3e} off"


def test_the_specification_is_the_float64_product_of_the_quantised_activations():
    # an independent check of the spec's bookkeeping (code values, scales, the E2M1 halving)
    for fmt in ("int4", "mxfp4"):
        packed, scale, w = _weights(fmt, 1, 24, 64, 2)
        x = _activations(3, 64, 3)
        q, d = spec.quantize_q8(x)
        xq = (q.double() * d.double()[..., None]).reshape(3, 64)
        assert (xq - x.double()).abs().max() <= 0.5 * d.max() * (1 + 1e-6)
        codes, scales = spec.int_codes(fmt, packed[0], scale[0], 64)
        got = spec.matmul(x, codes, scales, fmt == "mxfp4").double()
        torch.testing.assert_close(got, xq @ w[0].T, rtol=1e-5, atol=1e-5 * got.abs().max().item())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "fmt,hidden,inter,act",
    [("int4", 72, 40, None), ("mxfp4", 96, 64, None), ("mxfp4", 64, 96, GatedActivation("situ", 1.5, 3.0))],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_moe_matches_the_specification(path, fmt, hidden, inter, act, dtype):
    e, top_k = 5, 3
    p13, s13, _ = _weights(fmt, e, 2 * inter, hidden, 4)
    p2, s2, _ = _weights(fmt, e, hidden, inter, 5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(9, hidden, generator=g).to(dtype)
    ids = torch.randint(0, e + 1, (9, top_k), generator=g)  # id e: computed elsewhere, adds nothing
    wts = torch.rand(9, top_k, generator=g)
    kw = {} if act is None else dict(act=act.kind, beta=act.beta, linear_beta=act.linear_beta)
    got = cpu_quant_moe.moe(x, ids, wts, fmt, p13, s13, p2, s2, w4a8=path, **kw)
    want = spec.moe(x, ids, wts, fmt, p13, s13, p2, s2, act=act)
    assert got.dtype == dtype
    # the same sums; h = act(gate, up) may differ in a last bit (C++ exp against torch's), which can move
    # one int8 step of h
    scale = want.abs().max().item()
    torch.testing.assert_close(got.float(), want.to(dtype).float(), rtol=0, atol=2e-3 * scale)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_a_token_gives_the_same_bits_alone_and_in_a_batch(path, fmt):
    hidden, inter, e = 96, 64, 3
    experts = cpu_quant_moe.prepare(
        fmt, *_weights(fmt, e, 2 * inter, hidden, 7)[:2], *_weights(fmt, e, hidden, inter, 8)[:2]
    )
    g = torch.Generator().manual_seed(9)
    x = torch.randn(37, hidden, generator=g).bfloat16()
    ids = torch.randint(0, e, (37, 2), generator=g)
    wts = torch.rand(37, 2, generator=g)
    batch = cpu_quant_moe.moe(x, ids, wts, fmt, experts, None, None, None, w4a8=path)
    for t in (0, 17, 36):
        alone = cpu_quant_moe.moe(
            x[t : t + 1], ids[t : t + 1], wts[t : t + 1], fmt, experts, None, None, None, w4a8=path
        )
        assert torch.equal(alone[0], batch[t]), f"token {t} differs alone and in a batch ({fmt}, {path})"


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_w4a8_stays_within_the_int8_rounding_of_the_float_path(fmt):
    hidden, inter, e = 256, 128, 4
    p13, s13, w13 = _weights(fmt, e, 2 * inter, hidden, 10)
    p2, s2, w2 = _weights(fmt, e, hidden, inter, 11)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(8, hidden, generator=g).bfloat16()
    ids, wts = torch.randint(0, e, (8, 2), generator=g), torch.rand(8, 2, generator=g)
    exact = moe64(x.float(), ids, wts, w13, w2)
    scale = exact.abs().max().item()
    float_path = cpu_quant_moe.moe(x, ids, wts, fmt, p13, s13, p2, s2, w4a8=False).double()
    int8_path = cpu_quant_moe.moe(x, ids, wts, fmt, p13, s13, p2, s2, w4a8=True).double()
    err_float = ((float_path - exact).norm() / exact.norm()).item()
    err_int8 = ((int8_path - exact).norm() / exact.norm()).item()
    # int8 activations (step amax / 127 per 32 columns) cost about 1% relative; bf16 output rounding 0.2%
    assert err_float < 4e-3 and err_int8 < 2.5e-2, (err_float, err_int8)
    assert (int8_path - float_path).abs().max().item() < 0.08 * scale


def test_the_backend_takes_the_setting_and_auto_takes_bf16_only():
    hidden, inter, e = 64, 32, 4
    p13, s13, _ = _weights("int4", e, 2 * inter, hidden, 13)
    p2, s2, _ = _weights("int4", e, hidden, inter, 14)
    x, ids, wts = torch.randn(3, hidden), torch.randint(0, e, (3, 2)), torch.rand(3, 2)
    float32 = cpu_quant_moe.moe(x, ids, wts, "int4", p13, s13, p2, s2, w4a8=False)
    bf16 = cpu_quant_moe.moe(x.bfloat16(), ids, wts, "int4", p13, s13, p2, s2, w4a8=False)
    int8 = spec.moe(x, ids, wts, "int4", p13, s13, p2, s2)
    int8_bf16 = spec.moe(x.bfloat16(), ids, wts, "int4", p13, s13, p2, s2).bfloat16()
    on = bool(PATHS) and cpu_quant_moe._module().best_q8_isa() > 0  # auto: where an int8 dot product exists
    for setting, want32, want16 in (
        ("0", float32, bf16),
        ("scalar", int8, int8_bf16),
        ("auto", float32, int8_bf16 if on else bf16),
    ):
        backend = CpuBackend(KernelSettings(cpu_w4a8=setting))
        got32 = backend.moe_experts_w4a16(x, ids, wts, p13, s13, p2, s2, 32)
        got16 = backend.moe_experts_w4a16(x.bfloat16(), ids, wts, p13, s13, p2, s2, 32)
        torch.testing.assert_close(got32, want32, rtol=0, atol=1e-3 * want32.abs().max().item())
        torch.testing.assert_close(got16.float(), want16.float(), rtol=0, atol=1e-2 * want16.abs().max().item())
    assert KernelSettings.from_env({"KIMITUI_CPU_W4A8": "Off"}).cpu_w4a8 == "off"
    with pytest.raises(ValueError, match="KIMITUI_CPU_W4A8='sse9'"):
        KernelSettings.from_env({"KIMITUI_CPU_W4A8": "sse9"})


def test_the_option_is_named_as_info_plans_it_and_bad_values_are_named(monkeypatch):
    monkeypatch.delenv("KIMITUI_CPU_W4A8", raising=False)  # `kimitui info` reads /proc/cpuinfo, builds nothing
    assert cpu_quant_moe.planned_w4a8() == cpu_quant_moe.w4a8("auto")
    monkeypatch.setenv("KIMITUI_CPU_W4A8", "scalar")
    assert cpu_quant_moe.planned_w4a8() == cpu_quant_moe.w4a8("scalar") == "int8-scalar"
    monkeypatch.setenv("KIMITUI_CPU_W4A8", "sse9")
    assert "KIMITUI_CPU_W4A8='sse9'" in cpu_quant_moe.planned_w4a8()
    best = cpu_quant_moe._module().best_q8_isa()
    for value in ("0", "off", "no"):
        assert cpu_quant_moe.w4a8(value) == "off"
    assert cpu_quant_moe.w4a8("1") == cpu_quant_moe.W4A8_NAMES[best] == cpu_quant_moe.w4a8("on")
    assert cpu_quant_moe.w4a8("auto") == (
        "off" if best == 0 else cpu_quant_moe.W4A8_NAMES[best] + " (bf16 activations)"
    )
    assert cpu_quant_moe._w4a8_choice("", 0) == (None, True)  # no int8 dot product: the float path by default
    with pytest.raises(ValueError, match="int8 path 'avx9'"):
        x = torch.zeros(1, 32)
        p, s, _ = _weights("mxfp4", 1, 64, 32, 15)
        p2, s2, _ = _weights("mxfp4", 1, 32, 32, 16)
        cpu_quant_moe.moe(x, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), "mxfp4", p, s, p2, s2, w4a8="avx9")
