"""The MLA attention of DeepSeek-V3-shaped EAGLE-3 drafters (``Eagle3DeepseekV2ForCausalLM``).

Checkpoints such as lightseekorg/kimi-k2.6-eagle3-mla and nvidia/Kimi-K2.6-Eagle3 replace the Llama
layer's q/k/v with the target's own attention shape (vLLM's ``model_executor/models/deepseek_eagle3.py``
builds it from ``DeepseekV2MLAAttention``; TorchSpec's ``models/draft/deepseek_eagle.py`` trains it):

- q: ``q_a_proj`` [q_lora_rank, 2 * hidden] -> ``q_a_layernorm`` -> ``q_b_proj`` [heads * (nope + rope),
  q_lora_rank]; or one ``q_proj`` when ``q_lora_rank`` is null;
- kv: ``kv_a_proj_with_mqa`` [kv_lora_rank + rope, 2 * hidden] (TorchSpec's training name:
  ``kv_a_proj``) splits into the latent (``kv_a_layernorm``, then ``kv_b_proj`` [heads * (nope + v),
  kv_lora_rank] gives each head's k_nope and v) and one k_rope shared by all heads;
- rope on the ``qk_rope_head_dim`` dims only, DeepSeek's interleaved pairs (x[2i], x[2i + 1]), with
  the YaRN frequencies and cos/sin amplitude of the target's ``rope_scaling``;
- softmax scale ``qk_head_dim ** -0.5`` times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN;
- ``o_proj`` [hidden, heads * v_head_dim].

The paged cache holds what the target's MLA cache holds, per token the normed latent and the roped
k_rope: ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]``, a fraction of per-head K/V.

Rows of short chunks (the chain's one-row passes, a verified decode's accepted rows) attend as the
target's decodes do: W_UK folded into the query, the backend's ``mla_decode`` reading the latent
cache in place through the block table (Triton on a GPU, the C++ kernel on a CPU), W_UV after; no
copy of the context and no per-token ``kv_b_proj``. Long chunks (a prompt) gather their context
once and run dense attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kimitui.engine.config import RopeScaling, yarn_get_mscale
from kimitui.engine.layers.attn_metadata import PrefillChunk
from kimitui.engine.layers.linear import Linear
from kimitui.engine.layers.norm import RMSNorm
from kimitui.engine.layers.rope import yarn_inv_freq
from kimitui.kernels.backend import REFERENCE, Backend

DECODE_ROWS = 16  # a chunk of at most this many rows attends row by row through mla_decode (in place)
MLA_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass(frozen=True)
class MLAShape:
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    rope_scaling: RopeScaling | None

    @classmethod
    def from_dict(cls, d: dict) -> MLAShape:
        missing = [k for k in MLA_KEYS if not d.get(k)]
        if missing:
            raise ValueError(f"eagle3 drafter config: an MLA drafter needs {missing[0]!r}")
        return cls(
            q_lora_rank=int(d["q_lora_rank"]) if d.get("q_lora_rank") else None,
            **{k: int(d[k]) for k in MLA_KEYS},
            rope_theta=float(d.get("rope_theta", 10000.0)),
            rope_scaling=mla_rope_scaling(d.get("rope_scaling")),
        )

    def param_count(self, hidden: int, heads: int) -> int:
        """The attention's weights (for the memory plan)."""
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = (
            2 * hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * qk
            if self.q_lora_rank
            else 2 * hidden * heads * qk
        )
        kv = 2 * hidden * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * hidden

    @property
    def cache_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


def mla_rope_scaling(d: dict | None) -> RopeScaling | None:
    """A drafter config's ``rope_scaling`` as the target's YaRN parameters (None: plain rope)."""
    if not d:
        return None
    kind = d.get("rope_type", d.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ("yarn", "deepseek_yarn"):
        raise ValueError(
            f"eagle3 drafter config: rope_scaling type {kind!r} is not supported by the MLA drafter (yarn, default)"
        )
    if not d.get("original_max_position_embeddings"):
        raise ValueError("eagle3 drafter config: yarn rope_scaling needs original_max_position_embeddings")
    return RopeScaling(
        factor=float(d["factor"]),
        original_max_position_embeddings=int(d["original_max_position_embeddings"]),
        beta_fast=float(d.get("beta_fast") or 32.0),
        beta_slow=float(d.get("beta_slow") or 1.0),
        mscale=float(d.get("mscale") or 1.0),
        mscale_all_dim=float(d.get("mscale_all_dim") or 0.0),
    )


def rope_interleaved(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, amplitude: float
) -> torch.Tensor:
    """Rotate x [T, heads, D] (fp32 math) on interleaved pairs at ``positions`` [T]."""
    freqs = positions.float()[:, None] * inv_freq[None]  # [T, D/2]
    cos, sin = (freqs.cos() * amplitude)[:, None], (freqs.sin() * amplitude)[:, None]
    xf = x.float().reshape(*x.shape[:-1], -1, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).reshape(x.shape).to(x.dtype)


class Eagle3MLAAttention(nn.Module):
    ops: Backend = REFERENCE  # the drafter's backend, set when it is loaded

    def __init__(self, cfg, dtype: torch.dtype):
        super().__init__()
        m = cfg.mla
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.heads, self.m = heads, m
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            self.q_a_proj = Linear(2 * h, m.q_lora_rank, dtype=dtype)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, cfg.rms_norm_eps, dtype)
            self.q_b_proj = Linear(m.q_lora_rank, heads * qk, dtype=dtype)
        else:
            self.q_proj = Linear(2 * h, heads * qk, dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(2 * h, m.kv_lora_rank + m.qk_rope_head_dim, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, cfg.rms_norm_eps, dtype)
        self.kv_b_proj = Linear(m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), dtype=dtype)
        self.o_proj = Linear(heads * m.v_head_dim, h, dtype=dtype)
        inv, self.amplitude = yarn_inv_freq(m.qk_rope_head_dim, m.rope_theta, m.rope_scaling)
        self.__dict__["_inv_freq"] = inv  # a plain attribute: loading (to_empty) must not blank it
        s = m.rope_scaling
        self.scale = qk**-0.5 * (yarn_get_mscale(s.factor, s.mscale_all_dim) ** 2 if s and s.mscale_all_dim else 1.0)

    def _inv(self, device) -> torch.Tensor:
        inv = self.__dict__["_inv_freq"]
        if inv.device != device:
            inv = self.__dict__["_inv_freq"] = inv.to(device)
        return inv

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        chunks: list[PrefillChunk],
        cache: torch.Tensor,
    ) -> torch.Tensor:
        m, t, heads = self.m, x.shape[0], self.heads
        nope, rope, vd, r = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if m.q_lora_rank else self.q_proj(x)
        q = q.view(t, heads, nope + rope)
        inv = self._inv(x.device)
        q = torch.cat((q[..., :nope], rope_interleaved(q[..., nope:], positions, inv, self.amplitude)), dim=-1)
        kv = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(kv[:, :r])
        k_rope = rope_interleaved(kv[:, None, r:], positions, inv, self.amplitude)[:, 0]
        flat = cache.view(-1, r + rope)
        flat.index_copy_(0, slots, torch.cat((latent, k_rope), dim=-1).to(cache.dtype))
        out = torch.empty(t, heads, vd, dtype=x.dtype, device=x.device)
        bs = cache.shape[1]
        short = [c for c in chunks if c.end - c.start <= DECODE_ROWS]
        if short:
            self._decode_rows(q, short, flat, bs, out)
        for c in chunks:  # long chunks: its rows are the last end - start of its context_len positions
            n, ctx = c.end - c.start, c.context_len
            if n <= DECODE_ROWS:
                continue
            pos = torch.arange(ctx, device=x.device)
            lat = flat.index_select(0, c.block_table[pos // bs].long() * bs + pos % bs).to(x.dtype)  # [ctx, r + rope]
            kvh = self.kv_b_proj(lat[:, :r]).view(ctx, heads, nope + vd)
            k = torch.cat((kvh[..., :nope], lat[:, None, r:].expand(ctx, heads, rope)), dim=-1)
            mask = pos[None, :] <= torch.arange(ctx - n, ctx, device=x.device)[:, None]
            o = F.scaled_dot_product_attention(
                q[c.start : c.end].transpose(0, 1),
                k.transpose(0, 1),
                kvh[..., nope:].transpose(0, 1),
                attn_mask=mask,
                scale=self.scale,
            )
            out[c.start : c.end] = o.transpose(0, 1)
        return self.o_proj(out.reshape(t, heads * vd))

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, nope, r] and W_UV [heads, v, r] from kv_b_proj (cached; the weights never change)."""
        w = self.__dict__.get("_w_ukv")
        if w is None or w[0].device != self.kv_b_proj.weight.device:
            m = self.m
            kvb = self.kv_b_proj.weight.view(self.heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
            w = self.__dict__["_w_ukv"] = (
                kvb[:, : m.qk_nope_head_dim].contiguous(),
                kvb[:, m.qk_nope_head_dim :].contiguous(),
            )
        return w

    def _decode_rows(
        self, q: torch.Tensor, chunks: list[PrefillChunk], flat: torch.Tensor, bs: int, out: torch.Tensor
    ) -> None:
        """Every row of ``chunks`` as one decode query (row i of a chunk sees positions up to its own),
        through the backend's paged ``mla_decode``: the cache is read in place."""
        m, dev = self.m, q.device
        nope, r = m.qk_nope_head_dim, m.kv_lora_rank
        rows, lens, tables = [], [], []
        for c in chunks:
            n = c.end - c.start
            rows.extend(range(c.start, c.end))
            lens.extend(range(c.context_len - n + 1, c.context_len + 1))
            tables.extend([c.block_table] * n)
        width = max(len(tb) for tb in tables)
        table = torch.stack([F.pad(tb, (0, width - len(tb))) for tb in tables]).to(torch.int32)
        idx = torch.tensor(rows, device=dev)
        lens_t = torch.tensor(lens, dtype=torch.int32, device=dev)
        w_uk, w_uv = self._absorbed()
        qr = q.index_select(0, idx)  # [B, H, nope + rope], rope already applied
        q_abs = torch.empty(qr.shape[0], self.heads, r + m.qk_rope_head_dim, dtype=q.dtype, device=dev)
        q_abs[..., r:] = qr[..., nope:]
        self.ops.bmm(qr[..., :nope].transpose(0, 1), w_uk.to(q.dtype), out=q_abs[..., :r].transpose(0, 1))
        o_lat = self.ops.mla_decode(q_abs, flat, table, lens_t, max(lens), bs, r, self.scale)  # [B, H, r]
        o = torch.empty(qr.shape[0], self.heads, m.v_head_dim, dtype=q.dtype, device=dev)
        self.ops.bmm(o_lat.transpose(0, 1), w_uv.to(q.dtype).transpose(1, 2), out=o.transpose(0, 1))
        out.index_copy_(0, idx, o)
