"""PyTorch references for Kimi K3's own kernels (Kimi Delta Attention, its short convolution and
the attention-residual mix): the oracles only, written for clarity; ``kernels.reference`` re-exports
them beside the other kernels' oracles."""

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------
# Kimi Delta Attention (KDA): the per-token oracles of kernels/kda.py


def kda_recurrence_reference(q, k, v, g, beta, initial_state, cu_seqlens, scale, use_qk_l2norm=True):
    """The KDA delta rule one token at a time (the definition the chunked and decode forms must equal).

    q, k [T, H, K]; v [T, H, V]; g [T, H, K] log-decays; beta [T, H]; initial_state [N, H, K, V];
    cu_seqlens [N+1]. Per sequence and head, with S [K, V] in fp32 (Kimi Linear, arXiv:2510.26692):
    S <- exp(g_t)[:, None] * S; S <- S + k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T q_t, where q and k
    are l2-normalised as x / sqrt(sum x^2 + 1e-6) and q is scaled. Returns (o [T, H, V] in v.dtype,
    final states [N, H, K, V] fp32).
    """
    dtype = v.dtype
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * scale
    out = torch.zeros(v.shape, device=v.device)
    states = initial_state.float().clone()
    cu = cu_seqlens.tolist()
    for n in range(len(cu) - 1):
        S = states[n]  # [H, K, V]
        for t in range(cu[n], cu[n + 1]):
            S = S * g[t].exp()[..., None]
            u = torch.einsum("hk,hkv->hv", k[t], S)
            S = S + k[t][..., None] * (beta[t][:, None] * (v[t] - u))[:, None, :]
            out[t] = torch.einsum("hk,hkv->hv", q[t], S)
        states[n] = S
    return out.to(dtype), states


def causal_conv1d_reference(x, weight, history, cu_seqlens):
    """Depthwise causal conv + SiLU, one sequence at a time: x [T, C], weight [C, W], history
    [N, C, W-1] (inputs before each sequence, oldest first), cu_seqlens [N+1].
    Returns (y [T, C] in x.dtype, the last W-1 inputs of each sequence [N, C, W-1])."""
    cu = cu_seqlens.tolist()
    W = weight.shape[-1]
    ys, hists = [], []
    for n in range(len(cu) - 1):
        seq = torch.cat([history[n].to(weight.dtype), x[cu[n] : cu[n + 1]].t().to(weight.dtype)], dim=1)  # [C, W-1+L]
        if seq.shape[1] >= W:  # an empty sequence has no output
            y = F.conv1d(seq[None], weight[:, None, :], groups=weight.shape[0])[0]  # [C, L]
            ys.append(F.silu(y).t())
        hists.append(seq[:, seq.shape[1] - (W - 1) :])
    return torch.cat(ys + [x[:0]]).to(x.dtype), torch.stack(hists).to(history.dtype)


# ---------------------------------------------------------------------------------------------
# Kimi K3 attention residuals (engine/layers/attn_res.py)


def attn_res_mix(
    x: torch.Tensor, blocks: list[torch.Tensor], norm_weight: torch.Tensor, eps: float, proj_weight: torch.Tensor
) -> torch.Tensor:
    """Softmax mix over the candidates ``blocks + [x]`` (each [T, D]) -> [T, D] in x.dtype.

    score_i = sum_d rmsnorm(V_i)[d] * norm_weight[d] * proj_weight[0, d]; the mix weights the
    un-normalised V_i. Computed in fp32.
    """
    v = torch.stack([*blocks, x], dim=1).float()  # [T, n + 1, D]
    normed = v * torch.rsqrt(v.pow(2).mean(dim=-1, keepdim=True) + eps)
    q = norm_weight.float() * proj_weight.float().view(-1)  # [D]: the norm weight folded into the query
    p = torch.softmax(normed @ q, dim=1)  # [T, n + 1]
    return torch.einsum("tn,tnd->td", p, v).to(x.dtype)
