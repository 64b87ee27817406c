"""The launch cuts of the decode step vs their PyTorch forms, under TRITON_INTERPRET=1 on CPU.

The gated activation (``kernels.gated_act``), the fused MoE's combine of the k slots
(``kernels.fused_moe.moe_combine``), the router's weights in the experts' dtype and its routing
statistics (``kernels.moe_router``), the query rope written into the tail of the absorbed query
buffer. Same plumbing as ``test_fused_small_ops``: the cases run once in a child process with the
interpreter on, each reported as its own test; the launch-count cases show the launches saved.
"""

import os

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.interpret import case_registry, child_main, needs_triton, run_interpreted
from tests.helpers.interpret import close as _close

CASES, case = case_registry()


# --- gated activation: act(gate) * up from the fused gate/up product ---------------------------


@case
def gated_act_silu_fp16_bit_exact_strided_rows():
    from kimitui.kernels.triton.gated_act import gated_act

    wide = torch.randn(5, 2 * 40 + 8).half() * 4
    gu = wide[:, :80]  # rows strided by 88: the kernel reads through the row stride
    got = gated_act(gu)
    want = F.silu(gu[:, :40]) * gu[:, 40:]  # two ops, two fp16 roundings: matched exactly
    assert got.shape == (5, 40) and got.dtype == torch.float16
    assert torch.equal(got, want), (got - want).abs().max()


@case
def gated_act_silu_fp32_odd_width_3d():
    from kimitui.kernels.triton.gated_act import gated_act

    gu = torch.randn(2, 3, 2 * 1100)  # more than one column block (1024), odd remainder
    _close(gated_act(gu), F.silu(gu[..., :1100]) * gu[..., 1100:], 1e-6)


@case
def gated_act_situ_matches_activation_module():
    from kimitui.engine.layers.activation import GatedActivation
    from kimitui.kernels.triton.gated_act import gated_act

    gu = torch.randn(4, 2 * 24) * 6  # large values: tanh saturates, exp overflows to inf
    for act in (GatedActivation("situ", 2.0, None), GatedActivation("situ", 1.5, 3.0)):
        want = act(gu[:, :24], gu[:, 24:])
        _close(gated_act(gu, act.kind, act.beta, act.linear_beta), want, 2e-6)
        got16 = gated_act(gu.half(), act.kind, act.beta, act.linear_beta)
        _close(got16, act(gu[:, :24].half(), gu[:, 24:].half()), 2e-3)


@case
def backend_gated_act_equals_reference_backend():
    from kimitui.engine.layers.activation import GatedActivation
    from kimitui.kernels.backend import REFERENCE
    from kimitui.kernels.triton.backend import TritonBackend

    gu = torch.randn(3, 64).half()
    act = GatedActivation()
    assert torch.equal(TritonBackend().gated_act(gu, act), REFERENCE.gated_act(gu, act))


# --- fused MoE: the k slots summed and cast in one launch ---------------------------------------


@case
def moe_combine_skips_elsewhere_rows_never_reads_them():
    from kimitui.kernels.triton.fused_moe import moe_combine

    t, k, d, e = 4, 3, 70, 5
    pairs = torch.randn(t * k, d)
    ids = torch.randint(0, e, (t, k))
    ids[0, 1] = ids[2, 0] = ids[2, 2] = e  # computed elsewhere: their rows hold garbage (NaN)
    for row in (0 * k + 1, 2 * k + 0, 2 * k + 2):
        pairs[row] = float("nan")
    want = torch.where((ids < e)[..., None], pairs.view(t, k, d), 0.0).sum(dim=1)
    got = moe_combine(pairs, ids, e, torch.float32)
    assert torch.equal(got, want), (got - want).abs().max()  # slot order, fp32: the same sum
    got16 = moe_combine(pairs, ids.int(), e, torch.float16)
    assert got16.dtype == torch.float16 and torch.equal(got16, want.half())


@case
def fused_moe_elsewhere_pairs_match_reference():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.fused_moe import fused_moe

    t, d, inter, e, k = 5, 32, 16, 6, 3
    x = torch.randn(t, d).half()
    ids = torch.stack([torch.randperm(e + 1)[:k] for _ in range(t)])  # id e: another rank's expert
    w = torch.rand(t, k).half()
    w13, w2 = (torch.randn(e, 2 * inter, d) / 4).half(), (torch.randn(e, d, inter) / 4).half()
    _close(fused_moe(x, ids, w, w13, w2), ref.moe_experts_reference(x, ids, w, w13, w2), 2e-3)


# --- router: weights in the experts' dtype, routing statistics in the same launch ---------------


@case
def moe_router_weights_dtype_and_counts():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.moe_router import moe_route_logits

    logits, bias = torch.randn(9, 32), torch.randn(32) * 0.1
    args = (4, 4, 2, "sigmoid", True, 2.5)
    want_ids, want_w = ref.moe_route_logits(logits, bias, *args)
    counts = torch.zeros(32, dtype=torch.int64)
    for _ in range(2):  # statistics add up over calls
        ids, w16 = moe_route_logits(logits, bias, *args, weights_dtype=torch.float16, counts=counts)
    assert torch.equal(ids, want_ids) and w16.dtype == torch.float16
    assert torch.equal(w16, moe_route_logits(logits, bias, *args)[1].half())  # one rounding, from fp32
    want_counts = torch.zeros(32, dtype=torch.int64).index_add_(0, want_ids.reshape(-1), torch.ones(36).long())
    assert torch.equal(counts, 2 * want_counts), (counts, want_counts)
    c32 = torch.zeros(32, dtype=torch.int32)
    moe_route_logits(logits, bias, *args, counts=c32)
    assert torch.equal(c32.long(), want_counts)


@case
def backend_router_counts_match_reference_backend():
    from kimitui.kernels.backend import REFERENCE
    from kimitui.kernels.triton.backend import TritonBackend

    x, gate, bias = torch.randn(6, 40).half(), torch.randn(16, 40), torch.randn(16) * 0.1
    args = (4, 2, 1, "sigmoid", True, 1.5)
    ca, cb = torch.zeros(16, dtype=torch.int64), torch.zeros(16, dtype=torch.int64)
    ids, w = TritonBackend().moe_route(x, gate, bias, *args, counts=ca, weights_dtype=torch.float16)
    want_ids, want_w = REFERENCE.moe_route(x, gate, bias, *args, counts=cb, weights_dtype=torch.float16)
    assert torch.equal(ids, want_ids) and torch.equal(ca, cb) and ca.sum() == 6 * 4
    assert w.dtype == want_w.dtype == torch.float16
    _close(w, want_w, 1e-3)


# --- residual add + norm with the router's fp32 copy -------------------------------------------


@case
def add_rms_norm_fp32_copy_is_exact():
    from kimitui.kernels.backend import REFERENCE
    from kimitui.kernels.triton.backend import TritonBackend
    from kimitui.kernels.triton.fused_add_rms_norm import fused_add_rms_norm

    x, r, w = torch.randn(3, 72).half(), torch.randn(3, 72).half(), (torch.rand(72) + 0.5).half()
    out32 = torch.full((3, 72), float("nan"))
    out, s = fused_add_rms_norm(x, r, w, out32=out32)
    assert torch.equal(out32, out.float())
    got = TritonBackend().add_rms_norm_fp32(x.clone(), r, w)
    want = REFERENCE.add_rms_norm_fp32(x.clone(), r, w)
    for g, e, dtype in zip(got, want, (torch.float16, torch.float16, torch.float32)):
        assert g.dtype == e.dtype == dtype
        _close(g, e, 2e-3)
    assert torch.equal(got[2], got[0].float())
    x32 = torch.randn(2, 16)  # fp32 activations: the output is its own fp32 copy, no second tensor
    got = TritonBackend().add_rms_norm_fp32(x32.clone(), x32, torch.ones(16))
    assert got[2] is got[0]


# --- MLA: the roped q_pe written into the tail of the absorbed query buffer ---------------------


@case
def rope_query_into_absorbed_buffer_tail():
    from kimitui.engine.config import RopeScaling
    from kimitui.engine.layers.rope import YarnRotaryEmbedding
    from kimitui.kernels.backend import REFERENCE
    from kimitui.kernels.triton.backend import TritonBackend

    rope = YarnRotaryEmbedding(16, 10000.0, RopeScaling(factor=4.0, original_max_position_embeddings=32), 128)
    q = torch.randn(3, 4, 24 + 16)  # nope then rope channels
    pos = torch.tensor([0, 77, 5])
    want = REFERENCE.mla_rope_query(q[..., 24:], rope, pos)
    buf = torch.full((3, 4, 32 + 16), 7.0)  # [B, H, r + rope]: the head stays for the W_UK product
    got = TritonBackend().mla_rope_query(q[..., 24:], rope, pos, out=buf[..., 32:])
    assert got.data_ptr() == buf[..., 32:].data_ptr()
    _close(buf[..., 32:], want, 1e-5)
    assert torch.all(buf[..., :32] == 7.0)


def _rope(dim=16, max_position=128):
    from kimitui.engine.config import RopeScaling
    from kimitui.engine.layers.rope import YarnRotaryEmbedding

    return YarnRotaryEmbedding(dim, 10000.0, RopeScaling(factor=4.0, original_max_position_embeddings=32), max_position)


@case
def mla_q_absorb_matches_bmm_and_rope():
    from kimitui.kernels.backend import REFERENCE
    from kimitui.kernels.triton.mla_q_absorb import mla_q_absorb

    rope = _rope()
    for b, h, nope, r, dtype, tol in ((3, 5, 24, 40, torch.float32, 1e-5), (20, 2, 128, 96, torch.float16, 2e-3)):
        q = torch.randn(b, h, nope + 16).to(dtype)
        w_uk = (torch.randn(h, nope, r) / nope**0.5).to(dtype)
        pos = torch.randint(0, 128, (b,))
        pos[0] = 500  # outside the cache: the rope tail is zeroed, never read out of bounds
        want = REFERENCE.mla_absorb_query(q, w_uk, rope, pos.clamp(max=127))
        want[0, :, r:] = 0
        got = mla_q_absorb(q, w_uk, rope.cos, rope.sin, pos)
        assert got.shape == (b, h, r + 16) and got.dtype == dtype
        _close(got, want, tol)


@case
def mla_cache_write_with_query_norm():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.backend import REFERENCE
    from kimitui.kernels.triton.mla_cache_write import mla_cache_write

    rope = _rope()
    t, qdim, r = 4, 24, 32
    y = torch.randn(t, qdim + r + 16).half()  # the fused projection: q_a part, then kv
    q_in, kv = y[:, :qdim], y[:, qdim:]
    qw, kw = (torch.rand(qdim) + 0.5).half(), (torch.rand(r) + 0.5).half()
    pos, slots = torch.tensor([3, 9, 0, 100]), torch.tensor([5, -1, 0, 7])  # -1: a padding row
    cache, want_cache = torch.zeros(8, r + 16).half(), torch.zeros(8, r + 16).half()
    q_out = mla_cache_write(kv, kw, 1e-6, rope.cos, rope.sin, pos, slots, cache, q_in, qw, 1e-5)
    want_q = REFERENCE.mla_cache_write_q_norm(q_in, qw, 1e-5, kv, kw, 1e-6, rope, pos, slots.abs(), want_cache)
    want_cache[1] = 0  # the padding row wrote nothing
    assert torch.equal(q_out, ref.rms_norm(q_in, qw, 1e-5)) and torch.equal(q_out, want_q)  # every row
    _close(cache, want_cache, 2e-3)
    assert mla_cache_write(kv, kw, 1e-6, rope.cos, rope.sin, pos, slots, cache) is None


@case
def mla_decode_short_sequences_under_a_long_bound():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.triton.mla_decode import mla_decode

    # a graph-sized bound (512) with short and long contexts: each sequence splits its own length
    b, h, r, block = 4, 3, 32, 16
    lens = [1, 17, 300, 70]
    cache = torch.randn(40 * block, r + 8)
    table = torch.randint(0, 40, (b, 32), dtype=torch.int32)  # 32 blocks: room for 512 tokens
    q, ctx = torch.randn(b, h, r + 8), torch.tensor(lens, dtype=torch.int32)
    want = ref.mla_decode_reference(q, cache, table, ctx, max(lens), block, r, 0.2)
    for bound in (max(lens), 512):
        _close(mla_decode(q, cache, table, ctx, bound, block, r, 0.2), want, 1e-4)


# --- launch counts ------------------------------------------------------------------------------


@case
def launch_counts_of_the_cuts():
    from kimitui.engine.layers.activation import GatedActivation
    from kimitui.kernels.launch_count import count_launches
    from kimitui.kernels.triton.fused_moe import moe_combine
    from kimitui.kernels.triton.gated_act import gated_act

    gu, ids, pairs = torch.randn(3, 64).half(), torch.randint(0, 4, (3, 2)), torch.randn(6, 32)
    notes = []
    for name, fused, eager in (
        ("silu_and_mul", lambda: gated_act(gu), lambda: GatedActivation()(gu[:, :32], gu[:, 32:])),
        ("combine", lambda: moe_combine(pairs, ids, 4, torch.float16), lambda: pairs.view(3, 2, 32).sum(dim=1).half()),
    ):
        with count_launches() as a:
            fused()
        with count_launches() as b:
            eager()
        assert a.kernels == sum(a.triton.values()) == 1 and b.kernels == 2 and not a.host_syncs, (name, a, b)
        notes.append(f"{name} {a.kernels} vs {b.kernels}")
    return ", ".join(notes)


if __name__ == "__main__":
    child_main(CASES)


# --- pytest side ------------------------------------------------------------------------------

pytestmark = needs_triton


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreted("tests.kernels.triton.test_launch_fusions")


@pytest.mark.parametrize("name", sorted(CASES))
def test_launch_fusion_matches_pytorch(name, interpreter_results):
    result = interpreter_results.get(name, "case did not run")
    print(result)
    assert result.startswith("ok"), result


# The launch cuts lower to machine code for H200 (sm_90) and MI355X (gfx950) without a GPU, as in
# test_compile_targets (atomics on int64, tl.dot shapes and constexpr branches only the compiler sees).
TARGETS = {"sm_90": ("cuda", 90, 32), "gfx950": ("hip", "gfx950", 64)}


def _compile_specs():
    from kimitui.kernels.triton.fused_add_rms_norm import _fused_add_rms_norm_kernel
    from kimitui.kernels.triton.fused_moe import _moe_combine_kernel
    from kimitui.kernels.triton.gated_act import _gated_act_kernel
    from kimitui.kernels.triton.mla_cache_write import _mla_cache_write_kernel
    from kimitui.kernels.triton.mla_q_absorb import _mla_q_absorb_kernel
    from kimitui.kernels.triton.moe_router import _moe_router_kernel

    bf16 = "*bf16"
    act = {"gu_ptr": bf16, "out_ptr": bf16, "beta": "fp32", "linear_beta": "fp32"}
    return {
        "gated_act_silu": (_gated_act_kernel, act, dict(ACT=0, BOUND_UP=False, BLOCK=1024)),
        "gated_act_situ": (_gated_act_kernel, act, dict(ACT=1, BOUND_UP=True, BLOCK=1024)),
        "moe_combine": (
            _moe_combine_kernel,
            {"pairs_ptr": "*fp32", "ids_ptr": "*i64", "y_ptr": bf16},
            dict(TOP_K=8, BLOCK_D=1024),
        ),
        "moe_router_counts": (
            _moe_router_kernel,
            {
                "logits_ptr": "*fp32",
                "bias_ptr": "*fp32",
                "ids_ptr": "*i64",
                "weights_ptr": bf16,
                "counts_ptr": "*i64",
                "count_rows_ptr": "*i32",
                "scaling": "fp32",
            },
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
        "mla_q_absorb": (
            _mla_q_absorb_kernel,
            {"q_ptr": bf16, "w_ptr": bf16, "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "out_ptr": bf16},
            dict(BLOCK_B=16, BLOCK_R=64, BLOCK_K=64, BLOCK_P=32, ROPE=True),
        ),
        "mla_cache_write_q_norm": (
            _mla_cache_write_kernel,
            {
                "kv_ptr": bf16,
                "w_ptr": bf16,
                "cos_ptr": "*fp32",
                "sin_ptr": "*fp32",
                "pos_ptr": "*i64",
                "slot_ptr": "*i64",
                "cache_ptr": bf16,
                "q_ptr": bf16,
                "qw_ptr": bf16,
                "qo_ptr": bf16,
                "eps": "fp32",
                "q_eps": "fp32",
            },
            dict(NORM_DTYPE=None, BLOCK_LAT=512, BLOCK_P=32, HAS_Q=True, BLOCK_Q=2048, ROPE=True),
        ),
        "add_rms_norm_out32": (
            _fused_add_rms_norm_kernel,
            {
                "x_ptr": bf16,
                "r_ptr": bf16,
                "w_ptr": bf16,
                "out_ptr": bf16,
                "rout_ptr": bf16,
                "o32_ptr": "*fp32",
                "eps": "fp32",
            },
            dict(BLOCK=8192, HAS_OUT32=True),
        ),
    }


COMPILE_NAMES = [
    "gated_act_silu",
    "gated_act_situ",
    "moe_combine",
    "moe_router_counts",
    "mla_q_absorb",
    "mla_cache_write_q_norm",
    "add_rms_norm_out32",
]


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on"),
    reason="kernels are interpreted functions under TRITON_INTERPRET",
)
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("name", COMPILE_NAMES)
def test_kernel_compiles_for_gpu_targets(name, target):
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn, types, consts = _compile_specs()[name]
    if not hasattr(fn, "arg_names"):
        pytest.skip("kernel module was imported in interpreter mode")
    if "NORM_DTYPE" in consts:
        consts = {**consts, "NORM_DTYPE": tl.bfloat16}
    signature = {arg: "constexpr" if arg in consts else types.get(arg, "i32") for arg in fn.arg_names}
    compiled = triton.compile(
        ASTSource(fn, signature, consts), target=GPUTarget(*TARGETS[target]), options={"num_warps": 4}
    )
    assert "cubin" in compiled.asm or "hsaco" in compiled.asm


def _bad_calls():
    from kimitui.kernels.triton.fused_add_rms_norm import fused_add_rms_norm
    from kimitui.kernels.triton.fused_moe import moe_combine
    from kimitui.kernels.triton.gated_act import gated_act
    from kimitui.kernels.triton.mla_q_absorb import mla_q_absorb
    from kimitui.kernels.triton.moe_router import moe_route_logits

    cs = torch.zeros(10, 4)
    return [
        (lambda: gated_act(torch.randn(2, 7)), r"gu must be fp16/bf16/fp32 \[..., 2I\]"),
        (lambda: gated_act(torch.randn(2, 8), "gelu"), "kind must be silu or situ"),
        (lambda: gated_act(torch.randn(2, 8), "situ", beta=0.0), "SiTU betas must be positive"),
        (
            lambda: moe_combine(torch.randn(5, 4), torch.zeros(3, 2).long(), 4, torch.float16),
            r"pairs must be \[T\*k=6, D\]",
        ),
        (
            lambda: moe_route_logits(torch.randn(2, 12), None, 2, counts=torch.zeros(11).long()),
            r"counts must be a contiguous int32/int64 \[E=12\]",
        ),
        (lambda: moe_route_logits(torch.randn(2, 12), None, 2, weights_dtype=torch.int32), "weights_dtype must be"),
        (
            lambda: fused_add_rms_norm(
                torch.randn(2, 8), torch.randn(2, 8), torch.ones(8), out32=torch.empty(2, 8).half()
            ),
            r"out32 must be torch.float32 \(2, 8\)",
        ),
        (
            lambda: mla_q_absorb(torch.randn(2, 3, 24), torch.randn(4, 16, 32), cs, cs, torch.zeros(2).long()),
            r"w_uk must be \[H=3, nope < 24, r\]",
        ),
        (
            lambda: mla_q_absorb(torch.randn(2, 3, 24), torch.randn(3, 16, 32), cs, cs, torch.zeros(3).long()),
            r"positions must be int32/int64 \[B=2\]",
        ),
        (lambda: gated_act(torch.randn(2, 8)), "need a CUDA/ROCm tensor"),  # valid, but on a CPU
    ]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the last call is valid under the interpreter")
@pytest.mark.parametrize("index", range(10))
def test_bad_input_is_one_clear_line(index):
    call, match = _bad_calls()[index]
    with pytest.raises(ValueError, match=match) as info:
        call()
    assert "\n" not in str(info.value)
