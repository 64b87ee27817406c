"""KDA on the CPU: the chunked prefill and one-token decode forms against the per-token recurrence,
the short conv with history against one conv over the whole sequence, and the backend entry points."""

import pytest
import torch
import torch.nn.functional as F

from kimitui.kernels import kda
from kimitui.kernels import reference as ref


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _inputs(T, H=3, K=16, V=8, gate_scale=1.0, dtype=torch.float32):
    q, k = torch.randn(T, H, K, dtype=dtype), torch.randn(T, H, K, dtype=dtype)
    v = torch.randn(T, H, V, dtype=dtype)
    g = -F.softplus(torch.randn(T, H, K)) * gate_scale  # log-decays <= 0
    beta = torch.rand(T, H).to(dtype)
    return q, k, v, g, beta


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)


@pytest.mark.parametrize("lens", [[1], [64], [200], [5, 64, 130, 0, 17]])
def test_chunk_matches_recurrence_varlen_with_initial_states(lens):
    cu = _cu(lens)
    q, k, v, g, beta = _inputs(int(cu[-1]))
    h0 = torch.randn(len(lens), 3, 16, 8)
    o, hT = kda.chunk_kda(q, k, v, g, beta, h0, cu, scale=16**-0.5)
    o_ref, hT_ref = ref.kda_recurrence_reference(q, k, v, g, beta, h0, cu, 16**-0.5)
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(hT, hT_ref, atol=2e-5, rtol=1e-4)
    assert hT.dtype == torch.float32


def test_chunk_strong_decay_does_not_overflow():
    # Kimi Linear's softplus gate is unbounded: log-decays of -50 per step make the chunk cumsum reach
    # -3200, where exp(-G) would be inf. Also a K3-style bounded gate at its floor (-5 per step).
    for scale in (50.0, 5.0):
        cu = _cu([150])
        q, k, v, g, beta = _inputs(150, gate_scale=scale)
        h0 = torch.randn(1, 3, 16, 8)
        o, hT = kda.chunk_kda(q, k, v, g, beta, h0, cu, scale=0.25)
        o_ref, hT_ref = ref.kda_recurrence_reference(q, k, v, g, beta, h0, cu, 0.25)
        assert torch.isfinite(o).all() and torch.isfinite(hT).all()
        torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(hT, hT_ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("split", [1, 37, 64, 100, 129])
def test_chunk_split_anywhere_equals_unsplit(split):
    T = 150
    q, k, v, g, beta = _inputs(T)
    h0 = torch.randn(1, 3, 16, 8)
    o, hT = kda.chunk_kda(q, k, v, g, beta, h0, _cu([T]), scale=0.25)
    a = slice(0, split)
    o1, h1 = kda.chunk_kda(q[a], k[a], v[a], g[a], beta[a], h0, _cu([split]), scale=0.25)
    b = slice(split, T)
    o2, h2 = kda.chunk_kda(q[b], k[b], v[b], g[b], beta[b], h1, _cu([T - split]), scale=0.25)
    torch.testing.assert_close(torch.cat([o1, o2]), o, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(h2, hT, atol=2e-5, rtol=1e-4)


def test_chunk_bf16_inputs_keep_fp32_state():
    cu = _cu([70, 3])
    q, k, v, g, beta = _inputs(73, dtype=torch.bfloat16)
    h0 = torch.randn(2, 3, 16, 8)
    o, hT = kda.chunk_kda(q, k, v, g, beta, h0, cu, scale=0.25)
    o_ref, hT_ref = ref.kda_recurrence_reference(q, k, v, g, beta, h0, cu, 0.25)
    assert o.dtype == torch.bfloat16 and hT.dtype == torch.float32
    torch.testing.assert_close(o, o_ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(hT, hT_ref, atol=1e-4, rtol=1e-4)


def test_recurrent_decode_matches_recurrence_and_updates_only_its_slots():
    N, H, K, V = 4, 3, 16, 8
    pool = torch.randn(7, H, K, V)
    slots = torch.tensor([5, 0, 3, 2])
    before = pool.clone()
    q, k, v, g, beta = _inputs(N, H, K, V)
    # Two decode steps in a row: the second continues from what the first wrote.
    outs = [
        kda.recurrent_kda(q, k, v, g, beta, pool, slots, scale=0.25),
        kda.recurrent_kda(k, q, v, g, beta, pool, slots, scale=0.25),
    ]
    cu = torch.arange(N + 1)
    o1, h1 = ref.kda_recurrence_reference(q, k, v, g, beta, before[slots], cu, 0.25)
    o2, h2 = ref.kda_recurrence_reference(k, q, v, g, beta, h1, cu, 0.25)
    torch.testing.assert_close(outs[0], o1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[1], o2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[slots], h2, atol=1e-5, rtol=1e-5)
    untouched = torch.tensor([1, 4, 6])
    assert torch.equal(pool[untouched], before[untouched])


def test_conv_with_history_equals_full_conv():
    C, W, T = 6, 4, 23
    x = torch.randn(T, C)
    w = torch.randn(C, W)
    full = F.silu(F.conv1d(x.t()[None], w[:, None], padding=W - 1, groups=C)[0, :, :T].t())
    # The same sequence fed as prefill pieces (one shorter than the kernel), then decode tokens.
    hist = torch.zeros(1, C, W - 1)
    ys = []
    for s, e in ((0, 2), (2, 11), (11, 20)):
        y, hist = kda.causal_conv1d(x[s:e], w, hist, _cu([e - s]))
        ys.append(y)
    for t in range(20, T):
        y, hist = kda.causal_conv1d(x[t : t + 1], w, hist, None)
        ys.append(y)
    torch.testing.assert_close(torch.cat(ys), full, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(hist[0], x[T - W + 1 :].t())


def test_conv_varlen_matches_reference_per_sequence():
    C, W = 5, 4
    lens = [1, 9, 0, 2, 30]
    x, w = torch.randn(sum(lens), C), torch.randn(C, W)
    hist = torch.randn(len(lens), C, W - 1)
    y, h = kda.causal_conv1d(x, w, hist, _cu(lens))
    y_ref, h_ref = ref.causal_conv1d_reference(x, w, hist, _cu(lens))
    torch.testing.assert_close(y, y_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(h, h_ref)
    assert torch.equal(h[2], hist[2])  # an empty chunk keeps its history


def test_conv_decode_batch_matches_reference():
    N, C, W = 3, 5, 4
    x, w, hist = torch.randn(N, C), torch.randn(C, W), torch.randn(N, C, W - 1)
    y, h = kda.causal_conv1d(x.bfloat16(), w, hist, None)
    y_ref, h_ref = ref.causal_conv1d_reference(x.bfloat16(), w, hist, torch.arange(N + 1))
    assert y.dtype == torch.bfloat16 and h.dtype == torch.float32
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(h, h_ref)


def test_bad_shapes_raise_clear_errors():
    q, k, v, g, beta = _inputs(10)
    with pytest.raises(ValueError, match="initial_state"):
        kda.chunk_kda(q, k, v, g, beta, torch.zeros(2, 3, 16, 8), _cu([10]), 0.25)
    with pytest.raises(ValueError, match="cu_seqlens"):
        kda.chunk_kda(q, k, v, g, beta, torch.zeros(1, 3, 16, 8), _cu([9]), 0.25)
    with pytest.raises(ValueError, match="beta"):
        kda.chunk_kda(q, k, v, g, beta[:, :2], torch.zeros(1, 3, 16, 8), _cu([10]), 0.25)
    with pytest.raises(ValueError, match="history"):
        kda.causal_conv1d(torch.randn(4, 5), torch.randn(5, 4), torch.zeros(1, 5, 4), _cu([4]))


def test_backend_entry_points_run_the_cpu_forms():
    from kimitui.kernels.select import select_backend
    from kimitui.kernels.settings import KernelSettings

    ops = select_backend("cpu", torch.float32, KernelSettings())  # what a CPU model's KDA layers call
    cu = _cu([3, 70])
    q, k, v, g, beta = _inputs(73)
    h0 = torch.randn(2, 3, 16, 8)
    o, hT = ops.kda_chunk(q, k, v, g, beta, h0, cu, 0.25)
    o_ref, hT_ref = kda.chunk_kda(q, k, v, g, beta, h0, cu, 0.25)
    # the C++ token-by-token form where it builds (kernels/cpu/k3_decode.py): the same result up to
    # float32 summation order
    torch.testing.assert_close(o, o_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(hT, hT_ref, atol=1e-4, rtol=1e-4)
    pool = torch.zeros(3, 3, 16, 8)
    o = ops.kda_recurrent(q[:2], k[:2], v[:2], g[:2], beta[:2], pool, torch.tensor([2, 0]), 0.25)
    assert o.shape == (2, 3, 8) and pool[1].abs().sum() == 0 and pool[2].abs().sum() > 0
    y, h = ops.causal_conv1d(torch.randn(73, 4), torch.randn(4, 4), torch.zeros(2, 4, 3), cu)
    assert y.shape == (73, 4) and h.shape == (2, 4, 3)


def test_chunk_and_recurrent_match_transformers_torch_forms():
    hf = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    T, H, K = 130, 2, 32
    q, k, v, g, beta = _inputs(T, H, K, K)
    h0 = torch.randn(1, H, K, K)
    want, want_h = hf.chunk_kimi_delta_attention(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    o, hT = kda.chunk_kda(q, k, v, g, beta, h0, _cu([T]), scale=K**-0.5)
    torch.testing.assert_close(o, want[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(hT, want_h, atol=1e-5, rtol=1e-4)
    # decode: 3 sequences, one token each, transformers' batch = our slots
    want, want_h = hf.recurrent_kimi_delta_attention(
        q[:3, None],
        k[:3, None],
        v[:3, None],
        g[:3, None],
        beta[:3, None],
        initial_state=h0.expand(3, -1, -1, -1),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    pool = h0.expand(3, -1, -1, -1).clone()
    o = kda.recurrent_kda(q[:3], k[:3], v[:3], g[:3], beta[:3], pool, torch.arange(3), scale=K**-0.5)
    torch.testing.assert_close(o, want[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, want_h, atol=1e-5, rtol=1e-5)
