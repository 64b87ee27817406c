"""Triton kernels vs the PyTorch reference under TRITON_INTERPRET=1, on CPU tensors.

Run as ``python -m tests.kernels.triton.interpret_cases [case ...]`` in a fresh process (test_triton_interpret
does this): the interpreter is chosen when ``@triton.jit`` runs, so the variable must be set before
any kernel module is imported, and setting it inside the pytest process would leak into GPU tests.
Shapes are tiny because the interpreter costs ~5 ms per program per K-step (measured on a 2-core VM,
triton 3.9: it runs every program serially in numpy).
The interpreter's ``tl.dot`` is wrong for bf16 (it multiplies the raw uint16 bits; triton issue
#11584), so cases use fp32 and fp16.
"""

import os

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import torch

from tests.helpers.interpret import case_registry, child_main
from tests.helpers.interpret import close as _close

CASES, case = case_registry()


@case
def w4a16_gemm_fp32_ragged_k():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.gemm.w4a16 import w4a16_gemm

    # K = 76: not a multiple of 8 (last word half used) nor of 32 (partial last group).
    x, w = torch.randn(5, 76), torch.randn(48, 76)
    packed, scale = ref.quantize_int4(w, group_size=32)
    assert (packed < 0).any(), "want negative words in the test"
    _close(w4a16_gemm(x, packed, scale, 32), ref.linear_w4a16(x, packed, scale, 76, 32), 1e-4)


@case
def w4a16_gemm_fp16_group128():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.gemm.w4a16 import w4a16_gemm

    x, w = torch.randn(3, 128).half(), torch.randn(70, 128)
    packed, scale = ref.quantize_int4(w.half(), group_size=128)
    out = w4a16_gemm(x, packed, scale, 128)
    assert out.dtype == torch.float16 and out.shape == (3, 70)
    _close(out, ref.linear_w4a16(x.float(), packed, scale, 128, 128), 2e-2)


@case
def mxfp4_gemm_fp32():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.gemm.mxfp4 import mxfp4_gemm

    x = torch.randn(4, 64)
    packed = torch.randint(0, 256, (24, 32), dtype=torch.uint8)  # every code, both nibbles
    scale = torch.randint(117, 137, (24, 2), dtype=torch.uint8)
    _close(mxfp4_gemm(x, packed, scale), ref.linear_mxfp4(x, packed, scale), 1e-4)


@case
def mxfp4_gemm_fp16():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.gemm.mxfp4 import mxfp4_gemm

    x = torch.randn(2, 96).half()
    packed, scale = ref.quantize_mxfp4(torch.randn(40, 96))
    _close(mxfp4_gemm(x, packed, scale), ref.linear_mxfp4(x.float(), packed, scale), 2e-2)


@case
def fp8_block_gemm_partial_blocks():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.gemm.fp8_block import fp8_block_gemm

    # N = 70, K = 96 with 32x32 quant blocks: quant blocks and 64-wide tiles do not align.
    x, w = torch.randn(3, 96), torch.randn(70, 96)
    q, s = ref.quantize_fp8_block(w, block=(32, 32))
    _close(fp8_block_gemm(x, q, s, (32, 32)), ref.linear_fp8_block(x, q, s, (32, 32)), 1e-4)
    q, s = ref.quantize_fp8_block(w)  # one partial 128x128 block
    _close(fp8_block_gemm(x.half(), q, s).float(), ref.linear_fp8_block(x, q, s), 2e-2)


def _moe_inputs(t=5, d=32, inter=24, e=4, k=2, dtype=torch.float32):
    x = torch.randn(t, d).to(dtype)
    topk_ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(torch.int32)
    topk_weights = torch.rand(t, k)
    w13 = (torch.randn(e, 2 * inter, d) / 4).to(dtype)
    w2 = (torch.randn(e, d, inter) / 4).to(dtype)
    return x, topk_ids, topk_weights, w13, w2


@case
def fused_moe_fp32():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.fused_moe import fused_moe

    args = _moe_inputs()
    _close(fused_moe(*args), ref.moe_experts_reference(*args), 1e-4)


@case
def fused_moe_fp16_idle_experts():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.fused_moe import fused_moe

    x, topk_ids, topk_weights, w13, w2 = _moe_inputs(t=3, e=8, dtype=torch.float16)
    topk_ids[:, 0] = 5  # every token on expert 5; experts 0..7 partly idle
    out = fused_moe(x, topk_ids, topk_weights, w13, w2)
    assert out.dtype == torch.float16
    expected = ref.moe_experts_reference(x.float(), topk_ids, topk_weights, w13.float(), w2.float())
    _close(out, expected, 2e-2)


@case
def fused_moe_pairs_computed_elsewhere():
    # Expert parallel: ids equal to E mark pairs another rank (or host RAM) computes; they add nothing.
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.fused_moe import fused_moe

    x, topk_ids, topk_weights, w13, w2 = _moe_inputs(t=7, e=4, k=3)
    elsewhere = torch.rand(topk_ids.shape) < 0.4
    elsewhere[0] = True  # one token routed entirely elsewhere
    ids = torch.where(elsewhere, torch.full_like(topk_ids, 4), topk_ids)
    got = fused_moe(x, ids, topk_weights, w13, w2)
    # The same function with those pairs on expert 0 at weight zero.
    expected = ref.moe_experts_reference(
        x, torch.where(elsewhere, 0, topk_ids), topk_weights.masked_fill(elsewhere, 0.0), w13, w2
    )
    _close(got, expected, 1e-4)
    assert got[0].abs().max() == 0


@case
def fused_moe_w4a16_fp32():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.fused_moe import fused_moe_w4a16

    d, inter, e = 36, 24, 4  # D not a multiple of 8 or 32
    x, topk_ids, topk_weights, w13, w2 = _moe_inputs(d=d, inter=inter, e=e)
    p13, s13 = (torch.stack(t) for t in zip(*[ref.quantize_int4(w13[i]) for i in range(e)]))
    p2, s2 = (torch.stack(t) for t in zip(*[ref.quantize_int4(w2[i]) for i in range(e)]))
    got = fused_moe_w4a16(x, topk_ids, topk_weights, p13, s13, p2, s2, 32)
    expected = ref.moe_experts_reference_w4a16(x, topk_ids, topk_weights, p13, s13, p2, s2, 32)
    _close(got, expected, 1e-4)


def _stack(fn, w):
    return [torch.stack(p) for p in zip(*[fn(w[i]) for i in range(w.shape[0])])]


@case
def fused_moe_mxfp4_fp32_and_fp16():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.fused_moe import fused_moe_mxfp4

    x, topk_ids, topk_weights, w13, w2 = _moe_inputs(t=6, d=64, inter=32, e=5, k=2)
    topk_ids[0, 1] = 5  # one pair computed elsewhere
    p13, s13 = _stack(ref.quantize_mxfp4, w13)
    p2, s2 = _stack(ref.quantize_mxfp4, w2)
    expected = ref.moe_experts_reference_mxfp4(x, topk_ids, topk_weights, p13, s13, p2, s2)
    _close(fused_moe_mxfp4(x, topk_ids, topk_weights, p13, s13, p2, s2), expected, 1e-4)
    # fp16, not bf16: the interpreter multiplies bf16 dots as raw bits (triton issue #11584)
    got = fused_moe_mxfp4(x.half(), topk_ids, topk_weights, p13, s13, p2, s2)
    assert got.dtype == torch.float16
    _close(got.float(), expected, 2e-2)


@case
def fused_moe_fp8_partial_blocks():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.fused_moe import fused_moe_fp8

    block = (16, 32)  # D = 40 and I = 16: the K side of both GEMMs ends in a partial block
    x, topk_ids, topk_weights, w13, w2 = _moe_inputs(t=5, d=40, inter=16, e=4, k=2)
    topk_ids[2, 0] = 4  # one pair computed elsewhere
    f13, fs13 = _stack(lambda w: ref.quantize_fp8_block(w, block), w13)
    f2, fs2 = _stack(lambda w: ref.quantize_fp8_block(w, block), w2)
    expected = ref.moe_experts_reference_fp8(x, topk_ids, topk_weights, f13, fs13, f2, fs2, block)
    _close(fused_moe_fp8(x, topk_ids, topk_weights, f13, fs13, f2, fs2, block), expected, 1e-4)


def _paged_latents(lens, width, block_size=16, dtype=torch.float32):
    # A shuffled pool of blocks, so that each sequence's blocks are scattered and out of order.
    tables = []
    pool = torch.randperm(sum(-(-n // block_size) for n in lens) + 3).tolist()
    for n in lens:
        tables.append([pool.pop() for _ in range(-(-n // block_size))])
    width_blocks = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width_blocks - len(t)) for t in tables], dtype=torch.int32)
    cache = torch.randn((max(max(t) for t in tables) + 1) * block_size, width).to(dtype)
    return cache, table, torch.tensor(lens, dtype=torch.int32)


@case
def mla_decode_paged_splits_fp32_fp16():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.mla_decode import mla_decode

    r, rope, heads = 32, 8, 20  # 20 heads: a partial head block; rope 8: a padded dot
    lens = [1, 37, 70]  # 70 splits in two; the 37-token sequence leaves its second split empty
    cache, table, ctx = _paged_latents(lens, r + rope)
    q = torch.randn(len(lens), heads, r + rope)
    expected = ref.mla_decode_reference(q, cache, table, ctx, max(lens), 16, r, 0.125)
    _close(mla_decode(q, cache, table, ctx, max(lens), 16, r, 0.125), expected, 1e-4)
    got = mla_decode(q.half(), cache.half(), table, ctx, max(lens), 16, r, 0.125)
    assert got.dtype == torch.float16 and got.shape == (3, heads, r)
    _close(got, expected, 2e-2)


@case
def rms_norm_fp32_fp16_bf16():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.rms_norm import rms_norm

    x = torch.randn(2, 3, 100)  # H not a power of two: masked tail
    weight = torch.rand(100) + 0.5
    _close(rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6), 1e-5)
    _close(rms_norm(x.half(), weight.half(), 1e-6), ref.rms_norm(x.half(), weight.half(), 1e-6), 2e-3)
    # Interpreter fp32 -> bf16 casts truncate (round toward zero, not to nearest): allow 2 bf16 ulps.
    got = rms_norm(x.bfloat16(), weight.bfloat16(), 1e-6)
    assert got.dtype == torch.bfloat16
    _close(got, ref.rms_norm(x.bfloat16(), weight.bfloat16(), 1e-6), 2e-2)


@case
def engine_on_the_device_path_matches_the_cpu_path():
    # The whole engine on the Triton backend (device emulation: the kernels interpreted here, on
    # CPU tensors): fused MoE for dense/INT4/MXFP4/FP8 experts, the quantised GEMMs and the paged
    # MLA decode, against the PyTorch path the CPU runs.
    import tempfile
    from pathlib import Path

    from kimitui.engine import LLM, SamplingParams
    from tests.helpers.checkpoints import write_hf_checkpoint
    from tests.helpers.quantized import quantize_checkpoint

    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)
    prompts = [[5, 17, 3, 99, 41, 7], [250, 2, 8]]
    for method in ("dense", "int4", "mxfp4", "fp8"):
        with tempfile.TemporaryDirectory() as tmp:
            hf = write_hf_checkpoint(Path(tmp), seed=11, num_hidden_layers=2)
            if method != "dense":
                quantize_checkpoint(Path(tmp), method, hf)
            runs = []
            for device_path in (False, True):
                # KIMITUI_EMULATE_DEVICE=1 (read when the model loads): the Triton backend on CPU tensors
                saved = os.environ.get("KIMITUI_EMULATE_DEVICE")
                os.environ["KIMITUI_EMULATE_DEVICE"] = "1" if device_path else "0"
                try:
                    llm = LLM(tmp, max_model_len=64, max_num_seqs=2, enable_prefix_caching=False)
                    assert type(llm.engine.model.model.layers[0].self_attn.ops).__name__ == (
                        "TritonBackend" if device_path else "CpuBackend"
                    )
                    runs.append(
                        [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
                    )
                finally:
                    if saved is None:
                        os.environ.pop("KIMITUI_EMULATE_DEVICE")
                    else:
                        os.environ["KIMITUI_EMULATE_DEVICE"] = saved
            for cpu, dev in zip(*runs):
                assert cpu.token_ids == dev.token_ids, (method, cpu.token_ids, dev.token_ids)
                for a, b, t in zip(cpu.logprobs, dev.logprobs, cpu.token_ids):
                    assert abs(a[t] - b[t]) < 1e-3, (method, a[t], b[t])


if __name__ == "__main__":
    child_main(CASES)
