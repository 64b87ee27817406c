"""The Kimi K3 decode fusions vs their PyTorch paths, under TRITON_INTERPRET=1 on CPU.

The fused KDA decode step (``kernels.kda_decode``: conv + SiLU, gate, beta, q/k L2 norms, the
delta-rule step on the slots' state, the gated output RMSNorm) against ``Backend.kda_decode`` (the
ops of ``kernels.kda`` composed); the AttnRes mix with its residual add, snapshot and the norm after
it (``kernels.attn_res_mix``) against ``Backend.attn_res_mix_norm``; the NoPE forms of MLA's cache
write and absorbed query; MLA's sigmoid output gate; bad input answered by one line. Same plumbing as ``test_launch_fusions``: the
cases run once in a child process with the interpreter on, each reported as its own test.
"""

import os

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from tests.helpers.interpret import case_registry, child_main, needs_triton, run_interpreted
from tests.helpers.interpret import close as _close

CASES, case = case_registry()


# --- KDA decode step ----------------------------------------------------------------------------


def _kda_inputs(n, h, d, w, dtype, slots_total=6, wide=7):
    p = h * d
    proj = torch.randn(n, 3 * p + wide, dtype=torch.float32).to(dtype)  # strided rows: the fused projection
    qkv = proj[:, : 3 * p]
    f_b = torch.randn(n, p).to(dtype)
    b = torch.randn(n, h).to(dtype)
    gate = torch.randn(n, p).to(dtype) * 2
    conv_w = torch.randn(3 * p, w) * 0.5
    A_log = torch.randn(h) * 0.5
    dt_bias = torch.randn(p) * 0.3
    norm_w = torch.rand(d) + 0.5
    conv_state = torch.randn(slots_total, 3 * p, w - 1)
    rec_state = torch.randn(slots_total, h, d, d) * 0.2
    return qkv, f_b, b, gate, conv_w, A_log, dt_bias, norm_w, conv_state, rec_state


def _kda_compare(n, h, d, w, dtype, lower_bound, tol, steps=3):
    from kimitui.kernels.backend import REFERENCE
    from kimitui.kernels.triton.backend import TritonBackend

    qkv, f_b, b, gate, conv_w, A_log, dt_bias, norm_w, conv_state, rec_state = _kda_inputs(n, h, d, w, dtype)
    slots = torch.tensor([4, 0, 2, 5][:n])
    ref_conv, ref_rec = conv_state.clone(), rec_state.clone()
    for step in range(steps):  # several steps: the states written by the kernel are read back by it
        args = (qkv * (1 + step), f_b, b, gate, conv_w, A_log, dt_bias, lower_bound, norm_w, 1e-5)
        got = TritonBackend().kda_decode(*args, conv_state, rec_state, slots, d**-0.5)
        want = REFERENCE.kda_decode(*args, ref_conv, ref_rec, slots, d**-0.5)
        assert got.shape == (n, h * d) and got.dtype == dtype
        _close(got, want, tol)
        _close(conv_state, ref_conv, 1e-6)
        _close(rec_state, ref_rec, tol)
    untouched = [s for s in range(6) if s not in slots.tolist()]
    assert torch.equal(rec_state[untouched], ref_rec[untouched]) and torch.equal(
        conv_state[untouched], ref_conv[untouched]
    )


@case
def kda_decode_fp32_safe_gate():
    _kda_compare(3, 2, 32, 4, torch.float32, -5.0, 2e-5)


@case
def kda_decode_fp32_softplus_gate_odd_head_dim():
    _kda_compare(4, 3, 40, 4, torch.float32, None, 2e-5)  # head dim 40: a block of 64, two value tiles (one masked)


@case
def kda_decode_fp16_safe_gate():
    _kda_compare(3, 2, 64, 4, torch.float16, -5.0, 4e-3)  # two value tiles


@case
def kda_decode_fp16_kernel_3():
    _kda_compare(2, 2, 16, 3, torch.float16, None, 4e-3)


@case
def kda_decode_padding_slot_writes_zeros_and_no_state():
    from kimitui.kernels.triton.kda_decode import kda_decode

    qkv, f_b, b, gate, conv_w, A_log, dt_bias, norm_w, conv_state, rec_state = _kda_inputs(2, 2, 16, 4, torch.float32)
    conv0, rec0 = conv_state.clone(), rec_state.clone()
    out = kda_decode(
        qkv,
        f_b,
        b,
        gate,
        conv_w,
        A_log,
        dt_bias,
        -5.0,
        norm_w,
        1e-5,
        conv_state,
        rec_state,
        torch.tensor([-1, 6]),
        0.25,
    )
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(conv_state, conv0) and torch.equal(rec_state, rec0)


@case
def kda_decode_is_one_launch():
    from kimitui.kernels.backend import REFERENCE
    from kimitui.kernels.launch_count import count_launches
    from kimitui.kernels.triton.backend import TritonBackend

    qkv, f_b, b, gate, conv_w, A_log, dt_bias, norm_w, conv_state, rec_state = _kda_inputs(3, 2, 16, 4, torch.float16)
    args = (
        qkv,
        f_b,
        b,
        gate,
        conv_w,
        A_log,
        dt_bias,
        -5.0,
        norm_w,
        1e-5,
        conv_state,
        rec_state,
        torch.tensor([0, 1, 2]),
        0.25,
    )
    with count_launches() as fused:
        TritonBackend().kda_decode(*args)
    with count_launches() as eager:
        REFERENCE.kda_decode(*args)
    assert fused.kernels == 1 and sum(fused.triton.values()) == 1 and not fused.host_syncs, fused
    return f"kda decode {fused.kernels} vs {eager.kernels}"


# --- AttnRes mix + norm -------------------------------------------------------------------------


def _mix_compare(t, d, n, dtype, delta, save, tol):
    from kimitui.kernels.backend import REFERENCE
    from kimitui.kernels.triton.backend import TritonBackend

    cap = n + 2
    blocks = (torch.randn(cap, t, d) * (1 + torch.arange(cap)[:, None, None])).to(dtype)
    x = torch.randn(t, d + 5).to(dtype)[:, :d]  # a strided view: rows of a wider tensor
    dl = torch.randn(t, d).to(dtype) if delta else None
    weights = (torch.rand(d) + 0.5, torch.randn(1, d), (torch.rand(d) + 0.5).to(dtype))
    args = (weights[0], 1e-6, weights[1], weights[2], 1e-5)
    ref_blocks = blocks.clone()
    got, got_s = TritonBackend().attn_res_mix_norm(x, blocks, n, *args, delta=dl, save=save)
    want, want_s = REFERENCE.attn_res_mix_norm(x, ref_blocks, n, *args, delta=dl, save=save)
    assert got.dtype == want.dtype and got.shape == (t, d)
    assert torch.equal(got_s, want_s)  # the running sum: one rounding, the same in both
    assert torch.equal(blocks, ref_blocks)  # the snapshot row (or nothing) written exactly
    _close(got, want, tol)


@case
def attn_res_mix_norm_fp32_odd_width_with_add():
    _mix_compare(3, 203, 3, torch.float32, True, False, 2e-5)


@case
def attn_res_mix_norm_fp32_no_blocks_saves_snapshot():
    _mix_compare(2, 64, 0, torch.float32, False, True, 2e-5)  # layer 0: the norm of x, x kept as block 0


@case
def attn_res_mix_norm_fp16_snapshot_after_blocks():
    _mix_compare(4, 96, 2, torch.float16, False, True, 4e-3)


@case
def attn_res_mix_norm_fp16_add_wide():
    _mix_compare(2, 1100, 4, torch.float16, True, False, 4e-3)


@case
def attn_res_mix_norm_is_one_launch():
    from kimitui.kernels.backend import REFERENCE
    from kimitui.kernels.launch_count import count_launches
    from kimitui.kernels.triton.backend import TritonBackend

    blocks, x, a = torch.randn(3, 3, 32).half(), torch.randn(3, 32).half(), torch.randn(3, 32).half()
    args = (blocks, 2, torch.ones(32).half(), 1e-6, torch.randn(1, 32).half(), torch.ones(32).half(), 1e-6)
    with count_launches() as fused:
        TritonBackend().attn_res_mix_norm(x, *args, delta=a)
    with count_launches() as eager:
        REFERENCE.attn_res_mix_norm(x, *args, delta=a)
    assert fused.kernels == 1 and sum(fused.triton.values()) == 1 and not fused.host_syncs, fused
    return f"add + mix + norm {fused.kernels} vs {eager.kernels}"


# --- MLA without rope (NoPE) and its output gate ------------------------------------------------


@case
def mla_cache_write_nope_with_query_norm():
    from kimitui.kernels import reference as ref
    from kimitui.kernels.backend import REFERENCE
    from kimitui.kernels.triton.mla_cache_write import mla_cache_write

    for dtype, wdtype, tol in (
        (torch.float16, torch.float16, 2e-3),
        (torch.float32, torch.float32, 1e-5),
        (torch.float16, torch.float32, 2e-3),
    ):
        t, qdim, r, rope = 4, 24, 32, 7  # an odd key width: NoPE copies it, no pairs
        y = torch.randn(t, qdim + r + rope).to(dtype)  # the fused projection: q_a part, then kv
        q_in, kv = y[:, :qdim], y[:, qdim:]
        qw, kw = (torch.rand(qdim) + 0.5).to(wdtype), (torch.rand(r) + 0.5).to(wdtype)
        pos, slots = torch.tensor([3, 9, 0, 100]), torch.tensor([5, -1, 0, 7])  # -1: a padding row
        cache, want_cache = torch.zeros(8, r + rope).to(dtype), torch.zeros(8, r + rope).to(dtype)
        q_out = mla_cache_write(kv, kw, 1e-6, None, None, pos, slots, cache, q_in, qw, 1e-5)
        want_q = REFERENCE.mla_cache_write_q_norm(q_in, qw, 1e-5, kv, kw, 1e-6, None, pos, slots.abs(), want_cache)
        want_cache[1] = 0  # the padding row wrote nothing
        _close(q_out, want_q, tol)
        assert q_out.dtype == ref.rms_norm(q_in, qw, 1e-5).dtype
        assert torch.equal(cache[:, r:], want_cache[:, r:])  # the unrotated key, exactly
        _close(cache, want_cache, tol)


@case
def mla_q_absorb_nope_copies_the_tail():
    from kimitui.kernels.backend import REFERENCE
    from kimitui.kernels.triton.mla_q_absorb import mla_q_absorb

    for b, h, nope, r, dtype, tol in ((3, 5, 24, 40, torch.float32, 1e-5), (20, 2, 16, 16, torch.float16, 2e-3)):
        q = torch.randn(b, h, nope + 8).to(dtype)
        w_uk = (torch.randn(h, nope, r) / nope**0.5).to(dtype)
        pos = torch.randint(0, 128, (b,))
        want = REFERENCE.mla_absorb_query(q, w_uk, None, pos)
        got = mla_q_absorb(q, w_uk, None, None, pos)
        assert got.shape == (b, h, r + 8) and got.dtype == dtype
        assert torch.equal(got[..., r:], q[..., nope:])
        _close(got, want, tol)


@case
def sigmoid_gate_matches_two_ops():
    from kimitui.kernels.triton.sigmoid_gate import sigmoid_gate

    for dtype in (torch.float32, torch.float16):
        x = torch.randn(3, 1100 + 4).to(dtype)[:, :1100]  # strided rows, more than one column block
        g = torch.randn(3, 1100).to(dtype) * 4
        want = x * torch.sigmoid(g)
        got = sigmoid_gate(x, g)
        assert got.dtype == dtype
        if dtype == torch.float16:
            assert torch.equal(got, want), (got - want).abs().max()  # two roundings, matched exactly
        else:
            _close(got, want, 1e-6)


@case
def bad_input_is_one_clear_line():
    from kimitui.kernels.triton.attn_res_mix import attn_res_mix_norm
    from kimitui.kernels.triton.kda_decode import kda_decode
    from kimitui.kernels.triton.mla_cache_write import mla_cache_write
    from kimitui.kernels.triton.sigmoid_gate import sigmoid_gate

    x, w = torch.randn(2, 8), torch.ones(8)
    qkv, f_b, b, gate, conv_w, A_log, dt_bias, norm_w, conv_state, rec_state = _kda_inputs(2, 2, 16, 4, torch.float32)
    calls = [
        (
            lambda: attn_res_mix_norm(x, torch.zeros(1, 2, 8), 1, w, 1e-6, w, w, 1e-6, save=True),
            "blocks must be torch.float32 [>= 2, T=2, D=8]",
        ),
        (
            lambda: attn_res_mix_norm(x, torch.zeros(1, 2, 8), 0, w, 1e-6, torch.ones(7), w, 1e-6),
            "proj_weight must be contiguous float with 8 entries",
        ),
        (
            lambda: kda_decode(
                qkv,
                f_b,
                b,
                gate,
                conv_w,
                A_log,
                dt_bias,
                1.0,
                norm_w,
                1e-5,
                conv_state,
                rec_state,
                torch.tensor([0, 1]),
                0.25,
            ),
            "lower_bound must be negative",
        ),
        (
            lambda: kda_decode(
                qkv,
                f_b,
                b,
                gate,
                conv_w,
                A_log,
                dt_bias,
                None,
                norm_w,
                1e-5,
                conv_state,
                rec_state[:, :1],
                torch.tensor([0, 1]),
                0.25,
            ),
            "rec_state must be fp32",
        ),
        (
            lambda: mla_cache_write(
                torch.randn(2, 12),
                torch.ones(8),
                1e-6,
                torch.zeros(4, 2),
                None,
                torch.zeros(2).long(),
                torch.zeros(2).long(),
                torch.zeros(4, 12),
            ),
            "cos and sin are both tensors",
        ),
        (lambda: sigmoid_gate(x, torch.randn(2, 8).half()), "gate must be torch.float32"),
    ]
    for call, match in calls:
        try:
            call()
        except ValueError as e:
            assert match in str(e) and "\n" not in str(e), (match, str(e))
        else:
            raise AssertionError(f"no error for {match}")


if __name__ == "__main__":
    child_main(CASES)


# --- pytest side ------------------------------------------------------------------------------

pytestmark = needs_triton


@pytest.fixture(scope="module")
def interpreter_results():
    return run_interpreted("tests.kernels.triton.test_k3_fusions")


@pytest.mark.parametrize("name", sorted(CASES))
def test_k3_fusion_matches_pytorch(name, interpreter_results):
    result = interpreter_results.get(name, "case did not run")
    print(result)
    assert result.startswith("ok"), result
