"""Decode GEMVs fill the device: split-K for the FP8, INT4 (w4a16) and MXFP4 weight GEMMs.

Launch half (plain CPU, nothing runs): for Kimi K2's and K3's real projection shapes at M = 1..16,
the grid each wrapper launches (recorded in place of the kernel, on meta tensors) has at least
``TARGET_PROGRAMS`` (2 x MI355X's 256 CUs) programs, or one K-step per program where the shape has
fewer tiles x K-steps than that. Before, ``kv_a_proj_with_mqa`` (7168 -> 576) launched 9 programs.
The dense bf16 projections are ``F.linear`` (cuBLAS / hipBLASLt pick their own split-K) and are not
in this list.

Interpreter half (child process, TRITON_INTERPRET=1): the split kernels and the reduction against
the PyTorch reference on small shapes, every scale path (INT4 groups smaller than, larger than and
not dividing the tile; FP8 quant blocks aligned and not), split and unsplit.
"""

import os

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from tests.helpers.interpret import (
    case_registry,
    child_main,
    close,
    needs_triton,
    run_interpreted,
)

CASES, case = case_registry()

# (N, K) of the weight GEMMs a decode step runs, from the models' configs (K2: DeepSeek-V3 layout,
# hidden 7168, q_lora 1536, kv_lora 512 + rope 64, 64 heads of 128 + 64 / 128, MoE intermediate
# 2048, dense layer 18432; K3: config.json's text_config and its tensor table, hidden 7168, 96 heads,
# KDA head_dim 128, experts 3072 wide in a 3584 latent, shared experts 6144, dense layer 33792).
K2_SHAPES = {
    "k2_q_a_proj": (1536, 7168),
    "k2_q_b_proj": (12288, 1536),
    "k2_kv_a_proj_with_mqa": (576, 7168),
    "k2_kv_b_proj": (16384, 512),
    "k2_o_proj": (7168, 8192),
    "k2_expert_gate_up": (4096, 7168),
    "k2_expert_gate": (2048, 7168),
    "k2_expert_down": (7168, 2048),
    "k2_dense_gate_up": (36864, 7168),
    "k2_dense_down": (7168, 18432),
    "k2_lm_head": (163840, 7168),
}
K3_SHAPES = {
    "k3_q_a_proj": (1536, 7168),
    "k3_q_b_proj": (18432, 1536),
    "k3_kv_a_proj_with_mqa": (576, 7168),
    "k3_kv_b_proj": (24576, 512),
    "k3_mla_g_proj": (12288, 7168),
    "k3_o_proj": (7168, 12288),
    "k3_kda_qkv": (12288, 7168),
    "k3_kda_f_a_proj": (128, 7168),
    "k3_kda_f_b_proj": (12288, 128),
    "k3_kda_b_proj": (96, 7168),
    "k3_routed_expert_down_proj": (3584, 7168),
    "k3_routed_expert_up_proj": (7168, 3584),
    "k3_expert_w1": (3072, 3584),
    "k3_expert_w2": (3584, 3072),
    "k3_shared_gate": (6144, 7168),
    "k3_shared_down": (7168, 6144),
    "k3_dense_gate": (33792, 7168),
    "k3_dense_down": (7168, 33792),
}
SHAPES = {**K2_SHAPES, **K3_SHAPES}
MI355X_CUS = 256


# --- interpreter cases ------------------------------------------------------------------------


@case
def w4a16_split_k_every_scale_path():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.gemm.w4a16 import w4a16_gemm
    from kimitui.kernels.triton.split_k import plan_gemm

    notes = []
    # (M, N, K, group): groups of 32 (2 per 64-wide tile), of 128 (a tile inside a group), of 48
    # (neither: gathered per element), ragged K (last word half used); M = 70: no split
    for m, n, k, g in ((3, 40, 512, 32), (1, 24, 640, 128), (5, 16, 480, 48), (2, 33, 300, 32), (70, 20, 192, 32)):
        x, w = torch.randn(m, k), torch.randn(n, k)
        packed, scale = ref.quantize_int4(w, group_size=g)
        plan = plan_gemm(m, n, k)
        assert (plan.split > 1) == (m <= 16), plan
        close(w4a16_gemm(x, packed, scale, g), ref.linear_w4a16(x, packed, scale, k, g), 1e-4)
        notes.append(f"{m}x{n}x{k}/g{g}: split {plan.split}")
    x = torch.randn(4, 256).half()  # fp16 activations, split partials in fp32, one rounding
    packed, scale = ref.quantize_int4(torch.randn(48, 256).half(), group_size=32)
    close(w4a16_gemm(x, packed, scale, 32), ref.linear_w4a16(x.float(), packed, scale, 256, 32), 2e-2)
    return "; ".join(notes)


@case
def mxfp4_split_k():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.gemm.mxfp4 import mxfp4_gemm
    from kimitui.kernels.triton.split_k import plan_gemm

    for m, n, k in ((1, 24, 320), (6, 70, 256), (40, 16, 96)):
        x = torch.randn(m, k)
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)  # every code, both nibbles
        scale = torch.randint(117, 137, (n, k // 32), dtype=torch.uint8)
        assert (plan_gemm(m, n, k).split > 1) == (k > 64 and m <= 64)
        close(mxfp4_gemm(x, packed, scale), ref.linear_mxfp4(x, packed, scale), 1e-4)
    x = torch.randn(3, 256).half()
    packed = torch.randint(0, 256, (32, 128), dtype=torch.uint8)
    scale = torch.randint(120, 130, (32, 8), dtype=torch.uint8)
    close(mxfp4_gemm(x, packed, scale), ref.linear_mxfp4(x.float(), packed, scale), 3e-2)


@case
def fp8_split_k_aligned_and_gathered_scales():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.gemm.fp8_block import fp8_block_gemm
    from kimitui.kernels.triton.split_k import plan_gemm

    for m, n, k, block in ((2, 72, 384, (128, 128)), (5, 50, 300, (48, 80)), (3, 130, 256, (128, 64))):
        x, w = torch.randn(m, k), torch.randn(n, k)
        w_fp8, scale_inv = ref.quantize_fp8_block(w, block)
        assert plan_gemm(m, n, k).split > 1
        close(fp8_block_gemm(x, w_fp8, scale_inv, block), ref.linear_fp8_block(x, w_fp8, scale_inv, block), 1e-4)


@case
def split_k_is_two_launches_and_no_host_sync():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.launch_count import count_launches
    from kimitui.kernels.triton.gemm.w4a16 import w4a16_gemm

    x = torch.randn(2, 512)
    packed, scale = ref.quantize_int4(torch.randn(32, 512), group_size=32)
    with count_launches() as counts:
        w4a16_gemm(x, packed, scale, 32)
    assert dict(counts.triton) == {"_w4a16_gemm_kernel": 1, "_split_k_reduce_kernel": 1}, counts
    assert not counts.host_syncs, counts
    return counts.summary()


if __name__ == "__main__":
    child_main(CASES)


# --- pytest side ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreted("tests.kernels.triton.test_split_k")


@needs_triton
@pytest.mark.parametrize("name", sorted(CASES))
def test_interpreted(name, interpreter_results):
    result = interpreter_results.get(name, "case did not run")
    print(result)
    assert result.startswith("ok"), result


class _Recorder:
    """Stands in for a Triton kernel: records the grid and arguments of each launch."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, args, kwargs))

        return launch


def _weights(fmt, n, k):
    meta = dict(device="meta")
    if fmt == "fp8":
        return (
            torch.empty(n, k, dtype=torch.float8_e4m3fn, **meta),
            torch.empty(-(-n // 128), -(-k // 128), dtype=torch.float32, **meta),
        ), ((128, 128),)
    if fmt == "int4":
        return (
            torch.empty(n, -(-k // 8), dtype=torch.int32, **meta),
            torch.empty(n, -(-k // 32), dtype=torch.bfloat16, **meta),
        ), (32,)
    return (torch.empty(n, k // 2, dtype=torch.uint8, **meta), torch.empty(n, k // 32, dtype=torch.uint8, **meta)), ()


@needs_triton
@pytest.mark.parametrize("fmt", ["fp8", "int4", "mxfp4"])
def test_decode_launch_fills_the_device_on_kimi_shapes(fmt, monkeypatch):
    import kimitui.kernels.triton.gemm.fp8_block as fp8_mod
    import kimitui.kernels.triton.gemm.mxfp4 as mxfp4_mod
    import kimitui.kernels.triton.gemm.w4a16 as w4a16_mod
    from kimitui.kernels.triton import split_k

    module, kernel, wrapper = {
        "fp8": (fp8_mod, "_fp8_block_gemm_kernel", fp8_mod.fp8_block_gemm),
        "int4": (w4a16_mod, "_w4a16_gemm_kernel", w4a16_mod.w4a16_gemm),
        "mxfp4": (mxfp4_mod, "_mxfp4_gemm_kernel", mxfp4_mod.mxfp4_gemm),
    }[fmt]
    gemm, reduce = _Recorder(), _Recorder()
    monkeypatch.setattr(module, kernel, gemm)
    monkeypatch.setattr(module, "check_device", lambda *tensors: None)  # meta tensors, nothing runs
    monkeypatch.setattr(split_k, "_split_k_reduce_kernel", reduce)
    rows = []
    for name, (n, k) in SHAPES.items():
        weights, extra = _weights(fmt, n, k)
        for m in range(1, 17):
            gemm.launches.clear()
            reduce.launches.clear()
            out = wrapper(torch.empty(m, k, dtype=torch.bfloat16, device="meta"), *weights, *extra)
            assert out.shape == (m, n)
            ((grid, args, meta),) = gemm.launches
            plan = split_k.plan_gemm(m, n, k)
            assert tuple(grid) == plan.grid, (name, m, grid, plan)
            programs = grid[0] * grid[1] * grid[2]
            k_steps = -(-k // meta["BLOCK_K"])
            steps = -(-k_steps // grid[2])
            # at least 2x the CUs of an MI355X, or (shapes with fewer tiles x K-steps) one K-step each
            assert programs >= 2 * MI355X_CUS or steps == 1, (name, m, grid, steps)
            assert meta["SPLIT"] == (grid[2] > 1) and len(reduce.launches) == (grid[2] > 1), (name, m, meta)
            if m in (1, 16):
                rows.append(f"{name} M={m}: grid {grid}, {programs} programs, {steps} K-steps each")
    print("\n".join(rows))


def test_plan_covers_k_exactly():
    from kimitui.kernels.triton.split_k import TARGET_PROGRAMS, plan_gemm

    for n, k in list(SHAPES.values()) + [(48, 76), (5, 64), (1, 1), (100, 65)]:
        for m in (1, 7, 16, 17, 64, 65, 300):
            plan = plan_gemm(m, n, k)
            # every K-step in exactly one split, none empty
            assert (plan.split - 1) * plan.steps_per_split < plan.k_steps <= plan.split * plan.steps_per_split, plan
            if m <= 64:  # at least TARGET_PROGRAMS programs, or one K-step each
                assert plan.programs >= TARGET_PROGRAMS or plan.steps_per_split == 1, plan
            else:  # the M x N tiles fill the device: no partials
                assert plan.split == 1, plan
