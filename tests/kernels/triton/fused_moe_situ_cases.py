"""The fused MoE kernels with Kimi K3's SiTU activation vs the PyTorch reference, under
TRITON_INTERPRET=1 on CPU tensors: every expert format, with and without ``linear_beta``.

Run as ``python -m tests.kernels.triton.fused_moe_situ_cases [case ...]`` in a fresh process
(test_fused_moe_situ does this; see tests/helpers/interpret.py for why). Inputs are scaled so gate
and up reach several betas: the tanh bounds are exercised, not only their linear part near 0. fp32
and fp16 only (the interpreter's bf16 dot is wrong, triton issue #11584).
"""

import os

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import torch

from tests.helpers.interpret import case_registry, child_main
from tests.helpers.interpret import close as _close

CASES, case = case_registry()

# beta 0.5 with up bounded at 0.75, and Moonshot's default beta 1.0 with up unbounded
ACTS = (("situ", 0.5, 0.75), ("situ", 1.0, None))


def _acts():
    from kimitui.kernels.activation import GatedActivation

    return [GatedActivation(*a) for a in ACTS]


def _inputs(t=6, d=64, inter=32, e=5, k=2, dtype=torch.float32):
    x = torch.randn(t, d).to(dtype)
    topk_ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(torch.int32)
    topk_weights = torch.rand(t, k)
    w13 = (torch.randn(e, 2 * inter, d) / 2).to(dtype)  # gate and up with |values| of several betas
    w2 = (torch.randn(e, d, inter) / 4).to(dtype)
    return x, topk_ids, topk_weights, w13, w2


def _stack(fn, w):
    return [torch.stack(p) for p in zip(*[fn(w[i]) for i in range(w.shape[0])])]


def _differs_from_silu(got, silu):
    # the activation really reached the kernel: SiTU's output is not SwiGLU's
    assert (got.float() - silu.float()).abs().max() > 1e-2


@case
def situ_dense_fp32_and_fp16():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.fused_moe import fused_moe

    x, ids, w, w13, w2 = _inputs(t=7, d=32, inter=24, e=4, k=3)
    ids[0, 1] = 4  # one pair computed elsewhere
    silu = fused_moe(x, ids, w, w13, w2)
    for act in _acts():
        expected = ref.moe_experts_reference(x, ids, w, w13, w2, activation=act)
        got = fused_moe(x, ids, w, w13, w2, activation=act)
        _close(got, expected, 1e-4)
        _differs_from_silu(got, silu)
        half = fused_moe(x.half(), ids, w, w13.half(), w2.half(), activation=act)
        assert half.dtype == torch.float16
        _close(half, expected, 2e-2)


@case
def situ_w4a16_fp32():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.fused_moe import fused_moe_w4a16

    d, inter, e = 36, 24, 4  # D not a multiple of 8 or 32
    x, ids, w, w13, w2 = _inputs(t=5, d=d, inter=inter, e=e)
    p13, s13 = _stack(ref.quantize_int4, w13)
    p2, s2 = _stack(ref.quantize_int4, w2)
    silu = fused_moe_w4a16(x, ids, w, p13, s13, p2, s2, 32)
    for act in _acts():
        expected = ref.moe_experts_reference_w4a16(x, ids, w, p13, s13, p2, s2, 32, activation=act)
        got = fused_moe_w4a16(x, ids, w, p13, s13, p2, s2, 32, activation=act)
        _close(got, expected, 1e-4)
        _differs_from_silu(got, silu)


@case
def situ_mxfp4_fp32_and_fp16():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.fused_moe import fused_moe_mxfp4

    x, ids, w, w13, w2 = _inputs()
    ids[2, 0] = 5  # one pair computed elsewhere
    p13, s13 = _stack(ref.quantize_mxfp4, w13)
    p2, s2 = _stack(ref.quantize_mxfp4, w2)
    silu = fused_moe_mxfp4(x, ids, w, p13, s13, p2, s2)
    for act in _acts():
        expected = ref.moe_experts_reference_mxfp4(x, ids, w, p13, s13, p2, s2, activation=act)
        got = fused_moe_mxfp4(x, ids, w, p13, s13, p2, s2, activation=act)
        _close(got, expected, 1e-4)
        _differs_from_silu(got, silu)
        half = fused_moe_mxfp4(x.half(), ids, w, p13, s13, p2, s2, activation=act)
        _close(half, expected, 2e-2)


@case
def situ_fp8_partial_blocks():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.fused_moe import fused_moe_fp8

    block = (16, 32)  # D = 40 and I = 16: the K side of both GEMMs ends in a partial block
    x, ids, w, w13, w2 = _inputs(t=5, d=40, inter=16, e=4, k=2)
    f13, fs13 = _stack(lambda m: ref.quantize_fp8_block(m, block), w13)
    f2, fs2 = _stack(lambda m: ref.quantize_fp8_block(m, block), w2)
    silu = fused_moe_fp8(x, ids, w, f13, fs13, f2, fs2, block)
    for act in _acts():
        expected = ref.moe_experts_reference_fp8(x, ids, w, f13, fs13, f2, fs2, block, activation=act)
        got = fused_moe_fp8(x, ids, w, f13, fs13, f2, fs2, block, activation=act)
        _close(got, expected, 1e-4)
        _differs_from_silu(got, silu)


@case
def silu_spelled_out_equals_the_default():
    # activation=GatedActivation() (SiLU) is the old call, bit for bit
    from kimitui.kernels.activation import GatedActivation
    from kimitui.kernels.triton.fused_moe import fused_moe

    x, ids, w, w13, w2 = _inputs(t=4, d=32, inter=16, e=3)
    assert torch.equal(fused_moe(x, ids, w, w13, w2), fused_moe(x, ids, w, w13, w2, activation=GatedActivation()))


if __name__ == "__main__":
    child_main(CASES)
