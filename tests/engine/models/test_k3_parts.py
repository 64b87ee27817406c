"""Kimi K3's parts with no executable upstream oracle (SiTU, attention residuals, latent MoE, the
A_log slice) against a small independent PyTorch reference written here from the published
formulas (never importing engine modules), each reference pinned by hand-computed numbers."""

from __future__ import annotations

import math
import threading

import pytest
import torch

# ---------------------------------------------------------------------------------------------
# The independent reference (Kimi K3 tech report arXiv:2607.24653; Attention Residuals
# arXiv:2603.15031; SGLang python/sglang/srt/models/kimi_k3.py)


def ref_situ(g, u, beta=4.0, linear_beta=25.0):
    g, u = g.double(), u.double()
    gate = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    up = u if linear_beta is None else linear_beta * torch.tanh(u / linear_beta)
    return gate * up


def ref_rms(x, w, eps):
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


def ref_attn_res_mix(x, blocks, norm_w, proj_w, eps):
    cands = [b.double() for b in blocks] + [x.double()]  # each [T, D]
    scores = torch.stack([(ref_rms(v, norm_w, eps) * proj_w.double().view(-1)).sum(-1) for v in cands], -1)
    p = torch.softmax(scores, -1)  # [T, n+1]
    return sum(p[:, i, None] * v for i, v in enumerate(cands))


def ref_latent_moe(
    x,
    router_w,
    bias,
    top_k,
    down_w,
    experts,
    norm_w,
    up_w,
    shared,
    eps,
    scale=1.0,
    n_group=1,
    topk_group=1,
    act=ref_situ,
):
    """experts: list of (w1 gate [I, L], w3 up [I, L], w2 down [L, I]); shared: (gate, up, down) full width."""
    x = x.double()
    s = torch.sigmoid(x @ router_w.double().T)
    choice = s + bias.double()
    # group-limited: keep the topk_group groups with the largest sum of their two best scores
    grouped = choice.view(x.shape[0], n_group, -1)
    keep = grouped.topk(2, -1).values.sum(-1).topk(topk_group, -1).indices  # [T, topk_group]
    mask = torch.full_like(grouped, float("-inf")).scatter(1, keep[..., None].expand(-1, -1, grouped.shape[-1]), 0.0)
    ids = (grouped + mask).view(x.shape[0], -1).topk(top_k, -1).indices
    w = s.gather(1, ids)
    w = w / w.sum(-1, keepdim=True) * scale
    z = x @ down_w.double().T
    y = torch.zeros(x.shape[0], down_w.shape[0], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(top_k):
            w1, w3, w2 = (m.double() for m in experts[int(ids[t, j])])
            y[t] += w[t, j] * (act(z[t] @ w1.T, z[t] @ w3.T) @ w2.T)
    y = ref_rms(y, norm_w, eps)  # on the full top-k sum
    g, u, d = (m.double() for m in shared)
    return y @ up_w.double().T + act(x @ g.T, x @ u.T) @ d.T


def ref_k3_forget_gate(a, a_log, num_heads, lower_bound=-5.0):
    """a [T, H*dk] -> g [T, H, dk]: lower_bound * sigmoid(exp(A_log[h]) * a); the checkpoint's
    A_log [128] holds the per-head values in its first num_heads entries."""
    per_head = a_log.double().reshape(-1)[:num_heads]
    a = a.double().view(a.shape[0], num_heads, -1)
    return lower_bound * torch.sigmoid(torch.exp(per_head)[None, :, None] * a)


# ---------------------------------------------------------------------------------------------
# The reference, pinned by hand


def test_reference_situ_at_one():
    # 4 tanh(1/4) sigmoid(1) * 25 tanh(1/25)
    want = 4 * math.tanh(0.25) / (1 + math.exp(-1)) * 25 * math.tanh(0.04)
    assert abs(want - 0.71582) < 1e-5
    one = torch.ones(1)
    assert ref_situ(one, one).item() == pytest.approx(want, abs=1e-12)
    # defaults of absent fields: beta 1.0, linear beta None (up unchanged)
    assert ref_situ(one, 3 * one, 1.0, None).item() == pytest.approx(math.tanh(1) / (1 + math.exp(-1)) * 3)


def test_reference_attn_res_equal_scores_mix_half_and_half():
    # the snapshot is 2x the current sum: same direction, so equal scores and a 50/50 mix
    x = torch.tensor([[1.0, -2.0, 0.5, 3.0]])
    mixed = ref_attn_res_mix(x, [2 * x], torch.ones(4), torch.tensor([[0.3, -0.1, 0.7, 0.2]]), 1e-5)
    assert torch.allclose(mixed, 1.5 * x.double(), atol=1e-6)
    # one candidate only (no snapshots): the identity
    assert torch.allclose(ref_attn_res_mix(x, [], torch.ones(4), torch.ones(1, 4), 1e-5), x.double())


def test_reference_norm_after_reduction():
    # two ranks' partial latent sums [1, 0] and [0, 1]: norm(sum) = [1, 1]; sum(norm) = [sqrt2, sqrt2]
    y1, y2 = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    assert torch.allclose(ref_rms(y1 + y2, torch.ones(2), 0.0), torch.ones(1, 2, dtype=torch.float64))
    assert torch.allclose(
        ref_rms(y1, torch.ones(2), 0.0) + ref_rms(y2, torch.ones(2), 0.0),
        torch.full((1, 2), math.sqrt(2), dtype=torch.float64),
    )


def test_reference_a_log_slice():
    # A_log [128] for 2 heads: heads use entries 0 and 1 (log 2, log 0.5); the zero tail is unused
    a_log = torch.zeros(128)
    a_log[0], a_log[1] = math.log(2.0), math.log(0.5)
    g = ref_k3_forget_gate(torch.ones(1, 2 * 3), a_log, 2)
    assert torch.allclose(g[0, 0], torch.full((3,), -5.0 / (1 + math.exp(-2.0)), dtype=torch.float64))
    assert torch.allclose(g[0, 1], torch.full((3,), -5.0 / (1 + math.exp(-0.5)), dtype=torch.float64))


# ---------------------------------------------------------------------------------------------
# The engine against the reference


def test_engine_situ_matches_reference():
    from kimitui.engine.layers.activation import GatedActivation

    act = GatedActivation("situ", 4.0, 25.0)
    one = torch.ones(1)
    assert act(one, one).item() == pytest.approx(0.71582, abs=1e-5)
    g, u = torch.randn(64) * 8, torch.randn(64) * 40
    assert torch.allclose(act(g, u).double(), ref_situ(g, u), atol=1e-5, rtol=1e-5)
    assert torch.allclose(
        GatedActivation("situ", 1.0, None)(g, u).double(), ref_situ(g, u, 1.0, None), rtol=1e-5, atol=1e-5
    )
    with pytest.raises(ValueError, match="gated activation 'gelu'"):
        GatedActivation("gelu")


def test_engine_attn_res_mix_matches_reference():
    from kimitui.engine.layers.attn_res import attn_res_mix

    x = torch.tensor([[1.0, -2.0, 0.5, 3.0]])
    out = attn_res_mix(x, [2 * x], torch.ones(4), 1e-5, torch.tensor([[0.3, -0.1, 0.7, 0.2]]))
    assert torch.allclose(out, 1.5 * x, atol=1e-6)
    torch.manual_seed(0)
    x, blocks = torch.randn(5, 16), [torch.randn(5, 16) * (i + 1) for i in range(3)]
    nw, pw = torch.rand(16) + 0.5, torch.randn(1, 16)
    assert torch.allclose(
        attn_res_mix(x, blocks, nw, 1e-5, pw).double(), ref_attn_res_mix(x, blocks, nw, pw, 1e-5), atol=1e-5
    )


def _latent_config(**kw):
    from kimitui.engine.config import ModelConfig
    from tests.helpers.k3_checkpoint import k3_config

    return ModelConfig.from_dict(k3_config(**kw))


def _fill_moe(moe, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(moe.named_parameters()):
            if p.dtype.is_floating_point:
                p.copy_(torch.rand_like(p) + 0.5 if name.endswith("norm.weight") else torch.randn_like(p) * 0.3)


def _moe_reference_weights(moe_full):
    # experts as (w1, w3, w2) per expert from the engine's dense stacked layout [E, 2I, L], [E, L, I]
    st = moe_full.experts.local
    i = st.w13_weight.shape[1] // 2
    experts = [(st.w13_weight[e, :i], st.w13_weight[e, i:], st.w2_weight[e]) for e in range(st.w13_weight.shape[0])]
    sh = moe_full.shared_experts
    return dict(
        router_w=moe_full.gate.weight,
        bias=moe_full.gate.e_score_correction_bias,
        down_w=moe_full.routed_expert_down_proj.weight,
        experts=experts,
        norm_w=moe_full.routed_expert_norm.weight,
        up_w=moe_full.routed_expert_up_proj.weight,
        shared=(sh.gate_proj.weight, sh.up_proj.weight, sh.down_proj.weight),
    )


def test_engine_latent_moe_matches_reference():
    from kimitui.engine.layers.latent_moe import KimiMoE

    cfg = _latent_config(quantized=False)
    moe = KimiMoE(cfg, "model.layers.1.mlp")
    _fill_moe(moe)
    x = torch.randn(6, cfg.hidden_size)
    with torch.no_grad():
        ours = moe(x)
    ref = ref_latent_moe(
        x,
        top_k=cfg.num_experts_per_tok,
        eps=cfg.rms_norm_eps,
        scale=cfg.routed_scaling_factor,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        **_moe_reference_weights(moe),
    )
    assert (ours.double() - ref).abs().max().item() < 1e-4


class _ThreadPair:
    """Two 'ranks' as threads: all_reduce sums both threads' tensors (what gloo would do)."""

    def __init__(self):
        self.barrier = threading.Barrier(2)
        self.slots = [None, None]


def _rank_state(pair: _ThreadPair, rank: int):
    from kimitui.engine.parallel.state import ParallelState

    class ThreadRank(ParallelState):
        def all_reduce(self, x):
            pair.slots[self.rank] = x.clone()
            pair.barrier.wait()
            total = pair.slots[0] + pair.slots[1]
            pair.barrier.wait()
            x.copy_(total)
            return x

    return ThreadRank(rank=rank, world_size=2)


def test_engine_latent_moe_norms_after_the_cross_rank_reduction():
    # Two ranks, each with half the experts and half the latent up_proj columns: their outputs
    # summed equal the single-rank layer, which is only true if the norm sees the reduced sum.
    from kimitui.engine.layers.latent_moe import KimiMoE

    cfg = _latent_config(quantized=False)
    full = KimiMoE(cfg, "model.layers.1.mlp")
    _fill_moe(full)
    x = torch.randn(5, cfg.hidden_size)
    with torch.no_grad():
        want = full(x)
    pair = _ThreadPair()
    outs = [None, None]

    def run(rank):
        par = _rank_state(pair, rank)
        part = KimiMoE(cfg, "model.layers.1.mlp", par)
        with torch.no_grad():
            part.gate.weight.copy_(full.gate.weight)
            part.gate.e_score_correction_bias.copy_(full.gate.e_score_correction_bias)
            part.routed_expert_down_proj.weight.copy_(full.routed_expert_down_proj.weight)
            part.routed_expert_norm.weight.copy_(full.routed_expert_norm.weight)
            part.routed_expert_up_proj.weight.copy_(full.routed_expert_up_proj.weight[:, part.l0 : part.l1])
            e0 = min(part.experts._slots)
            n = part.experts.local.num
            part.experts.local.w13_weight.copy_(full.experts.local.w13_weight[e0 : e0 + n])
            part.experts.local.w2_weight.copy_(full.experts.local.w2_weight[e0 : e0 + n])
            for name in ("gate_proj", "up_proj"):
                s0, s1 = par.range(getattr(full.shared_experts, name).weight.shape[0])
                getattr(part.shared_experts, name).weight.copy_(getattr(full.shared_experts, name).weight[s0:s1])
            s0, s1 = par.range(full.shared_experts.down_proj.weight.shape[1])
            part.shared_experts.down_proj.weight.copy_(full.shared_experts.down_proj.weight[:, s0:s1])
            outs[rank] = part(x)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch.allclose(outs[0] + outs[1], want, atol=1e-5)
