"""Every kernel lowers to machine code for H200 (sm_90) and MI355X (gfx950), without a GPU.

The interpreter tests check the maths; this catches what only the compiler sees (constexpr
branches, dtype rules of tl.dot, fp8 types). Compiling needs no driver: ``triton.compile`` with an
explicit ``GPUTarget`` runs the bundled ptxas / lld. The MLA decode tile is chosen per architecture
(``mla_decode_launch_params``), so it is compiled for MI300X (gfx942) too, with the tile chosen for
each target, and the compiler's own numbers are checked: shared memory / LDS within the target's
limit and no register spills (ptxas ``-v`` on CUDA, the AMDGPU ``ScratchSize`` on ROCm).
"""

import importlib.util
import os
import re
import subprocess
import tempfile

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on"),
        reason="kernels are interpreted functions under TRITON_INTERPRET",
    ),
]

TARGETS = {"sm_90": ("cuda", 90, 32), "gfx950": ("hip", "gfx950", 64), "gfx942": ("hip", "gfx942", 64)}
GENERIC_TARGETS = ("gfx950", "sm_90")  # every kernel; gfx942 for the per-architecture MLA tile
TILES = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64)


def _specs():
    from kimitui.kernels.triton.fused_moe import _fused_moe_kernel
    from kimitui.kernels.triton.gemm.fp8_block import _fp8_block_gemm_kernel
    from kimitui.kernels.triton.gemm.mxfp4 import _mxfp4_gemm_kernel
    from kimitui.kernels.triton.gemm.w4a16 import _w4a16_gemm_kernel
    from kimitui.kernels.triton.mla_decode import _mla_merge_kernel
    from kimitui.kernels.triton.moe_align import _moe_align_kernel, align_launch
    from kimitui.kernels.triton.moe_router import _moe_router_kernel
    from kimitui.kernels.triton.rms_norm import _rms_norm_kernel
    from kimitui.kernels.triton.rope_fused import _rope_mla_kernel
    from kimitui.kernels.triton.split_k import _split_k_reduce_kernel

    gemm = {"x_ptr": "*bf16", "out_ptr": "*bf16"}
    moe = {
        "a_ptr": "*bf16",
        "s_ptr": "*bf16",
        "topk_weights_ptr": "*fp32",
        "sorted_token_ids_ptr": "*i32",
        "expert_ids_ptr": "*i32",
        "num_tokens_post_padded_ptr": "*i32",
        "act_beta": "fp32",
        "act_linear_beta": "fp32",
    }
    align = {"sorted_ptr": "*i32", "expert_ids_ptr": "*i32", "num_post_ptr": "*i32"}
    split = {**gemm, "out_ptr": "*fp32"}  # split-K: fp32 partials
    router = {
        "logits_ptr": "*fp32",
        "bias_ptr": "*fp32",
        "ids_ptr": "*i64",
        "weights_ptr": "*fp32",
        "counts_ptr": "*i32",
        "count_rows_ptr": "*i32",
        "scaling": "fp32",
    }
    specs = {
        "w4a16": (
            _w4a16_gemm_kernel,
            {**gemm, "w_ptr": "*i32", "s_ptr": "*bf16"},
            dict(GROUP_SIZE=32, SPLIT=False, **TILES),
        ),
        "w4a16_split_g128": (
            _w4a16_gemm_kernel,
            {**split, "w_ptr": "*i32", "s_ptr": "*bf16"},
            dict(GROUP_SIZE=128, SPLIT=True, **TILES),
        ),
        "w4a16_split_g48": (
            _w4a16_gemm_kernel,
            {**split, "w_ptr": "*i32", "s_ptr": "*bf16"},
            dict(GROUP_SIZE=48, SPLIT=True, **TILES),
        ),
        "mxfp4": (_mxfp4_gemm_kernel, {**gemm, "w_ptr": "*u8", "s_ptr": "*u8"}, dict(SPLIT=False, **TILES)),
        "mxfp4_split": (_mxfp4_gemm_kernel, {**split, "w_ptr": "*u8", "s_ptr": "*u8"}, dict(SPLIT=True, **TILES)),
        "fp8_block": (
            _fp8_block_gemm_kernel,
            {**gemm, "w_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
            dict(QBLOCK_N=128, QBLOCK_K=128, SPLIT=False, **TILES),
        ),
        "fp8_block_split_gathered": (
            _fp8_block_gemm_kernel,
            {**split, "w_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
            dict(QBLOCK_N=128, QBLOCK_K=96, SPLIT=True, **TILES),
        ),
        "split_k_reduce": (_split_k_reduce_kernel, {"ws_ptr": "*fp32", "out_ptr": "*bf16"}, dict(BLOCK=256)),
        # the NaN-safe router: Kimi K2 (384 experts, top-8, statistics with padding rows), DeepSeek-V3 groups
        "moe_router_k2": (
            _moe_router_kernel,
            router,
            dict(
                TOP_K=8,
                N_GROUP=1,
                TOPK_GROUP=1,
                SOFTMAX=False,
                RENORMALIZE=True,
                HAS_BIAS=True,
                COUNT=True,
                ROW_MASK=True,
                BLOCK_E=512,
                BLOCK_K=8,
                BLOCK_G=1,
            ),
        ),
        "moe_router_grouped_softmax": (
            _moe_router_kernel,
            router,
            dict(
                TOP_K=8,
                N_GROUP=8,
                TOPK_GROUP=4,
                SOFTMAX=True,
                RENORMALIZE=True,
                HAS_BIAS=True,
                COUNT=False,
                ROW_MASK=False,
                BLOCK_E=256,
                BLOCK_K=8,
                BLOCK_G=8,
            ),
        ),
        # Kimi K2 at batch 64 (384 experts, top-8, BLOCK_M 64) and K3 (896 experts, top-16)
        "moe_align_k2": (_moe_align_kernel, {**align, "ids_ptr": "*i64"}, align_launch(512, 64, 384).kernel_args()),
        "moe_align_k3": (_moe_align_kernel, {**align, "ids_ptr": "*i32"}, align_launch(1024, 64, 896).kernel_args()),
        # the forms for Triton 3.0-3.3 (no tl.gather, no masked tl.histogram), compiled by this Triton
        "moe_align_k3_portable": (
            _moe_align_kernel,
            {**align, "ids_ptr": "*i32"},
            {**align_launch(1024, 64, 896).kernel_args(), "PORTABLE": True},
        ),
        # the MLA split merge (Kimi K2: 64 heads, latent 512) and the query/key rope (64 heads, rope 64)
        "mla_merge": (
            _mla_merge_kernel,
            {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "out_ptr": "*bf16"},
            dict(R=512, BLOCK_R=512, BLOCK_H=16),
        ),
        "rope_mla": (
            _rope_mla_kernel,
            {name: "*bf16" for name in ("q_ptr", "k_ptr", "qo_ptr", "ko_ptr")}
            | {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64"},
            dict(BLOCK_H=64, BLOCK_P=32),
        ),
        "rms_norm": (
            _rms_norm_kernel,
            {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32"},
            dict(BLOCK=8192),
        ),
    }
    weights = {
        "dense": ("*bf16", "*bf16", 0, 1),
        "int4": ("*i32", "*bf16", 1, 32),
        "mxfp4": ("*u8", "*u8", 2, 32),
        "fp8": ("*fp8e4nv", "*fp32", 3, 128),
    }
    for fmt, (b_type, s_type, wfmt, group) in weights.items():
        for gated in (True, False):
            types = {**moe, "b_ptr": b_type, "s_ptr": s_type, "c_ptr": "*bf16" if gated else "*fp32"}
            consts = dict(
                TOP_K=8 if gated else 1,
                GATED=gated,
                MUL_ROUTED_WEIGHT=not gated,
                WFMT=wfmt,
                GROUP_SIZE=group,
                QBLOCK_N=128 if fmt == "fp8" else 1,
                ACTIVATION=0,
                HAS_LINEAR_BETA=False,
                **TILES,
            )
            specs[f"moe_{fmt}_{'gemm1' if gated else 'gemm2'}"] = (_fused_moe_kernel, types, consts)
            if gated:  # Kimi K3's SiTU epilogue (tanh from sigmoid), up bounded
                specs[f"moe_{fmt}_gemm1_situ"] = (
                    _fused_moe_kernel,
                    types,
                    {**consts, "ACTIVATION": 1, "HAS_LINEAR_BETA": True},
                )
    specs.update(_k3_specs())
    return specs


def _k3_specs():
    """Kimi K3's decode fusions (tests/kernels/triton/test_k3_fusions.py checks their maths): the KDA decode
    step at head_dim 128, an AttnRes mix + norm at hidden 7168, the NoPE cache write and absorbed
    query at K3's latent 512 + 64, the output gate."""
    import triton.language as tl

    from kimitui.kernels.triton.attn_res_mix import _attn_res_mix_norm_kernel
    from kimitui.kernels.triton.kda_decode import _kda_decode_kernel
    from kimitui.kernels.triton.mla_cache_write import _mla_cache_write_kernel
    from kimitui.kernels.triton.mla_q_absorb import _mla_q_absorb_kernel
    from kimitui.kernels.triton.sigmoid_gate import _sigmoid_gate_kernel

    bf, f32 = "*bf16", "*fp32"
    kda = {
        "qkv_ptr": bf,
        "fb_ptr": bf,
        "b_ptr": bf,
        "gate_ptr": bf,
        "convw_ptr": f32,
        "alog_ptr": f32,
        "dtb_ptr": f32,
        "normw_ptr": f32,
        "conv_ptr": f32,
        "rec_ptr": f32,
        "slot_ptr": "*i64",
        "out_ptr": bf,
        "scale": "fp32",
        "eps": "fp32",
        "lower_bound": "fp32",
    }
    mix = {name: bf for name in ("x_ptr", "delta_ptr", "blocks_ptr", "rw_ptr", "pw_ptr", "nw_ptr", "out_ptr", "s_ptr")}
    cache = {
        "kv_ptr": bf,
        "w_ptr": bf,
        "cos_ptr": f32,
        "sin_ptr": f32,
        "pos_ptr": "*i64",
        "slot_ptr": "*i64",
        "cache_ptr": bf,
        "q_ptr": bf,
        "qw_ptr": bf,
        "qo_ptr": bf,
        "eps": "fp32",
        "q_eps": "fp32",
    }
    absorb = {"q_ptr": bf, "w_ptr": bf, "cos_ptr": f32, "sin_ptr": f32, "pos_ptr": "*i64", "out_ptr": bf}
    return {
        "k3_kda_decode": (_kda_decode_kernel, kda, dict(W=4, BLOCK_D=128, BLOCK_V=32, BLOCK_W=4, SAFE_GATE=True)),
        "k3_attn_res_mix_norm": (
            _attn_res_mix_norm_kernel,
            {**mix, "res_eps": "fp32", "norm_eps": "fp32"},
            dict(BLOCK=8192, HAS_DELTA=True, SAVE=True),
        ),
        "k3_mla_cache_write_nope": (
            _mla_cache_write_kernel,
            cache,
            dict(NORM_DTYPE=tl.bfloat16, BLOCK_LAT=512, BLOCK_P=64, HAS_Q=True, BLOCK_Q=2048, ROPE=False),
        ),
        "k3_mla_q_absorb_nope": (
            _mla_q_absorb_kernel,
            absorb,
            dict(BLOCK_B=16, BLOCK_R=64, BLOCK_K=64, BLOCK_P=64, ROPE=False),
        ),
        "k3_sigmoid_gate": (_sigmoid_gate_kernel, {"x_ptr": bf, "g_ptr": bf, "out_ptr": bf}, dict(BLOCK=1024)),
    }


K3_SPEC_NAMES = [
    "k3_kda_decode",
    "k3_attn_res_mix_norm",
    "k3_mla_cache_write_nope",
    "k3_mla_q_absorb_nope",
    "k3_sigmoid_gate",
]

SPEC_NAMES = (
    [
        "w4a16",
        "w4a16_split_g128",
        "w4a16_split_g48",
        "mxfp4",
        "mxfp4_split",
        "fp8_block",
        "fp8_block_split_gathered",
        "split_k_reduce",
        "moe_router_k2",
        "moe_router_grouped_softmax",
        "mla_merge",
        "rope_mla",
        "rms_norm",
        "moe_align_k2",
        "moe_align_k3",
        "moe_align_k3_portable",
    ]
    + [f"moe_{fmt}_{gemm}" for fmt in ("dense", "int4", "mxfp4", "fp8") for gemm in ("gemm1", "gemm2", "gemm1_situ")]
    + K3_SPEC_NAMES
)


@pytest.mark.parametrize("target", GENERIC_TARGETS)
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
    compiled = triton.compile(
        ASTSource(fn, signature, consts), target=GPUTarget(*TARGETS[target]), options={"num_warps": 4}
    )
    assert "cubin" in compiled.asm or "hsaco" in compiled.asm


# --- the MLA decode tile, per architecture ----------------------------------------------------

MLA_TYPES = {
    "q_ptr": "*bf16",
    "cache_ptr": "*bf16",
    "table_ptr": "*i32",
    "lens_ptr": "*i32",
    "acc_ptr": "*fp32",
    "ml_ptr": "*fp32",
    "scale": "fp32",
}


def _compile_mla(target, block_h, block_n, num_warps, num_stages):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kimitui.kernels.triton.mla_decode import _mla_decode_kernel as fn

    if not hasattr(fn, "arg_names"):
        pytest.skip("kernel module was imported in interpreter mode")
    consts = dict(R=512, P=64, BLOCK_R=512, BLOCK_P=64, BLOCK_H=block_h, BLOCK_N=block_n, MIN_TILES=4)
    signature = {arg: "constexpr" if arg in consts else MLA_TYPES.get(arg, "i32") for arg in fn.arg_names}
    return triton.compile(
        ASTSource(fn, signature, consts),
        target=GPUTarget(*TARGETS[target]),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )


def _spill_bytes(compiled, target) -> int:
    """Bytes of registers spilled per thread, from the compiler's report."""
    if TARGETS[target][0] == "hip":
        return int(re.search(r"; ScratchSize: (\d+)", compiled.asm["amdgcn"]).group(1))
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        log = subprocess.run(
            [
                get_ptxas(TARGETS[target][1]).path,
                "-v",
                "--regAllocOptLevel=2",
                "--gpu-name=sm_90a",
                ptx,
                "-o",
                ptx + ".o",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
    return int(re.search(r"(\d+) bytes spill stores", log.stdout + log.stderr).group(1))


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("heads", [64, 8])  # Kimi K2 on one GPU, and per rank at tensor parallel 8
def test_mla_decode_tile_fits_each_target(target, heads):
    import torch

    from kimitui.kernels.triton.mla_decode import gpu_limits, mla_decode_launch_params

    params = mla_decode_launch_params(target, heads, 512, 64, torch.bfloat16)
    compiled = _compile_mla(target, params.block_h, params.block_n, params.num_warps, params.num_stages)
    assert params.fits
    assert compiled.metadata.shared <= gpu_limits(target).shared_bytes, (params, compiled.metadata.shared)
    assert compiled.metadata.shared <= params.shared_bytes, "the estimate must bound what the compiler allocates"
    assert _spill_bytes(compiled, target) == 0, params
    if heads == 64 and target != "sm_90":  # AMD: all 64 heads in one program, the cache read once
        assert params.block_h == 64, params


def test_spill_check_sees_the_old_fixed_tile_spill():
    # The tile every architecture used before (16 heads x 64 tokens, 4 warps, default stages) spills on
    # MI300X and fills its whole 64 KB of LDS: the no-spill check above is not vacuous.
    compiled = _compile_mla("gfx942", 16, 64, 4, 2)
    assert _spill_bytes(compiled, "gfx942") > 0
    assert compiled.metadata.shared == 64 * 1024


@pytest.mark.parametrize("target", GENERIC_TARGETS)
def test_k3_kda_decode_keeps_its_state_tile_in_registers(target):
    # The fused KDA decode streams the [128, 128] fp32 state in [128, 32] value tiles: the whole tile
    # in one piece spilled on sm_90 (296 bytes per thread at 8 warps, 220 at 16), which this catches.
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, types, consts = _specs()["k3_kda_decode"]
    if not hasattr(fn, "arg_names"):
        pytest.skip("kernel module was imported in interpreter mode")
    signature = {arg: "constexpr" if arg in consts else types.get(arg, "i32") for arg in fn.arg_names}
    compiled = triton.compile(
        ASTSource(fn, signature, consts), target=GPUTarget(*TARGETS[target]), options={"num_warps": 4}
    )
    assert _spill_bytes(compiled, target) == 0


@pytest.mark.parametrize("target", GENERIC_TARGETS)
@pytest.mark.parametrize(
    "name", ["w4a16_split_g128", "mxfp4_split", "fp8_block_split_gathered", "moe_int4_gemm1", "moe_mxfp4_gemm1"]
)
def test_packed_gemms_unpack_in_registers_without_spills(name, target):
    # The INT4 / MXFP4 tiles load each word once and unpack it in registers ([BK/8, 8, BN] -> [BK, BN]);
    # the reshape must not push the tile out to scratch on either target.
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, types, consts = _specs()[name]
    if not hasattr(fn, "arg_names"):
        pytest.skip("kernel module was imported in interpreter mode")
    signature = {arg: "constexpr" if arg in consts else types.get(arg, "i32") for arg in fn.arg_names}
    compiled = triton.compile(
        ASTSource(fn, signature, consts), target=GPUTarget(*TARGETS[target]), options={"num_warps": 4}
    )
    assert _spill_bytes(compiled, target) == 0
