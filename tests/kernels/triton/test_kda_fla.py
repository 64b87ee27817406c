"""kernels/triton/kda_fla.py maps our KDA arguments onto fla-core's API correctly.

Without a GPU fla-core cannot run, so these tests put stand-ins for the three fla functions in
``sys.modules`` (test only): each follows fla-core 0.6's documented layout (batch dim first, a
[N, C, W] conv state holding the last W inputs, in-place state rows chosen by
``ssm_state_indices``) and computes with the per-token oracles. The wrappers must then give what
kernels/kda.py gives. A real-GPU comparison is marked ``gpu``.
"""

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from kimitui.kernels import kda
from kimitui.kernels import reference as ref
from kimitui.kernels.triton import kda_fla


def _fake_chunk_kda(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    **kw,
):
    assert q.dim() == 4 and q.shape[0] == 1 and cu_seqlens is not None and not kw
    assert output_final_state and use_qk_l2norm_in_kernel
    o, ht = ref.kda_recurrence_reference(q[0], k[0], v[0], g[0], beta[0], initial_state, cu_seqlens, scale)
    return o[None], ht


def _fake_recurrent_fwd(
    q,
    k,
    v,
    g,
    beta,
    initial_state=None,
    scale=None,
    inplace_final_state=True,
    ssm_state_indices=None,
    use_qk_l2norm_in_kernel=False,
    **kw,
):
    B, T = q.shape[:2]
    assert T == 1 and inplace_final_state and use_qk_l2norm_in_kernel and not kw
    idx = ssm_state_indices.long()
    o, ht = ref.kda_recurrence_reference(
        q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], initial_state[idx], torch.arange(B + 1), scale
    )
    initial_state[idx] = ht
    return o[:, None], initial_state


def _fla_conv_one(state, x, weight):
    # fla: state [C, W] = the last W inputs; output t reads the W inputs ending at x_t.
    ext = torch.cat([state.float(), x.t().float()], dim=1)  # [C, W + L]
    W = weight.shape[1]
    y = F.conv1d(ext[None, :, 1:], weight[:, None], groups=weight.shape[0])[0] if x.shape[0] else ext[:, :0]
    return F.silu(y).t(), ext[:, -W:]


def _fake_conv(x, weight=None, initial_state=None, output_final_state=False, activation=None, cu_seqlens=None, **kw):
    assert x.shape[0] == 1 and activation == "silu" and output_final_state and not kw
    assert initial_state.shape[-1] == weight.shape[1]
    cu = cu_seqlens.tolist()
    ys, finals = [], []
    for n in range(len(cu) - 1):
        y, f = _fla_conv_one(initial_state[n], x[0, cu[n] : cu[n + 1]], weight)
        ys.append(y)
        finals.append(f)
    return torch.cat(ys).to(x.dtype)[None], torch.stack(finals).to(x.dtype)


def _fake_conv_update(x, cache, weight=None, activation=None, **kw):
    assert x.dim() == 2 and activation == "silu" and cache.shape[-1] == weight.shape[1]
    ys = []
    for n in range(x.shape[0]):
        y, f = _fla_conv_one(cache[n], x[n : n + 1], weight)
        cache[n] = f
        ys.append(y)
    return torch.cat(ys).to(x.dtype), cache


@pytest.fixture
def fake_fla(monkeypatch):
    mods = {
        name: types.ModuleType(name)
        for name in (
            "fla",
            "fla.ops",
            "fla.ops.kda",
            "fla.ops.kda.fused_recurrent",
            "fla.modules",
            "fla.modules.causal_conv1d",
        )
    }
    mods["fla.ops.kda"].chunk_kda = _fake_chunk_kda
    mods["fla.ops.kda.fused_recurrent"].fused_recurrent_kda_fwd = _fake_recurrent_fwd
    mods["fla.modules.causal_conv1d"].causal_conv1d = _fake_conv
    mods["fla.modules.causal_conv1d"].causal_conv1d_update = _fake_conv_update
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)


def test_wrappers_map_arguments_like_the_cpu_forms(fake_fla):
    torch.manual_seed(0)
    H, K, V, C, W = 2, 8, 4, 6, 4
    cu = torch.tensor([0, 2, 2, 70])
    T, N = 70, 3
    q, k = torch.randn(T, H, K), torch.randn(T, H, K)
    v, g, beta = torch.randn(T, H, V), -torch.rand(T, H, K), torch.rand(T, H)
    h0 = torch.randn(N, H, K, V)
    got, want = kda_fla.chunk_kda(q, k, v, g, beta, h0, cu, 0.3), kda.chunk_kda(q, k, v, g, beta, h0, cu, 0.3)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)

    pool_a = torch.randn(5, H, K, V)
    pool_b = pool_a.clone()
    slots = torch.tensor([4, 1, 2])
    o_a = kda_fla.recurrent_kda(q[:3], k[:3], v[:3], g[:3], beta[:3], pool_a, slots, 0.3)
    o_b = kda.recurrent_kda(q[:3], k[:3], v[:3], g[:3], beta[:3], pool_b, slots, 0.3)
    torch.testing.assert_close(o_a, o_b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool_a, pool_b, atol=1e-5, rtol=1e-5)

    x, w, hist = torch.randn(T, C), torch.randn(C, W), torch.randn(N, C, W - 1)
    for a, b in zip(kda_fla.causal_conv1d(x, w, hist, cu), kda.causal_conv1d(x, w, hist, cu)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(kda_fla.causal_conv1d(x[:N], w, hist), kda.causal_conv1d(x[:N], w, hist)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not kda_fla.available(), reason="needs a GPU and fla-core")
def test_fla_on_gpu_matches_cpu_forms():
    # bf16 q, k, v as the engine feeds them (fp32 gate and beta), the reference given the same bf16
    # values in fp32. Fed fp32, fla's dots would run in TF32 (10-bit mantissa) and be judged against a
    # tolerance fp32 arithmetic alone could meet. The output is bf16, so the bound is a few bf16 ulps
    # (2^-8) relative to the largest value, as the GPU one-shot's KDA row allows.
    torch.manual_seed(0)
    H, K, V = 4, 128, 128
    cu = torch.tensor([0, 100, 101, 300])
    T, N = 300, 3
    q, k = torch.randn(T, H, K).bfloat16(), torch.randn(T, H, K).bfloat16()
    v, g, beta = torch.randn(T, H, V).bfloat16(), -torch.rand(T, H, K), torch.rand(T, H)
    h0 = torch.randn(N, H, K, V) * 0.1
    want = kda.chunk_kda(q.float(), k.float(), v.float(), g, beta, h0, cu, K**-0.5)
    dev = [t.cuda() for t in (q, k, v, g, beta, h0, cu)]
    got = kda_fla.chunk_kda(*dev, K**-0.5)
    for a, b in zip(got, want):
        err = (a.cpu().float() - b).abs().max() / b.abs().max()
        assert err < 2e-2, err
