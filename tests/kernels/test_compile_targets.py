"""Every kernel lowers to machine code for H200 (sm_90) and MI355X (gfx950), without a GPU.

The interpreter tests check the maths; this catches what only the compiler sees (constexpr
branches, dtype rules of tl.dot, fp8 types). Compiling needs no driver: ``triton.compile`` with an
explicit ``GPUTarget`` runs the bundled ptxas / lld.
"""

import importlib.util
import os

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on"),
        reason="kernels are interpreted functions under TRITON_INTERPRET",
    ),
]

TARGETS = {"sm_90": ("cuda", 90, 32), "gfx950": ("hip", "gfx950", 64)}
TILES = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64)


def _specs():
    from kernels.fp8_block_gemm import _fp8_block_gemm_kernel
    from kernels.fused_moe import _fused_moe_kernel
    from kernels.mla_decode import _mla_decode_kernel
    from kernels.mxfp4_gemm import _mxfp4_gemm_kernel
    from kernels.rms_norm import _rms_norm_kernel
    from kernels.w4a16_gemm import _w4a16_gemm_kernel

    gemm = {"x_ptr": "*bf16", "out_ptr": "*bf16"}
    moe = {"a_ptr": "*bf16", "s_ptr": "*bf16", "topk_weights_ptr": "*fp32", "sorted_token_ids_ptr": "*i32",
           "expert_ids_ptr": "*i32", "num_tokens_post_padded_ptr": "*i32", "act_beta": "fp32",
           "act_linear_beta": "fp32"}
    specs = {
        "w4a16": (_w4a16_gemm_kernel, {**gemm, "w_ptr": "*i32", "s_ptr": "*bf16"}, dict(GROUP_SIZE=32, **TILES)),
        "mxfp4": (_mxfp4_gemm_kernel, {**gemm, "w_ptr": "*u8", "s_ptr": "*u8"}, TILES),
        "fp8_block": (_fp8_block_gemm_kernel, {**gemm, "w_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
                      dict(QBLOCK_N=128, QBLOCK_K=128, **TILES)),
        "mla_decode": (_mla_decode_kernel, {"q_ptr": "*bf16", "cache_ptr": "*bf16", "table_ptr": "*i32",
                                            "lens_ptr": "*i32", "acc_ptr": "*fp32", "ml_ptr": "*fp32", "scale": "fp32"},
                       dict(R=512, P=64, BLOCK_R=512, BLOCK_P=64, BLOCK_H=16, BLOCK_N=64, MIN_TILES=4)),
        "rms_norm": (_rms_norm_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32"},
                     dict(BLOCK=8192)),
    }
    weights = {"dense": ("*bf16", "*bf16", 0, 1), "int4": ("*i32", "*bf16", 1, 32), "mxfp4": ("*u8", "*u8", 2, 32),
               "fp8": ("*fp8e4nv", "*fp32", 3, 128)}
    for fmt, (b_type, s_type, wfmt, group) in weights.items():
        for gated in (True, False):
            types = {**moe, "b_ptr": b_type, "s_ptr": s_type, "c_ptr": "*bf16" if gated else "*fp32"}
            consts = dict(TOP_K=8 if gated else 1, GATED=gated, MUL_ROUTED_WEIGHT=not gated, WFMT=wfmt,
                          GROUP_SIZE=group, QBLOCK_N=128 if fmt == "fp8" else 1, ACTIVATION=0, HAS_LINEAR_BETA=False,
                          **TILES)
            specs[f"moe_{fmt}_{'gemm1' if gated else 'gemm2'}"] = (_fused_moe_kernel, types, consts)
            if gated:  # Kimi K3's SiTU epilogue (tanh from sigmoid), up bounded
                specs[f"moe_{fmt}_gemm1_situ"] = (_fused_moe_kernel, types,
                                                  {**consts, "ACTIVATION": 1, "HAS_LINEAR_BETA": True})
    return specs


SPEC_NAMES = ["w4a16", "mxfp4", "fp8_block", "rms_norm", "mla_decode"] + [
    f"moe_{fmt}_{gemm}" for fmt in ("dense", "int4", "mxfp4", "fp8") for gemm in ("gemm1", "gemm2", "gemm1_situ")
]


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("name", SPEC_NAMES)
def test_kernel_compiles(name, target):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, types, consts = _specs()[name]
    if not hasattr(fn, "arg_names"):
        pytest.skip("kernel module was imported in interpreter mode")
    # Unlisted runtime arguments are sizes and strides: int32.
    signature = {arg: "constexpr" if arg in consts else types.get(arg, "i32") for arg in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, signature, consts), target=GPUTarget(*TARGETS[target]),
                              options={"num_warps": 4})
    assert "cubin" in compiled.asm or "hsaco" in compiled.asm
