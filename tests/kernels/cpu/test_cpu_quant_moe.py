"""The packed INT4 / MXFP4 CPU MoE kernels (kernels/cpu/quant_moe.py) against dequantise-then-matmul in
float64, on every instruction set path this CPU runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kimitui.kernels import reference as R
from kimitui.kernels.cpu import quant_moe as cpu_quant_moe
from kimitui.kernels.cpu import quant_moe_layout as layout
from kimitui.kernels.cpu.backend import CpuBackend
from kimitui.kernels.settings import KernelSettings
from tests.helpers.moe_oracle import moe64

pytestmark = pytest.mark.skipif(not cpu_quant_moe.available(), reason="the C++ extension does not build here")

ISAS = cpu_quant_moe.supported_isas() if cpu_quant_moe.available() else []


def _experts(fmt, e, n, k, seed, group=32):
    """Packed weights [e, n, *] of random experts and their float64 dequantised values [e, n, k]."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=g)
    if fmt == "int4":
        parts = [R.quantize_int4(w[i], group) for i in range(e)]
        packed = torch.stack([p for p, _ in parts])
        scale = torch.stack([s.to(torch.bfloat16) for _, s in parts])
        return packed, scale, R.dequant_int4(packed, scale, k, group, torch.float64)
    parts = [R.quantize_mxfp4(w[i]) for i in range(e)]
    packed, scale = torch.stack([p for p, _ in parts]), torch.stack([s for _, s in parts])
    return packed, scale, R.dequant_mxfp4(packed, scale, torch.float64)


# Shapes with tails: hidden 72 (INT4: a 32-column group cut at 8, a packed row of 36 bytes), expert
# width 40 and rows not multiples of the 16-row work item or the register blocks.
CASES = [("int4", 72, 40), ("int4", 64, 96), ("mxfp4", 96, 64), ("mxfp4", 32, 160)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt,hidden,inter", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_dequantised(isa, fmt, hidden, inter, dtype):
    e, top_k = 5, 3
    p13, s13, w13 = _experts(fmt, e, 2 * inter, hidden, 1)
    p2, s2, w2 = _experts(fmt, e, hidden, inter, 2)
    g = torch.Generator().manual_seed(3)
    for tokens in (1, 3, 9, 150):  # one token per expert, a part block (< 4 per expert), many blocks
        x = torch.randn(tokens, hidden, generator=g).to(dtype)
        ids = torch.randint(0, e + 1, (tokens, top_k), generator=g)  # id e: computed elsewhere, adds nothing
        wts = torch.rand(tokens, top_k, generator=g)
        y = cpu_quant_moe.moe(x, ids, wts, fmt, p13, s13, p2, s2, 32, isa_name=isa)
        assert y.dtype == dtype and y.shape == (tokens, hidden)
        ref = moe64(x.float(), ids, wts, w13, w2)
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
        err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < tol, f"{fmt} {isa} {dtype} tokens={tokens}: relative error {err:.2e}"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gives_the_same_bits_alone_and_in_a_batch(isa, fmt, dtype):
    hidden, inter, e = 96, 80 if fmt == "int4" else 96, 4
    w13, w2 = _experts(fmt, e, 2 * inter, hidden, 4)[:2], _experts(fmt, e, hidden, inter, 5)[:2]
    experts = cpu_quant_moe.prepare(fmt, *w13, *w2)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(203, hidden, generator=g).to(dtype)
    ids = torch.randint(0, e, (203, 2), generator=g)
    wts = torch.rand(203, 2, generator=g)
    batch = cpu_quant_moe.moe(x, ids, wts, fmt, experts, None, None, None, isa_name=isa)
    # every expert sees ~100 tokens in the batch (full token blocks and a part one) and one alone
    for t in (0, 7, 131, 202):
        alone = cpu_quant_moe.moe(
            x[t : t + 1], ids[t : t + 1], wts[t : t + 1], fmt, experts, None, None, None, isa_name=isa
        )
        assert torch.equal(alone[0], batch[t]), f"row {t} differs alone and in a batch ({fmt}, {isa}, {dtype})"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_alone_and_among_64_on_the_same_experts_gives_the_same_bits(isa, fmt, dtype):
    # Every token on the same two experts: 64 (full 16-token AMX blocks), 17 and 33 (a block of 16
    # plus a part one) and the token alone, whose path on amx_bf16 decodes per group instead of
    # reusing a decoded tile. Odd group counts (hidden 224 = 7 groups) take the single-group tail.
    # Compared are the float32 sums before the cast to x's dtype (a bf16 output would hide most
    # last-bit differences: amx_bf16 and avx512bf16 sums differ in about half the elements here).
    hidden, inter, e = 224, 96, 3
    experts = cpu_quant_moe.prepare(
        fmt, *_experts(fmt, e, 2 * inter, hidden, 11)[:2], *_experts(fmt, e, hidden, inter, 12)[:2]
    )
    g = torch.Generator().manual_seed(13)
    x = torch.randn(64, hidden, generator=g).to(dtype)
    ids = torch.tensor([[2, 0]]).expand(64, 2).contiguous()
    wts = torch.rand(64, 2, generator=g)
    code = cpu_quant_moe.ISA_CODES[isa]

    def sums(rows):
        return cpu_quant_moe._module().moe(
            x[rows], ids[rows], wts[rows], experts.w13, experts.w2, inter, fmt == "mxfp4", code, 0, 1.0, 0.0
        )

    full = sums(slice(0, 64))
    assert full.dtype == torch.float32
    torch.testing.assert_close(
        cpu_quant_moe.moe(x, ids, wts, fmt, experts, None, None, None, isa_name=isa), full.to(dtype), rtol=0, atol=0
    )
    for n in (17, 33):
        assert torch.equal(sums(slice(0, n)), full[:n]), f"{n} tokens differ among 64 ({fmt}, {isa}, {dtype})"
    for t in (0, 16, 63):
        assert torch.equal(sums(slice(t, t + 1))[0], full[t]), f"token {t} differs alone ({fmt}, {isa}, {dtype})"


@pytest.mark.parametrize("fmt,n,k,group", [("int4", 40, 72, 32), ("int4", 33, 256, 128), ("mxfp4", 64, 96, 32)])
def test_the_tile_layout_is_the_specified_reordering_of_the_same_codes_and_scales(fmt, n, k, group):
    e = 3
    p13, s13, w13 = _experts(fmt, e, 2 * n, k, 11, group)
    p2, s2, w2 = _experts(fmt, e, k, n, 12, group)
    tiled = cpu_quant_moe.prepare(fmt, p13, s13, p2, s2, group)
    # the C++ conversion writes what the PyTorch specification in kernels/cpu/quant_moe_layout.py says
    # (INT4 cases with rows and columns past whole tiles; MXFP4 widths are whole 32-column blocks)
    spec13 = torch.cat(
        (layout.repack(fmt, p13[:, :n], s13[:, :n], k, group), layout.repack(fmt, p13[:, n:], s13[:, n:], k, group)),
        dim=1,
    )
    assert torch.equal(tiled.w13, spec13)
    assert torch.equal(tiled.w2, layout.repack(fmt, p2, s2, n, group))
    # same bytes as the checkpoint where rows and columns fill whole tiles (Kimi K2's w13, K3's w2)
    assert layout.matrix_bytes("int4", 4096, 7168) == 4096 * 7168 // 2 + 4096 * 7168 // 32 * 2
    assert layout.matrix_bytes("mxfp4", 3584, 3072) == 3584 * 3072 // 2 + 3584 * 3072 // 32
    # and converts back to the same weights (INT4 scales then come one per 32 columns)
    b13, c13, b2, c2 = cpu_quant_moe.unprepare(tiled)
    if fmt == "int4":
        back13, back2 = R.dequant_int4(b13, c13, k, 32, torch.float64), R.dequant_int4(b2, c2, n, 32, torch.float64)
    else:
        back13, back2 = R.dequant_mxfp4(b13, c13, torch.float64), R.dequant_mxfp4(b2, c2, torch.float64)
    assert torch.equal(back13, w13) and torch.equal(back2, w2)


def test_cpu_backend_matches_the_reference_and_takes_bf16():
    hidden, inter, e = 64, 32, 4
    p13, s13, _ = _experts("int4", e, 2 * inter, hidden, 7)
    p2, s2, _ = _experts("int4", e, hidden, inter, 8)
    x = torch.randn(6, hidden)
    ids, wts = torch.randint(0, e, (6, 2)), torch.rand(6, 2)
    backend = CpuBackend(KernelSettings(cpu_w4a8="0"))  # the float products (W4A8: test_cpu_quant_moe_w4a8.py)
    got = backend.moe_experts_w4a16(x, ids, wts, p13, s13, p2, s2, 32)
    ref = R.moe_experts_reference_w4a16(x, ids, wts, p13, s13, p2, s2, 32)
    scale = ref.abs().max().item()  # outputs ~ hundreds: compare against the largest
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6 * scale)
    got16 = backend.moe_experts_w4a16(x.bfloat16(), ids, wts.bfloat16(), p13, s13, p2, s2, 32)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.float(), ref, rtol=2e-2, atol=1e-2 * scale)


def test_bad_input_names_the_tensor():
    p13, s13, _ = _experts("mxfp4", 2, 64, 64, 9)
    p2, s2, _ = _experts("mxfp4", 2, 64, 32, 10)
    x, ids, wts = torch.randn(1, 64), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2)
    with pytest.raises(ValueError, match="w2_scale"):
        cpu_quant_moe.moe(x, ids, wts, "mxfp4", p13, s13, p2, s2[:, :, :0])
    with pytest.raises(ValueError, match="w13 is torch.uint8"):
        cpu_quant_moe.moe(x, ids, wts, "int4", p13, s13, p2, s2)
    with pytest.raises(ValueError, match="unknown expert format"):
        cpu_quant_moe.moe(x, ids, wts, "fp8", p13, s13, p2, s2)
    with pytest.raises(ValueError, match="instruction set 'sse9'"):
        cpu_quant_moe.moe(x, ids, wts, "mxfp4", p13, s13, p2, s2, isa_name="sse9")
    with pytest.raises(ValueError, match="topk_weights"):
        cpu_quant_moe.moe(x, ids, wts[:, :1], "mxfp4", p13, s13, p2, s2)
    tiled = cpu_quant_moe.prepare("mxfp4", p13, s13, p2, s2)
    with pytest.raises(ValueError, match="tiled w2 is"):
        cpu_quant_moe.moe(
            x,
            ids,
            wts,
            "mxfp4",
            cpu_quant_moe.TiledExperts("mxfp4", 64, 32, tiled.w13, tiled.w2[:, 1:]),
            None,
            None,
            None,
        )
    with pytest.raises(ValueError, match="mxfp4 experts of hidden size 64 called as int4"):
        cpu_quant_moe.moe(x, ids, wts, "int4", tiled, None, None, None)


def test_the_isa_is_chosen_once_from_the_cpu_or_the_environment():
    assert cpu_quant_moe.isa() in cpu_quant_moe.ISA_NAMES.values()
    if not os.environ.get("KIMITUI_CPU_ISA"):  # what `kimitui info` prints without building the extension
        assert cpu_quant_moe.planned_isa() == cpu_quant_moe.isa()
    code = "from kimitui.kernels.cpu import quant_moe as q; print(q.isa(), q.planned_isa())"
    for name in cpu_quant_moe.supported_isas():  # each level this CPU runs can be forced, and info says so
        env = dict(os.environ, KIMITUI_CPU_ISA=name)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        want = cpu_quant_moe.ISA_NAMES[cpu_quant_moe.ISA_CODES[name]]
        assert out.stdout.split() == [want, want]
    env = dict(os.environ)
    env["KIMITUI_CPU_ISA"] = "sse9"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "KIMITUI_CPU_ISA='sse9'" in bad.stderr
