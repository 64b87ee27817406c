"""Fused small-op Triton kernels vs their PyTorch references, under TRITON_INTERPRET=1 on CPU.

The cases run in one child process (``python -m tests.kernels.triton.test_fused_small_ops``): the
interpreter is chosen when ``@triton.jit`` runs, so the variable must be set before any kernel
module is imported, and setting it in the pytest process would leak into GPU tests. fp32 and fp16
(the interpreter's fp32->bf16 cast truncates), odd sizes, strided inputs, ties. The last cases use
``kernels.launch_count`` to show one fused launch replacing the op-by-op reference's kernels.
"""

import os

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from tests.helpers.interpret import case_registry, child_main, needs_triton, run_interpreted
from tests.helpers.interpret import close as _close

CASES, case = case_registry()


# --- residual add + RMSNorm -------------------------------------------------------------------


@case
def fused_add_rms_norm_fp32_odd_hidden():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.fused_add_rms_norm import fused_add_rms_norm

    x, r, w = torch.randn(3, 2, 203), torch.randn(3, 2, 203), torch.rand(203) + 0.5
    y, s = fused_add_rms_norm(x, r, w, 1e-6)
    want_y, want_s = ref.fused_add_rms_norm(x, r, w, 1e-6)
    assert y.shape == (3, 2, 203) and torch.equal(s, want_s)
    _close(y, want_y, 1e-5)


@case
def fused_add_rms_norm_fp16_in_place():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.fused_add_rms_norm import fused_add_rms_norm

    x, r = torch.randn(5, 1000).half(), torch.randn(5, 1000).half()
    w = (torch.rand(1000) + 0.5).half()
    want_y, want_s = ref.fused_add_rms_norm(x, r, w)
    residual = r.clone()
    out = torch.empty_like(x)
    y, s = fused_add_rms_norm(x, residual, w, out=out, residual_out=residual)
    assert y is out and s is residual and y.dtype == torch.float16
    assert torch.equal(residual, want_s)  # the residual stream updated in place, exactly
    _close(y, want_y, 2e-3)  # one fp16 ulp of rsqrt/rounding


@case
def fused_add_rms_norm_fp16_weight_fp32_promotes():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.fused_add_rms_norm import fused_add_rms_norm

    x, r, w = torch.randn(4, 96).half(), torch.randn(4, 96).half(), torch.rand(96) + 0.5
    y, _ = fused_add_rms_norm(x, r, w)
    want_y, _ = ref.fused_add_rms_norm(x, r, w)
    assert y.dtype == want_y.dtype == torch.float32
    _close(y, want_y, 1e-5)


# --- rope of q_pe heads + shared k_pe ---------------------------------------------------------


def _yarn():
    from kimitui.engine.config import RopeScaling
    from kimitui.engine.layers.rope import YarnRotaryEmbedding

    scaling = RopeScaling(
        factor=32.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
    return YarnRotaryEmbedding(64, 50000.0, scaling, max_position=300)


@case
def rope_mla_fp32_strided_views_match_engine():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.rope_fused import rope_mla

    rope = _yarn()
    t, h = 3, 5
    q = torch.randn(t, h, 128 + 64)  # nope then rope channels, as MLA's q
    kv = torch.randn(t, 512 + 64)  # latent then the shared rope key
    pos = torch.tensor([0, 299, 17])
    q_pe, k_pe = q[..., 128:], kv[:, None, 512:]  # strided views, k as [T, 1, R]
    got_q, got_k = rope_mla(q_pe, k_pe, rope.cos, rope.sin, pos)
    want_q, want_k = ref.rope_mla(q_pe, k_pe, rope.cos, rope.sin, pos)
    assert got_k.shape == (t, 1, 64)
    _close(got_q, want_q, 1e-5)
    _close(got_k, want_k, 1e-5)
    # and the engine's own module (complex multiply on CPU) agrees with both
    _close(got_q, rope(q_pe, pos), 1e-5)
    _close(got_k[:, 0], rope(k_pe, pos)[:, 0], 1e-5)


@case
def rope_mla_fp16_in_place_odd_heads():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.rope_fused import rope_mla

    rope = _yarn()
    t, h = 4, 3
    q = torch.randn(t, h, 64 + 64).half()
    kv = torch.randn(t, 32 + 64).half()
    pos = torch.tensor([5, 1, 250, 5], dtype=torch.int32)
    want_q, want_k = ref.rope_mla(q[..., 64:], kv[:, 32:], rope.cos, rope.sin, pos)
    nope_before = q[..., :64].clone()
    q_pe, k_pe = q[..., 64:], kv[:, 32:]
    got_q, got_k = rope_mla(q_pe, k_pe, rope.cos, rope.sin, pos, q_out=q_pe, k_out=k_pe)
    assert got_q.data_ptr() == q_pe.data_ptr() and torch.equal(q[..., :64], nope_before)
    _close(q[..., 64:], want_q, 2e-3)
    _close(kv[:, 32:], want_k, 2e-3)


# --- MLA latent-cache write -------------------------------------------------------------------


def _cache_write_case(dtype, cache_dtype, weight_dtype, tol):
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.mla_cache_write import mla_cache_write

    rope = _yarn()
    t, r = 6, 96  # r not a power of two: masked latent tail
    proj = torch.randn(t, 7 + r + 64).to(dtype)  # a wider projection output: kv is a strided view
    kv = proj[:, 7:]
    w = (torch.rand(r) + 0.5).to(weight_dtype)
    pos = torch.tensor([0, 3, 299, 40, 41, 2])
    slots = torch.tensor([9, 0, -1, 31, 17, 32])  # -1: a padding row; 32: past the cache. Both skipped
    got = torch.full((4, 8, r + 64), 7.0, dtype=cache_dtype)  # [blocks, block_size, r + R]
    want = got.clone()
    mla_cache_write(kv, w, 1e-6, rope.cos, rope.sin, pos, slots, got)
    ref.mla_cache_write(kv, w, 1e-6, rope.cos, rope.sin, pos, slots, want)
    flat = got.view(-1, r + 64)
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[[9, 0, 31, 17]] = False
    assert (flat[untouched] == 7.0).all()  # only the four real rows were written
    _close(got, want, tol)


@case
def mla_cache_write_fp32():
    _cache_write_case(torch.float32, torch.float32, torch.float32, 1e-5)


@case
def mla_cache_write_fp16_activations_fp32_weight_fp16_cache():
    _cache_write_case(torch.float16, torch.float16, torch.float32, 2e-3)


# --- router -----------------------------------------------------------------------------------


@case
def moe_router_grouped_sigmoid_fp32_matches_moe_route():
    import torch.nn.functional as F

    from kimitui.kernels import reference as base
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.moe_router import moe_route_logits

    x, gate, bias = torch.randn(7, 40), torch.randn(24, 40), torch.randn(24) * 0.1
    logits = F.linear(x, gate)  # [T, E]
    args = (6, 4, 2, "sigmoid", True, 2.5)  # top_k, n_group, topk_group, scoring, renorm, scaling
    ids, weights = moe_route_logits(logits, bias, *args)
    want_ids, want_w = ref.moe_route_logits(logits, bias, *args)
    assert ids.dtype == torch.int64 and torch.equal(ids, want_ids), (ids, want_ids)
    _close(weights, want_w, 1e-5)
    base_ids, base_w = base.moe_route(x, gate, bias, *args)  # the engine's router, from x
    assert torch.equal(ids, base_ids)
    _close(weights, base_w, 1e-5)


@case
def moe_router_ties_pick_lower_id_fp16():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.moe_router import moe_route_logits

    # logits from a set of three values: many exact ties between experts and between groups
    logits = (torch.randint(0, 3, (6, 32)).float() - 1).half()
    for args in ((8, 1, 1), (5, 8, 3)):  # Kimi K2 style (no groups); DeepSeek-V3 style groups
        ids, weights = moe_route_logits(logits, None, *args, ids_dtype=torch.int32)
        want_ids, want_w = ref.moe_route_logits(logits, None, *args)
        assert ids.dtype == torch.int32 and torch.equal(ids.long(), want_ids), (args, ids, want_ids)
        _close(weights, want_w, 1e-6)


@case
def moe_router_softmax_odd_experts_no_renorm():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.moe_router import moe_route_logits

    logits = torch.randn(3, 17)
    ids, weights = moe_route_logits(logits, None, 3, scoring_func="softmax", norm_topk_prob=False)
    want_ids, want_w = ref.moe_route_logits(logits, None, 3, scoring_func="softmax", norm_topk_prob=False)
    assert torch.equal(ids, want_ids)
    _close(weights, want_w, 1e-6)


# --- expert alignment -------------------------------------------------------------------------


def _check_align(topk_ids, block, e):
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.moe_align import moe_align_block_size
    from kimitui.kernels.triton.moe_align import moe_align_block_size_torch as aten_align

    got = moe_align_block_size(topk_ids, block, e)
    for want in (ref.moe_align_block_size(topk_ids, block, e), aten_align(topk_ids, block, e)):
        for name, g, w in zip(("sorted_token_ids", "expert_ids", "num_tokens_post_padded"), got, want):
            assert g.dtype == torch.int32 and torch.equal(g, w), (name, g, w)


@case
def moe_align_small_and_elsewhere_pairs():
    ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], dtype=torch.int32) - 1  # vLLM's example
    _check_align(ids, 4, 4)
    ids = torch.randint(0, 9, (5, 3))  # id 8 == E: computed elsewhere, gets no slot
    ids[0, 0] = 8
    _check_align(ids, 4, 8)
    _check_align(torch.randint(0, 5, (1, 2)), 16, 5)  # one token


@case
def moe_align_kimi_shape_384_experts():
    _check_align(torch.stack([torch.randperm(384)[:8] for _ in range(4)]), 16, 384)
    ids = torch.randint(0, 7, (40, 8))  # many pairs on few experts: several chunks, full tiles
    _check_align(ids, 16, 384)


@case
def fused_moe_with_triton_alignment():
    from kimitui.kernels import reference as base
    from kimitui.kernels.triton.fused_moe import fused_moe

    t, d, inter, e, k = 3, 32, 16, 6, 2
    x = torch.randn(t, d)
    topk_ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(torch.int32)
    topk_weights = torch.rand(t, k)
    w13, w2 = torch.randn(e, 2 * inter, d) / 4, torch.randn(e, d, inter) / 4
    _close(
        fused_moe(x, topk_ids, topk_weights, w13, w2),
        base.moe_experts_reference(x, topk_ids, topk_weights, w13, w2),
        1e-4,
    )


# --- launch counts: one fused kernel vs its op-by-op reference --------------------------------


@case
def launch_count_fused_norm_vs_reference():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.launch_count import count_launches
    from kimitui.kernels.triton.fused_add_rms_norm import fused_add_rms_norm

    x, r, w = torch.randn(2, 64).half(), torch.randn(2, 64).half(), torch.rand(64).half()
    with count_launches() as fused:
        fused_add_rms_norm(x, r, w)
    with count_launches() as eager:
        ref.fused_add_rms_norm(x, r, w)
    assert dict(fused.triton) == {"_fused_add_rms_norm_kernel": 1} and fused.kernels == 1, fused
    assert eager.kernels >= 6 and not eager.triton, eager  # add, cast, pow, mean, rsqrt, mul...
    assert not fused.host_syncs and not eager.host_syncs
    return f"fused: {fused.summary()}; reference: {eager.summary()}"


@case
def launch_count_alignment_vs_aten():
    from kimitui.kernels.launch_count import count_launches
    from kimitui.kernels.triton.moe_align import moe_align_block_size
    from kimitui.kernels.triton.moe_align import moe_align_block_size_torch as aten_align

    ids = torch.stack([torch.randperm(384)[:8] for _ in range(4)])
    with count_launches() as fused:
        moe_align_block_size(ids, 16, 384)
    with count_launches() as eager:
        aten_align(ids, 16, 384)
    assert fused.kernels == 1 and not fused.host_syncs, fused
    assert eager.kernels > 15, eager
    return f"fused: {fused.summary()}; ATen: {eager.summary()}"


@case
def launch_count_rope_router_cache_write_vs_reference():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.launch_count import count_launches
    from kimitui.kernels.triton.mla_cache_write import mla_cache_write
    from kimitui.kernels.triton.moe_router import moe_route_logits
    from kimitui.kernels.triton.rope_fused import rope_mla

    rope = _yarn()
    q, kv, pos = torch.randn(2, 4, 64), torch.randn(2, 32 + 64), torch.tensor([3, 9])
    logits, bias = torch.randn(2, 64), torch.randn(64)
    cache, slots, w = torch.zeros(2, 16, 96), torch.tensor([4, 20]), torch.rand(32)
    calls = {
        "rope": (
            lambda: rope_mla(q, kv[:, 32:], rope.cos, rope.sin, pos),
            lambda: ref.rope_mla(q, kv[:, 32:], rope.cos, rope.sin, pos),
        ),
        "router": (
            lambda: moe_route_logits(logits, bias, 8, 8, 4, scaling=2.8),
            lambda: ref.moe_route_logits(logits, bias, 8, 8, 4, scaling=2.8),
        ),
        "cache write": (
            lambda: mla_cache_write(kv, w, 1e-6, rope.cos, rope.sin, pos, slots, cache),
            lambda: ref.mla_cache_write(kv, w, 1e-6, rope.cos, rope.sin, pos, slots, cache),
        ),
    }
    notes = []
    for name, (fused_call, eager_call) in calls.items():
        with count_launches() as fused:
            fused_call()
        with count_launches() as eager:
            eager_call()
        assert fused.kernels == sum(fused.triton.values()) == 1, (name, fused)
        assert eager.kernels >= 5, (name, eager)
        notes.append(f"{name} {fused.kernels} vs {eager.kernels}")
    return "kernels fused vs reference: " + ", ".join(notes)


if __name__ == "__main__":
    child_main(CASES)


# --- pytest side ------------------------------------------------------------------------------

pytestmark = needs_triton


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreted("tests.kernels.triton.test_fused_small_ops")


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_kernel_matches_reference(name, interpreter_results):
    result = interpreter_results.get(name, "case did not run")
    print(result)  # the launch-count cases report their numbers
    assert result.startswith("ok"), result


def _bad_calls():
    from kimitui.kernels.triton.fused_add_rms_norm import fused_add_rms_norm
    from kimitui.kernels.triton.mla_cache_write import mla_cache_write
    from kimitui.kernels.triton.moe_align import moe_align_block_size
    from kimitui.kernels.triton.moe_router import moe_route_logits
    from kimitui.kernels.triton.rope_fused import rope_mla

    x, cs = torch.randn(2, 8), torch.zeros(10, 4)
    return [
        (lambda: fused_add_rms_norm(x, x.half(), torch.ones(8)), "residual must be torch.float32"),
        (lambda: fused_add_rms_norm(x, x, torch.ones(7)), r"weight must be contiguous \[H=8\]"),
        (lambda: fused_add_rms_norm(x.int(), x, torch.ones(8)), "x must be fp16/bf16/fp32"),
        (
            lambda: rope_mla(torch.randn(2, 3, 8), torch.randn(2, 6), cs, cs, torch.zeros(2).long()),
            r"k_pe must be \[T=2, R=8\]",
        ),
        (
            lambda: rope_mla(torch.randn(2, 3, 8), torch.randn(2, 8), cs, cs, torch.zeros(3).long()),
            r"positions must be int32/int64 \[T=2\]",
        ),
        (
            lambda: rope_mla(torch.randn(2, 3, 8), torch.randn(2, 8), cs.double(), cs, torch.zeros(2).long()),
            "cos must be contiguous fp32",
        ),
        (lambda: moe_route_logits(torch.randn(2, 12), None, 3, n_group=5), "n_group=5 must divide E=12"),
        (
            lambda: moe_route_logits(torch.randn(2, 12), None, 7, n_group=4, topk_group=2),
            r"top_k=7 must be in \[1, 6\]",
        ),
        (lambda: moe_route_logits(torch.randn(2, 12), torch.zeros(11), 2), r"bias must be a contiguous float \[E=12\]"),
        (lambda: moe_align_block_size(torch.zeros(2, 2), 16, 8), "topk_ids must be int32/int64"),
        (
            lambda: mla_cache_write(
                torch.randn(2, 12),
                torch.ones(8),
                1e-6,
                torch.zeros(10, 2),
                torch.zeros(10, 2),
                torch.zeros(2).long(),
                torch.zeros(2).long(),
                torch.zeros(4, 13),
            ),
            r"cache must be contiguous fp16/bf16/fp32 \[..., 12\]",
        ),
        (lambda: fused_add_rms_norm(x, x, torch.ones(8)), "need a CUDA/ROCm tensor"),  # valid, but on a CPU
    ]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the last call is valid under the interpreter")
@pytest.mark.parametrize("index", range(12))
def test_bad_input_is_one_clear_line(index):
    call, match = _bad_calls()[index]
    with pytest.raises(ValueError, match=match) as info:
        call()
    assert "\n" not in str(info.value)
