"""Kimi Delta Attention (KDA), the linear-attention layer of Kimi Linear and Kimi K3.

Per token (Kimi Linear, arXiv:2510.26692; transformers' ``models/kimi_linear/modeling_kimi_linear.py``):
q, k, v projections, each through a depthwise causal conv (kernel 4) and SiLU; per-channel forget
gate g in log space from a low-rank projection; beta = sigmoid(b_proj(x)); the delta-rule recurrence
of kernels/kda.py on an fp32 state [H, K, V] per sequence; an RMSNorm over each head's output gated
by sigmoid(output gate); o_proj. Two gate forms:

- Kimi Linear: g = -exp(A_log[h]) * softplus(f_b_proj(f_a_proj(x)) + dt_bias)
- Kimi K3 (``gate_lower_bound``, fla's "safe gate"):
  g = gate_lower_bound * sigmoid(exp(A_log[h]) * (f_b_proj(f_a_proj(x)) + dt_bias))

The state lives outside the layer, one slot per sequence (``engine.kv_cache.state.KDAState``):
rows are laid out decodes first, then prefill chunks, and ``meta.state_slots`` names each
sequence's slot. Every row is computed whatever ``meta.out_rows`` says: each one moves the state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kimitui.engine.config import QuantConfig
from kimitui.engine.kv_cache.state import KDAState, KDAStateSpec
from kimitui.engine.layers.attn_metadata import AttentionMetadata, KDAVerifyRows
from kimitui.engine.layers.linear import Linear, fuse_dense_rows
from kimitui.engine.parallel.state import SINGLE, ParallelState
from kimitui.kernels.backend import REFERENCE, Backend
from kimitui.kernels.kda import gated_rms_norm, kda_gate  # noqa: F401 - kda_gate: this module's public name too


@dataclass(frozen=True)
class KDAConfig:
    """What a KDA layer needs from the model config (``linear_attn_config`` plus three model keys)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    conv_kernel: int = 4
    gate_lower_bound: float | None = None  # K3: -5.0; None = Kimi Linear's softplus gate
    use_full_rank_gate: bool = False  # K3: output gate g_proj [P, D]; else g_a_proj/g_b_proj
    rms_norm_eps: float = 1e-5
    quantization: QuantConfig | None = None

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "head_dim", "conv_kernel"):
            if getattr(self, name) < 1:
                raise ValueError(f"linear_attn_config: {name} must be positive, got {getattr(self, name)}")
        if self.gate_lower_bound is not None and self.gate_lower_bound >= 0:
            raise ValueError(
                f"linear_attn_config: gate_lower_bound must be negative (a log-decay), got {self.gate_lower_bound}"
            )

    @property
    def proj_size(self) -> int:
        return self.num_heads * self.head_dim

    @classmethod
    def from_linear_attn_config(
        cls, hidden_size: int, linear_attn_config: dict, rms_norm_eps: float, quantization: QuantConfig | None = None
    ) -> KDAConfig:
        c = linear_attn_config
        missing = [key for key in ("num_heads", "head_dim") if key not in c]
        if missing:
            raise ValueError(f"linear_attn_config: missing {', '.join(missing)}")
        return cls(
            hidden_size=hidden_size,
            num_heads=int(c["num_heads"]),
            head_dim=int(c["head_dim"]),
            conv_kernel=int(c.get("short_conv_kernel_size", 4)),
            gate_lower_bound=c.get("gate_lower_bound"),
            use_full_rank_gate=bool(c.get("use_full_rank_gate", False)),
            rms_norm_eps=rms_norm_eps,
            quantization=quantization,
        )

    def state_spec(self, par: ParallelState = SINGLE) -> KDAStateSpec:
        """What one layer keeps per sequence on this rank (its share of the heads)."""
        h0, h1 = par.range(self.num_heads)
        return KDAStateSpec(
            num_heads=h1 - h0, head_k_dim=self.head_dim, head_v_dim=self.head_dim, conv_kernel=self.conv_kernel
        )


class _ConvWeight(nn.Module):
    """Holds one depthwise conv weight under its checkpoint name (``q_conv1d.weight`` [P, 1, W], fp32)."""

    def __init__(self, channels: int, kernel: int, shard: tuple[int, int] | None, full: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=torch.float32), requires_grad=False)
        self.weight.full_shape = (full, 1, kernel)
        self.weight.shard = None if shard is None else (0, *shard)


class KimiDeltaAttention(nn.Module):
    ops: Backend = REFERENCE  # the model's backend, set when it is loaded
    needs_fla = True  # on a GPU the Triton backend runs KDA through fla-core (checked by attach_backends)

    def __init__(self, config: KDAConfig, prefix: str, par: ParallelState = SINGLE, dtype: torch.dtype = torch.float32):
        """``dtype``: of the projections; A_log, dt_bias, the conv weights and o_norm stay fp32."""
        super().__init__()
        c = config
        if c.num_heads < par.world_size:
            raise ValueError(f"{prefix}: {c.num_heads} KDA heads cannot be split over {par.world_size} ranks")
        self.config, self.par = c, par
        q = c.quantization
        # Heads split across ranks (unevenly when needed, as MLA); every per-channel tensor follows its
        # heads. f_a_proj and g_a_proj (rank head_dim) are replicated; o_proj is row parallel.
        h0, h1 = par.range(c.num_heads)
        self.h0, self.num_heads, self.head_dim = h0, h1 - h0, c.head_dim
        d, P, hd = c.hidden_size, c.proj_size, c.head_dim

        def heads(width: int, axis: int = 0):
            return (axis, h0 * width, h1 * width) if par.is_parallel else None

        self.q_proj = Linear(d, P, q, f"{prefix}.q_proj", heads(hd), dtype=dtype)
        self.k_proj = Linear(d, P, q, f"{prefix}.k_proj", heads(hd), dtype=dtype)
        self.v_proj = Linear(d, P, q, f"{prefix}.v_proj", heads(hd), dtype=dtype)
        chan = (h0 * hd, h1 * hd) if par.is_parallel else None
        local = self.num_heads * hd
        self.q_conv1d = _ConvWeight(local, c.conv_kernel, chan, P)
        self.k_conv1d = _ConvWeight(local, c.conv_kernel, chan, P)
        self.v_conv1d = _ConvWeight(local, c.conv_kernel, chan, P)
        self.f_a_proj = Linear(d, hd, q, f"{prefix}.f_a_proj", dtype=dtype)
        self.f_b_proj = Linear(hd, P, q, f"{prefix}.f_b_proj", heads(hd), dtype=dtype)
        self.dt_bias = nn.Parameter(torch.empty(local, dtype=torch.float32), requires_grad=False)
        self.dt_bias.full_shape, self.dt_bias.shard = (P,), (None if chan is None else (0, *chan))
        # Per-head decay rate, this rank's heads. Checkpoints store [1, 1, H, 1] (Kimi Linear) or
        # [128] for 96 heads (K3, first H real): load_A_log reads either.
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.A_log.weight_loader = self._A_log_loader
        self.b_proj = Linear(d, c.num_heads, q, f"{prefix}.b_proj", heads(1), dtype=dtype)
        if c.use_full_rank_gate:
            self.g_proj = Linear(d, P, q, f"{prefix}.g_proj", heads(hd), dtype=dtype)
        else:
            self.g_a_proj = Linear(d, hd, q, f"{prefix}.g_a_proj", dtype=dtype)
            self.g_b_proj = Linear(hd, P, q, f"{prefix}.g_b_proj", heads(hd), dtype=dtype)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(hd, dtype=torch.float32), requires_grad=False)
        self.o_proj = Linear(P, d, q, f"{prefix}.o_proj", heads(hd, axis=1), dtype=dtype)
        self.scale = hd**-0.5
        # Set by post_load: the input projections as one weight, the three convs as one [3P', W].
        self.register_buffer("in_proj", None, persistent=False)
        self.register_buffer("conv_weight", None, persistent=False)
        # a plain decode step in one call where the backend offers it (Backend.fuse_attention, asked once
        # after loading); None: op by op
        self.fused = None

    # --- loading -------------------------------------------------------------------------------

    def load_A_log(self, tensor: torch.Tensor) -> None:
        """Fill A_log from a checkpoint tensor of shape [1, 1, H, 1] or [n >= H] (this rank's heads)."""
        H = self.config.num_heads
        flat = tensor.reshape(-1) if tensor.dim() == 4 and tensor.shape[2] == H and tensor.numel() == H else None
        if flat is None and tensor.dim() == 1 and tensor.shape[0] >= H:
            flat = tensor[:H]  # K3 pads per-head A_log to [head_dim]: the first H entries are the heads
        if flat is None:
            raise ValueError(f"A_log: shape {list(tensor.shape)}, expected [1, 1, {H}, 1] or [n >= {H}]")
        self.A_log.data.copy_(flat[self.h0 : self.h0 + self.num_heads].float())

    def _A_log_loader(self, param: torch.Tensor, tensor: torch.Tensor) -> None:
        self.load_A_log(tensor)

    def post_load(self) -> None:
        """Once the weights are in: fuse the projections that read x into one product and the three
        conv weights into one (each original parameter re-pointed at its part, no second copy)."""
        self.in_proj = fuse_dense_rows(*self._in_projs())
        convs = (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)
        fused = torch.cat([w.data for w in convs])  # [3P', 1, W]
        start = 0
        for w in convs:
            w.data = fused[start : start + w.shape[0]]
            start += w.shape[0]
        self.conv_weight = fused[:, 0]

    def _in_projs(self) -> list[Linear]:
        gate = [self.g_proj] if hasattr(self, "g_proj") else [self.g_a_proj]
        return [self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj, *gate]

    # --- forward -------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, state: KDAState) -> torch.Tensor:
        """x [T, D] -> [T, D]; reads and writes the state of the slots in ``meta.state_slots``."""
        fused = self.fused
        if fused is not None and fused.takes(x, meta, state):  # the backend's one call (a CPU decode step)
            return fused(x, meta, state)
        T = x.shape[0]
        H, hd = self.num_heads, self.head_dim
        P = H * hd
        qkv, f_a, b, g_in = self._project(x)  # g_in: the output gate (full rank) or g_a_proj's output
        d = meta.num_decode_tokens
        slots = meta.state_slots
        n_seq = d + len(meta.prefills)
        if slots is None or slots.shape != (n_seq,):
            raise ValueError(
                f"KDA: meta.state_slots must hold one slot per sequence ({n_seq}), got "
                f"{None if slots is None else tuple(slots.shape)}"
            )
        conv_w = (
            self.conv_weight
            if self.conv_weight is not None
            else torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0]
        )
        if meta.kda_verify_rows is not None:  # a verification step in a decode graph's fixed layout
            if d != T or meta.prefills:
                raise ValueError("KDA: a fixed-layout verification step (kda_verify_rows) has decode rows only")
            gate = g_in if self.config.use_full_rank_gate else self.g_b_proj(g_in)
            out = self._verify_rows(qkv, self.f_b_proj(f_a), b, gate, conv_w, slots, state, meta.kda_verify_rows)
            return self.par.all_reduce(self.o_proj(out))
        if d == T and not meta.prefills and meta.kda_spec is None:
            # a plain decode step: gate, beta, conv, delta rule and the gated norm in one backend call
            # (one launch on a device); speculative verification and prefills run the ops below
            gate = g_in if self.config.use_full_rank_gate else self.g_b_proj(g_in)
            out = self._fused_decode(qkv, self.f_b_proj(f_a), b, gate, conv_w, state, slots)
            return self.par.all_reduce(self.o_proj(out))

        a = (self.f_b_proj(f_a).float() + self.dt_bias).view(T, H, hd)
        g = kda_gate(a, self.A_log, self.config.gate_lower_bound)  # [T, H, hd] fp32
        beta = torch.sigmoid(b.float())  # [T, H]

        o = torch.empty(T, H, hd, dtype=x.dtype, device=x.device)
        if d and meta.kda_spec is not None:
            self._verify(qkv[:d], g[:d], beta[:d], conv_w, meta.kda_spec, meta.kda_spec_layout, slots[:d], state, o)
        elif d:
            o[:d] = self._decode(qkv[:d], g[:d], beta[:d], conv_w, slots[:d], state)
        if meta.prefills:
            o[d:] = self._prefill(qkv[d:], g[d:], beta[d:], conv_w, meta, slots[d:], state)

        gate = (g_in if self.config.use_full_rank_gate else self.g_b_proj(g_in)).view(T, H, hd)
        out = gated_rms_norm(o, gate, self.o_norm.weight, self.config.rms_norm_eps).to(x.dtype)
        return self.par.all_reduce(self.o_proj(out.view(T, P)))

    def _decode(self, qkv, g, beta, conv_w, slots, state: KDAState) -> torch.Tensor:
        """One token per row, each row a different sequence: one recurrent step in each slot."""
        d, H, hd = qkv.shape[0], self.num_heads, self.head_dim
        y, hist = self.ops.causal_conv1d(qkv, conv_w, state.conv.index_select(0, slots))
        state.conv.index_copy_(0, slots, hist)
        q, k, v = (t.view(d, H, hd) for t in y.split(H * hd, dim=-1))
        return self.ops.kda_recurrent(q, k, v, g, beta, state.recurrent, slots, self.scale)

    def _verify(self, qkv, g, beta, conv_w, steps, layout, slots, state: KDAState, o) -> None:
        """Speculative verification: a sequence's draft rows share its slot, and after each position
        but a sequence's last the state is kept in a scratch slot, from which the runner restores the
        last accepted position's state. The short conv (a few hundred bytes of history per row) is
        stepped position by position (``steps``); the recurrence runs all positions in one call with
        the ``layout``'s per-position state rows (fla-core's spec-decoding mode on GPUs)."""
        y = torch.empty_like(qkv)
        for step in steps:
            r = step.rows
            y[r], hist = self.ops.causal_conv1d(qkv[r], conv_w, state.conv.index_select(0, slots[r]))
            state.conv.index_copy_(0, slots[r], hist)
            if step.save_src is not None:
                state.conv.index_copy_(0, step.save_dst, state.conv.index_select(0, step.save_src))
        d, H, hd = qkv.shape[0], self.num_heads, self.head_dim
        q, k, v = (t.view(d, H, hd) for t in y.split(H * hd, dim=-1))
        o[:d] = self.ops.kda_recurrent_spec(
            q, k, v, g, beta, state.recurrent, layout.indices, layout.lengths, self.scale
        )

    def _fused_decode(self, qkv, f_b, b, gate, conv_w, state: KDAState, slots) -> torch.Tensor:
        """One fused decode step (``ops.kda_decode``) of one token per row in the rows' slots."""
        return self.ops.kda_decode(
            qkv,
            f_b,
            b,
            gate,
            conv_w,
            self.A_log,
            self.dt_bias,
            self.config.gate_lower_bound,
            self.o_norm.weight,
            self.config.rms_norm_eps,
            state.conv,
            state.recurrent,
            slots,
            self.scale,
        )

    def _verify_rows(self, qkv, f_b, b, gate, conv_w, slots, state: KDAState, rows: KDAVerifyRows) -> torch.Tensor:
        """Verification in a fixed position-major layout (``KDAVerifyRows``): position ``j`` of every
        sequence is one fused decode step on rows ``j * n .. (j + 1) * n`` in the sequences' own slots
        (padding rows carry slot -1: skipped), then the state after it is copied into the scratch
        slot the rollback reads. The last real position's state stays in the sequence's slot, as in
        ``_verify``. -> [T, P] (o_proj's input)"""
        T, w = qkv.shape[0], rows.width
        n = T // w
        if n * w != T or rows.save_src.shape != (w - 1, n):
            raise ValueError(
                f"KDA: {T} verification rows do not split into {w} positions of the save layout "
                f"{tuple(rows.save_src.shape)}"
            )
        out = qkv.new_empty(T, self.num_heads * self.head_dim)
        for j in range(w):
            r = slice(j * n, (j + 1) * n)
            out[r] = self._fused_decode(qkv[r], f_b[r], b[r], gate[r], conv_w, state, slots[r])
            if j < w - 1:
                src, dst = rows.save_src[j], rows.save_dst[j]
                state.recurrent.index_copy_(0, dst, state.recurrent.index_select(0, src))
                state.conv.index_copy_(0, dst, state.conv.index_select(0, src))
        return out

    def _prefill(self, qkv, g, beta, conv_w, meta: AttentionMetadata, slots, state: KDAState) -> torch.Tensor:
        # The prefill chunks, one packed varlen call each for the conv and the chunked recurrence.
        cu_seqlens, keep = meta.varlen_prefills(qkv.device)  # keep [N]: continue from the slot's state
        end, rows = meta.prefills[-1].end, meta.num_decode_tokens + qkv.shape[0]
        if end != rows:
            raise ValueError(f"KDA: prefill chunks end at row {end}, the batch has {rows} rows")
        hist = state.conv.index_select(0, slots) * keep[:, None, None]
        y, hist = self.ops.causal_conv1d(qkv, conv_w, hist, cu_seqlens)
        state.conv.index_copy_(0, slots, hist)
        n, H, hd = qkv.shape[0], self.num_heads, self.head_dim
        q, k, v = (t.view(n, H, hd) for t in y.split(H * hd, dim=-1))
        h0 = state.recurrent.index_select(0, slots) * keep[:, None, None, None]
        o, final = self.ops.kda_chunk(q, k, v, g, beta, h0, cu_seqlens, self.scale)
        state.recurrent.index_copy_(0, slots, final.to(state.recurrent.dtype))
        return o

    def _project(self, x: torch.Tensor):
        """(q|k|v [T, 3P'], f_a [T, hd], b [T, H'], g_proj's [T, P'] or g_a_proj's [T, hd] output)."""
        projs = self._in_projs()
        if self.in_proj is None:
            outs = [p(x) for p in projs]
            qkv = torch.cat(outs[:3], dim=-1)
        else:
            y = self.ops.linear(x, self.in_proj)  # [T, 3P' + hd + H' + gate]
            sizes = [p.out_features for p in projs]
            width = sum(sizes[:3])
            qkv = y[:, :width]  # a view: the conv reads it strided
            outs = [None] * 3 + list(y[:, width:].split(sizes[3:], dim=-1))
        return qkv, outs[3], outs[4], outs[5]
