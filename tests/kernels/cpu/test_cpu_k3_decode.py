"""The C++ K3 decode pieces (kernels.cpu.k3_decode) against the PyTorch backend they replace
(kernels.backend.Backend: kda_decode, attn_res_mix_norm, gated_act's SiTU), float32 and bf16, through
the CPU backend's ops: outputs and the KDA states they leave. Also the CPU backend's bf16 paths that
now reach the C++ few-row kernels: the router and MLA decode."""

from __future__ import annotations

import pytest
import torch

from kimitui.kernels.activation import GatedActivation
from kimitui.kernels.backend import Backend
from kimitui.kernels.cpu import few_rows as cpu_few_rows
from kimitui.kernels.cpu import k3_decode
from kimitui.kernels.cpu.backend import CpuBackend
from kimitui.kernels.settings import KernelSettings

pytestmark = pytest.mark.skipif(not k3_decode.available(), reason="the C++ K3 decode kernels did not build")

REF = Backend()
H, K, W, SLOTS = 2, 16, 4, 5


def _kda_case(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    P = H * K
    wide = torch.randn(n, 3 * P + 7, generator=g).to(dtype)  # in_proj's output: qkv is a strided view of it
    return dict(
        qkv=wide[:, : 3 * P],
        f_b=torch.randn(n, P, generator=g).to(dtype),
        b=torch.randn(n, H, generator=g).to(dtype),
        gate=torch.randn(n, P, generator=g).to(dtype),
        conv_weight=torch.randn(3 * P, W, generator=g) / 2,
        A_log=torch.randn(H, generator=g) / 2,
        dt_bias=torch.randn(P, generator=g) / 2,
        norm_weight=1 + torch.randn(K, generator=g) / 4,
    )


def _states(seed):
    g = torch.Generator().manual_seed(seed)
    conv = torch.randn(SLOTS, 3 * H * K, W - 1, generator=g)
    rec = torch.randn(SLOTS, H, K, K, generator=g) / 4
    return conv, rec


def _kda(ops, case, lower_bound, conv, rec, slots):
    c = case
    return ops.kda_decode(
        c["qkv"],
        c["f_b"],
        c["b"],
        c["gate"],
        c["conv_weight"],
        c["A_log"],
        c["dt_bias"],
        lower_bound,
        c["norm_weight"],
        1e-5,
        conv,
        rec,
        slots,
        K**-0.5,
    )


def _close(got, want, dtype):
    # float32: a few ulps; bf16: a rounding flip here and there (one bf16 ulp), tiny on average
    got, want = got.float(), want.float()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
        assert (got - want).abs().mean() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["k3_gate", "kimi_linear_gate"])
def test_kda_decode_matches_pytorch(dtype, lower_bound):
    ops = CpuBackend(KernelSettings(), dtype)
    assert ops.k3_cxx
    slots = torch.tensor([3, 0, 4])
    conv_a, rec_a = _states(1)
    conv_b, rec_b = conv_a.clone(), rec_a.clone()
    for step in range(3):  # the states carry over: each step starts from the last one's
        case = _kda_case(3, dtype, seed=10 + step)
        got = _kda(ops, case, lower_bound, conv_a, rec_a, slots)
        want = _kda(REF, case, lower_bound, conv_b, rec_b, slots)
        assert got.dtype == dtype and got.shape == (3, H * K)
        _close(got, want, dtype)
        _close(conv_a, conv_b, dtype)
        _close(rec_a, rec_b, dtype)
    untouched = [1, 2]
    assert torch.equal(rec_a[untouched], _states(1)[1][untouched])
    assert torch.equal(conv_a[untouched], _states(1)[0][untouched])


def test_kda_decode_padding_rows():
    # a decode graph's padding row (slot -1): zeros out, no state touched; the real rows as alone
    ops = CpuBackend(KernelSettings(), torch.float32)
    case = _kda_case(3, torch.float32, seed=3)
    conv, rec = _states(2)
    got = _kda(ops, case, -5.0, conv, rec, torch.tensor([1, -1, 2]))
    conv_r, rec_r = _states(2)
    want = _kda(REF, case, -5.0, conv_r, rec_r, torch.tensor([1, -1, 2]))
    assert torch.equal(got[1], torch.zeros(H * K))
    _close(got, want, torch.float32)
    _close(rec, rec_r, torch.float32)


def test_kda_decode_rejects_bad_shapes():
    case = _kda_case(2, torch.float32, seed=4)
    conv, rec = _states(3)
    case["f_b"] = case["f_b"][:, :-1]
    with pytest.raises(RuntimeError, match="f_b"):
        _kda(CpuBackend(KernelSettings(), torch.float32), case, -5.0, conv, rec, torch.tensor([0, 1]))


def _mix_case(t, n, dtype, seed, d=48):
    g = torch.Generator().manual_seed(seed)
    blocks = (torch.randn(n + 1, t, d, generator=g) * (1 + torch.arange(n + 1.0))[:, None, None]).to(dtype)
    w = [(1 + torch.randn(d, generator=g) / 4).to(dtype) for _ in range(3)]
    return torch.randn(t, d, generator=g).to(dtype), torch.randn(t, d, generator=g).to(dtype), blocks, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("n", "with_delta", "save"), [(0, False, True), (2, True, False), (3, False, True)])
def test_attn_res_mix_norm_matches_pytorch(dtype, n, with_delta, save):
    ops = CpuBackend(KernelSettings(), dtype)
    x, delta, blocks, (res_w, proj_w, norm_w) = _mix_case(2, n, dtype, seed=n)
    blocks_ref = blocks.clone()
    args = (n, res_w, 1e-5, proj_w.view(1, -1), norm_w, 1e-6)
    d = delta if with_delta else None
    out, s = ops.attn_res_mix_norm(x, blocks, *args, delta=d, save=save)
    out_r, s_r = REF.attn_res_mix_norm(x, blocks_ref, *args, delta=d, save=save)
    assert out.dtype == dtype and s.dtype == dtype
    _close(out, out_r, dtype)
    assert torch.equal(s, s_r)  # one rounded add (or x itself)
    if not with_delta:
        assert s is x
    assert torch.equal(blocks, blocks_ref)  # the snapshot written (save) or nothing touched


def test_attn_res_mix_norm_softmax_picks_between_candidates():
    # the mix is not a plain sum or the last candidate: with n = 2 it moves with the earlier blocks
    ops = CpuBackend(KernelSettings(), torch.float32)
    x, _, blocks, (res_w, proj_w, norm_w) = _mix_case(1, 2, torch.float32, seed=7)
    args = (2, res_w, 1e-5, proj_w.view(1, -1), norm_w, 1e-6)
    a, _ = ops.attn_res_mix_norm(x, blocks, *args)
    blocks[0] *= -1
    b, _ = ops.attn_res_mix_norm(x, blocks, *args)
    assert (a - b).abs().max() > 1e-3
    _close(b, REF.attn_res_mix_norm(x, blocks, *args)[0], torch.float32)


def test_bf16_router_takes_the_cxx_path_with_the_references_choice(monkeypatch):
    # K3's latent MoE routes a bf16 x with a float32 router: widened exactly, then the C++ router
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    w, bias = torch.randn(16, 64, generator=g), torch.randn(16, generator=g) / 10
    ops = CpuBackend(KernelSettings(), torch.bfloat16)
    calls = []
    real = cpu_few_rows.moe_route
    monkeypatch.setattr(cpu_few_rows, "moe_route", lambda *a: calls.append(1) or real(*a))
    ids, weights = ops.moe_route(x, w, bias, 4, weights_dtype=torch.bfloat16)
    want_ids, want_weights = REF.moe_route(x, w, bias, 4, weights_dtype=torch.bfloat16)
    assert calls
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights.float(), want_weights.float(), rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("linear_beta", [25.0, None], ids=["bounded_up", "plain_up"])
def test_situ_gated_act_matches_pytorch(dtype, linear_beta):
    g = torch.Generator().manual_seed(5)
    wide = (torch.randn(3, 2 * 40 + 4, generator=g) * 6).to(dtype)  # several betas: the tanh bounds matter
    gu = wide[:, :80]  # rows strided, as a slice of a wider product
    act = GatedActivation("situ", 4.0, linear_beta)
    got = CpuBackend(KernelSettings(), dtype).gated_act(gu, act)
    want = act(gu[:, :40], gu[:, 40:])
    assert got.dtype == dtype and got.shape == (3, 40)
    _close(got, want, dtype)
    assert (got.float() - (torch.nn.functional.silu(gu[:, :40].float()) * gu[:, 40:].float())).abs().max() > 0.1


def test_bf16_mla_decode_attends_in_float32():
    # the bf16 query and latent cache of K3's MLA go to the C++ kernel, which attends in float32: within
    # one bf16 rounding of the float32 reference on the same bf16 values
    g = torch.Generator().manual_seed(9)
    B, Hh, r, rope, bs = 2, 4, 32, 8, 4
    cache = torch.randn(6 * bs, r + rope, generator=g).to(torch.bfloat16)
    q = torch.randn(B, Hh, r + rope, generator=g).to(torch.bfloat16)
    tables = torch.tensor([[0, 2, 5], [1, 3, 4]], dtype=torch.int32)
    lens = torch.tensor([9, 12], dtype=torch.int32)
    got = CpuBackend(KernelSettings(), torch.bfloat16).mla_decode(q, cache, tables, lens, 12, bs, r, 0.2)
    want = REF.mla_decode(q.float(), cache.float(), tables, lens, 12, bs, r, 0.2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=2e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_kda_sequential_prefill_matches_the_per_token_oracle_and_the_chunked_form(dtype):
    """Backend.kda_chunk on the CPU runs the recurrence token by token in C++; packed sequences of
    uneven lengths (one empty, one past a chunk of 64) from their own states."""
    from kimitui.kernels.kda import chunk_kda
    from kimitui.kernels.reference.k3 import kda_recurrence_reference

    g = torch.Generator().manual_seed(3)
    lens, heads, width = [70, 0, 5, 33], 3, 16
    T, N = sum(lens), len(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    wide = torch.randn(T, 3 * heads * width, generator=g).to(dtype)  # strided views, as the layer's conv output
    q, k, v = (t.view(T, heads, width) for t in wide.split(heads * width, dim=-1))
    gates = -torch.rand(T, heads, width, generator=g) * 0.5  # log-decays <= 0
    beta = torch.rand(T, heads, generator=g)
    h0 = torch.randn(N, heads, width, width, generator=g) / 4
    ops = CpuBackend(KernelSettings())
    o, final = ops.kda_chunk(q, k, v, gates, beta, h0, cu, 0.25)
    want_o, want_final = kda_recurrence_reference(q, k, v, gates, beta, h0, cu, 0.25)
    chunk_o, chunk_final = chunk_kda(q, k, v, gates, beta, h0, cu, 0.25)
    assert o.dtype is dtype and final.dtype is torch.float32
    tol = 1e-4 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(o.float(), want_o.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(final, want_final.float(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(o.float(), chunk_o.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(final, chunk_final, atol=1e-4, rtol=1e-4)
    assert torch.equal(h0[1], final[1])  # the empty sequence keeps its state
    with pytest.raises(RuntimeError, match="cu_seqlens"):
        k3_decode.kda_sequential(q, k, v, gates, beta, h0, cu[:-1], 0.25)
