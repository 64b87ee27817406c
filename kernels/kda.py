"""Kimi Delta Attention (KDA) on any PyTorch device: the chunked prefill form, the one-token decode
form and the short causal convolution in front of them.

The recurrence, per head, with a state S [K, V] in fp32 (Kimi Linear, arXiv:2510.26692):

    S <- Diag(exp(g_t)) S;  S <- S + k_t (beta_t (v_t - k_t^T S))^T;  o_t = S^T q_t

with q and k l2-normalised (eps inside the sqrt) and q scaled by ``scale``. The chunked form is the
WY/UT-transform formulation of fla's ``naive_chunk_kda`` (fla-org/flash-linear-attention,
``fla/ops/kda/naive.py``) and transformers' ``chunk_kimi_delta_attention``: per chunk of C tokens,
one triangular solve replaces C sequential rank-1 updates. ``kernels.reference.kda_recurrence_reference``
is the per-token oracle these are tested against.

Sequences are packed row after row ("varlen") and described by ``cu_seqlens`` [N+1], as in fla.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

CHUNK = 64
# Rows per diagonal sub-block of the intra-chunk decay products (see _decayed_scores): 8 measured
# faster than 16 on a 2-core CPU at 512 tokens, 8 heads of 128 (less pairwise exp work); 4 was no better.
_SUB = 8


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (fla's in-kernel l2norm, not F.normalize)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prep_qk(q, k, scale, use_qk_l2norm):
    if use_qk_l2norm:
        return l2norm(q) * scale, l2norm(k)
    return q.float() * scale, k.float()


def _decayed_scores(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """S[..., i, j] = sum_d a_i[d] b_j[d] exp(G_i[d] - G_j[d]) for j <= i, 0 above the diagonal.

    a: [..., C, K] (rows i), b and G: [..., C, K] (G the inclusive cumsum of log-decays <= 0).
    exp(G_i - G_j) is never formed as exp(G_i) * exp(-G_j): exp(-G) overflows after a few dozen
    steps. Off the diagonal blocks the product is split at the first row r of row i's sub-block,
    exp(G_i - G_r) * exp(G_r - G_j), both factors <= 1 because G is non-increasing; only the
    [_SUB x _SUB] diagonal blocks need the pairwise [.., i, j, K] exponent.
    """
    C = a.shape[-2]
    out = a.new_zeros(*a.shape[:-2], C, C)
    causal = torch.ones(_SUB, _SUB, dtype=torch.bool, device=a.device).tril()
    for s in range(0, C, _SUB):
        e = min(s + _SUB, C)
        n = e - s
        diff = G[..., s:e, None, :] - G[..., None, s:e, :]  # [..., n, n, K]
        diff = diff.masked_fill(~causal[:n, :n, None], float("-inf"))
        out[..., s:e, s:e] = (a[..., s:e, None, :] * b[..., None, s:e, :] * diff.exp()).sum(-1)
        if s:
            ref = G[..., s : s + 1, :]
            left = a[..., s:e, :] * (G[..., s:e, :] - ref).exp()  # [..., n, K]
            right = b[..., :s, :] * (ref - G[..., :s, :]).exp()  # [..., s, K]
            out[..., s:e, :s] = left @ right.transpose(-1, -2)
    return out


def _chunk_layout(cu: list[int], chunk: int, device):
    """Where each packed row goes when every sequence is cut into chunks of ``chunk`` rows, the
    last one right-padded. Returns (dest [T] int64 row in the padded layout, first chunk of each
    sequence, number of chunks of each sequence)."""
    lens = [e - s for s, e in zip(cu[:-1], cu[1:])]
    nchunks = [-(-n // chunk) for n in lens]
    first = [0] * len(lens)
    for i in range(1, len(lens)):
        first[i] = first[i - 1] + nchunks[i - 1]
    seq = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
    starts = torch.tensor(cu[:-1], device=device)
    base = torch.tensor(first, device=device) * chunk
    rows = torch.arange(cu[-1], device=device)
    dest = base[seq] + rows - starts[seq]
    return dest, first, nchunks


def _to_chunks(x: torch.Tensor, dest: torch.Tensor, num_chunks: int, chunk: int) -> torch.Tensor:
    """[T, H, D] packed rows -> [num_chunks, H, chunk, D], zeros in the padding."""
    out = x.new_zeros(num_chunks * chunk, *x.shape[1:])
    out.index_copy_(0, dest, x)
    return out.view(num_chunks, chunk, *x.shape[1:]).transpose(1, 2)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool = True,
    chunk_size: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill of N packed sequences, each continuing from its own state.

    q, k [T, H, K]; v [T, H, V]; g [T, H, K] log-decays (<= 0); beta [T, H]; initial_state
    [N, H, K, V] fp32; cu_seqlens [N+1] int64 (row offsets, host-readable). Returns
    (o [T, H, V] in v.dtype, final_state [N, H, K, V] fp32). The loop runs over chunk index, each
    step batched over every sequence that still has a chunk.
    """
    cu = [int(c) for c in cu_seqlens.tolist()]
    T, H, K = k.shape
    Vd = v.shape[-1]
    N = len(cu) - 1
    _check(q, k, v, g, beta, T, H, K)
    if initial_state.shape != (N, H, K, Vd):
        raise ValueError(f"chunk_kda: initial_state {tuple(initial_state.shape)}, expected {(N, H, K, Vd)}")
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu[:-1], cu[1:])):
        raise ValueError(f"chunk_kda: cu_seqlens {cu} does not partition {T} rows")
    state = initial_state.float().clone()
    out = v.new_zeros(T, H, Vd)
    if T == 0:
        return out, state
    qs, ks = _prep_qk(q, k, scale, use_qk_l2norm)
    C = chunk_size
    dest, first, nchunks = _chunk_layout(cu, C, q.device)
    total = sum(nchunks)
    qc, kc = _to_chunks(qs, dest, total, C), _to_chunks(ks, dest, total, C)  # [NC, H, C, K]
    vc, gc = _to_chunks(v.float(), dest, total, C), _to_chunks(g.float(), dest, total, C)
    bc = _to_chunks(beta.float()[..., None], dest, total, C)  # [NC, H, C, 1]
    oc = torch.zeros(total, H, C, Vd, device=q.device)
    eye_mask = torch.eye(C, dtype=torch.bool, device=q.device)
    for j in range(max(nchunks, default=0)):
        live = [i for i in range(N) if nchunks[i] > j]
        seqs = torch.tensor(live, device=q.device)
        ids = torch.tensor([first[i] + j for i in live], device=q.device)
        qj, kj, vj = qc.index_select(0, ids), kc.index_select(0, ids), vc.index_select(0, ids)
        bj = bc.index_select(0, ids)
        G = gc.index_select(0, ids).cumsum(-2)  # [A, H, C, K] inclusive, fp32
        scores = _decayed_scores(torch.stack([kj, qj]), kj, G)  # [2, A, H, C, C]
        M = (bj * scores[0]).masked_fill(eye_mask, 0.0)  # strictly lower: beta_i k_i.k_j decayed
        Aqk = scores[1]  # lower with diagonal: q_i.k_j decayed
        # (I + M) [U | W] = [beta v | beta k exp(G)]: the UT transform, one unit-triangular solve.
        rhs = torch.cat([bj * vj, bj * kj * G.exp()], dim=-1)
        UW = torch.linalg.solve_triangular(M, rhs, upper=False, unitriangular=True)
        U, W = UW[..., :Vd], UW[..., Vd:]
        S = state.index_select(0, seqs)  # [A, H, K, V]
        v_new = U - W @ S  # [A, H, C, V]
        oc.index_copy_(0, ids, (qj * G.exp()) @ S + Aqk @ v_new)
        G_last = G[..., -1:, :]  # [A, H, 1, K]; padded rows have g = 0, so this is the last real row
        S = S * G_last.transpose(-1, -2).exp() + (kj * (G_last - G).exp()).transpose(-1, -2) @ v_new
        state.index_copy_(0, seqs, S)
    out = oc.transpose(1, 2).reshape(total * C, H, Vd).index_select(0, dest)
    return out.to(v.dtype), state


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """One decode token for each of N sequences; their states are updated in place.

    q, k [N, H, K]; v [N, H, V]; g [N, H, K]; beta [N, H]; state [num_slots, H, K, V] fp32 pool,
    row ``slots[n]`` belonging to sequence n. Returns o [N, H, V] in v.dtype.
    """
    N, H, K = k.shape
    _check(q, k, v, g, beta, N, H, K)
    if slots.shape != (N,):
        raise ValueError(f"recurrent_kda: slots {tuple(slots.shape)}, expected ({N},)")
    if N == 0:
        return v.new_zeros(0, H, v.shape[-1])
    qs, ks = _prep_qk(q, k, scale, use_qk_l2norm)
    S = state.index_select(0, slots)  # [N, H, K, V], a copy: the pool rows are written back at the end
    S.mul_(g.float().exp()[..., None])  # decay the rows (key channels)
    # One read of S for both products: k^T S (what the memory predicts for k) and q^T S.
    uo = torch.stack([ks, qs], dim=-2) @ S  # [N, H, 2, V]
    delta = beta.float()[..., None] * (v.float() - uo[..., 0, :])  # [N, H, V]
    # o = q^T (S + k delta^T) = q^T S + (q . k) delta, so S is not read again.
    o = uo[..., 1, :] + (qs * ks).sum(-1, keepdim=True) * delta
    S.view(-1, K, S.shape[-1]).baddbmm_(ks.reshape(-1, K, 1), delta.reshape(-1, 1, delta.shape[-1]))
    state.index_copy_(0, slots, S)
    return o.to(v.dtype)


def recurrent_kda_spec(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    indices: torch.Tensor,
    lengths: list[int],
    scale: float,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Speculative verification in fla-core's layout (``fused_recurrent_kda_fwd`` with
    ``ssm_state_indices [N, T]`` and ``num_accepted_tokens``): sequence n has ``lengths[n]``
    consecutive rows of q, k, g [R, H, K], v [R, H, V], beta [R, H]; it starts from pool row
    ``indices[n, lengths[n] - 1]`` and the state after its position t is written to pool row
    ``indices[n, t]`` (distinct rows, so every verified position's state is kept). Returns o [R, H, V]."""
    R, H, K = k.shape
    _check(q, k, v, g, beta, R, H, K)
    if sum(lengths) != R or indices.shape[0] != len(lengths) or indices.shape[1] < max(lengths, default=0):
        raise ValueError(
            f"recurrent_kda_spec: lengths {lengths} and indices {tuple(indices.shape)} do not match {R} rows"
        )
    o = v.new_empty(R, H, v.shape[-1])
    if R == 0:
        return o
    n = len(lengths)
    idx = indices.long()
    starts = torch.tensor([0, *itertools.accumulate(lengths)][:-1], device=q.device)
    last = torch.tensor([length - 1 for length in lengths], device=q.device)
    work = state.index_select(0, idx.gather(1, last[:, None])[:, 0])  # [N, ...]: each sequence's running state
    for t in range(max(lengths)):
        live = [i for i in range(n) if lengths[i] > t]
        live_t = torch.tensor(live, device=q.device)
        rows = starts[live_t] + t
        o[rows] = recurrent_kda(q[rows], k[rows], v[rows], g[rows], beta[rows], work, live_t, scale, use_qk_l2norm)
        state.index_copy_(0, idx[live_t, t], work.index_select(0, live_t))
    return o


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, history: torch.Tensor, cu_seqlens: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv (kernel W) + SiLU over packed sequences, each continuing its history.

    x [T, C]; weight [C, W] (fp32 in Kimi checkpoints; the conv runs in its dtype); history
    [N, C, W-1], the last W-1 inputs before each sequence, oldest first (zeros for a new one);
    cu_seqlens [N+1], or None for decode (one row per sequence, T == N). Returns
    (y [T, C] in x.dtype, new history [N, C, W-1] in history.dtype).
    """
    T, Cn = x.shape
    W = weight.shape[-1]
    N = history.shape[0]
    if weight.shape != (Cn, W) or history.shape != (N, Cn, W - 1):
        raise ValueError(
            f"causal_conv1d: x {tuple(x.shape)}, weight {tuple(weight.shape)}, history "
            f"{tuple(history.shape)} do not agree (want [T, C], [C, W], [N, C, W-1])"
        )
    if cu_seqlens is None:
        if T != N:
            raise ValueError(f"causal_conv1d: decode needs one row per sequence, got {T} rows for {N}")
        window = torch.cat([history.to(weight.dtype), x.to(weight.dtype)[..., None]], dim=-1)  # [N, C, W]
        y = F.silu((window * weight).sum(-1))
        return y.to(x.dtype), window[..., 1:].to(history.dtype)
    cu = [int(c) for c in cu_seqlens.tolist()]
    if len(cu) != N + 1 or cu[0] != 0 or cu[-1] != T:
        raise ValueError(f"causal_conv1d: cu_seqlens {cu} does not partition {T} rows into {N} sequences")
    if T == 0:
        return x.clone(), history.clone()
    # Each sequence's history rows go right before its own rows: [sum(L_i + W-1), C]. A valid
    # (unpadded) conv over that then never mixes two sequences in one output that is kept.
    lens = torch.tensor([e - s for s, e in zip(cu[:-1], cu[1:])], device=x.device)
    seq = torch.repeat_interleave(torch.arange(N, device=x.device), lens)
    rows = torch.arange(T, device=x.device) + seq * (W - 1) + (W - 1)  # row of x[t] in the extended layout
    hist_rows = (torch.tensor(cu[:-1], device=x.device) + torch.arange(N, device=x.device) * (W - 1))[
        :, None
    ] + torch.arange(W - 1, device=x.device)  # [N, W-1]
    ext = torch.empty(T + N * (W - 1), Cn, dtype=weight.dtype, device=x.device)
    ext.index_copy_(0, rows, x.to(weight.dtype))
    ext.index_copy_(0, hist_rows.reshape(-1), history.transpose(1, 2).reshape(-1, Cn).to(weight.dtype))
    # Valid conv as W shifted multiply-adds over contiguous row slices (several times faster on a
    # CPU than a depthwise F.conv1d): y_full[r] = sum_j w[:, j] * ext[r + j], the window ending at
    # ext row r + W-1, so ext row r's output is y_full[r - (W-1)].
    n_out = ext.shape[0] - W + 1
    y_full = ext[:n_out] * weight[:, 0]
    for j in range(1, W):
        y_full.addcmul_(ext[j : j + n_out], weight[:, j])
    y = F.silu(y_full.index_select(0, rows - (W - 1)))
    last = (torch.tensor(cu[1:], device=x.device) + torch.arange(N, device=x.device) * (W - 1))[:, None] + torch.arange(
        W - 1, device=x.device
    )  # the last W-1 ext rows of each sequence
    new_hist = ext.index_select(0, last.reshape(-1)).view(N, W - 1, Cn).transpose(1, 2)
    return y.to(x.dtype), new_hist.to(history.dtype).contiguous()


def kda_gate(a: torch.Tensor, A_log: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """Log-space forget gate, fp32. a [T, H, K] = f_b_proj(f_a_proj(x)) + dt_bias; A_log [H].
    Kimi Linear: -exp(A_log) * softplus(a); Kimi K3 (``lower_bound``, fla's "safe gate"):
    lower_bound * sigmoid(exp(A_log) * a)."""
    rate = A_log.float().exp()[:, None]  # [H, 1]
    a = a.float()
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * a)
    return -rate * F.softplus(a, threshold=20.0)  # softplus(a) = a above 20, as transformers does


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over each head's output [T, H, V] times sigmoid(gate), in fp32 (fla's FusedRMSNormGated)."""
    o = o.float()
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)
    return o * weight.float() * torch.sigmoid(gate.float())


def _check(q, k, v, g, beta, T, H, K):
    if q.shape != (T, H, K) or g.shape != (T, H, K) or v.shape[:2] != (T, H) or beta.shape != (T, H):
        raise ValueError(
            f"kda: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, "
            f"beta {tuple(beta.shape)} do not agree (want q, k, g [T, H, K], v [T, H, V], beta [T, H])"
        )
