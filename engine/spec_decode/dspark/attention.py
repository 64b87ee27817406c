"""The DSpark drafter's attention: K3-shaped MLA (q/kv LoRA, interleaved rope on the rope dims unless
NoPE, no output gate), every block row attending to its sequence's whole context and to every row of
the block (non-causal).

Two ways to read the context (the latent KV the drafter cached for positions 0..p, in its paged cache
on the target's block ids):

- **In place** (``PagedContext``, the default): the block's own latents are written into the paged
  cache at the block's positions p + 1 .. p + K (slots the scheduler reserves past each step, as for
  EAGLE: ``SpeculativeConfig.num_lookahead_slots``; whatever a block leaves there is overwritten when
  the verified rows are absorbed, before any later pass reads it). Then every block row is one decode
  query over context length p + 1 + K, absorbed as the target's MLA decode is (W_UK folded into the
  query, the backend's paged ``mla_decode`` reading the latent cache through the block table, W_UV
  after: Triton on a GPU, the C++ kernel on a CPU), so nothing is copied and ``kv_b_proj`` never
  runs over the context (vLLM's ``dspark_mla.py`` reads its cache through the same MLA backend).
- **Copy** (a context tensor [S, C, width] gathered from the cache, with its ``valid`` mask): the
  latents expanded per head with ``kv_b_proj`` and one padded attention call. The proposer falls back
  to it when a sequence's block table does not reach its block's last position (near
  ``max_model_len``, or a reservation the block manager could not give).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kimitui.engine.config import yarn_get_mscale
from kimitui.engine.layers.linear import Linear
from kimitui.engine.layers.norm import RMSNorm
from kimitui.engine.layers.rope import yarn_inv_freq
from kimitui.engine.spec_decode.eagle3.mla import rope_interleaved
from kimitui.kernels.backend import REFERENCE, Backend


@dataclass
class PagedContext:
    """One block pass's view of the paged context cache: ``cache`` [layers, slots, width] (each
    layer's latents contiguous), and per block row (S * K rows, sequence after sequence) its
    sequence's block table ``tables`` [S * K, W] int32, its context length ``lens`` [S * K] int32
    (the context and the whole block) and its own cache slot ``slots`` [S * K] int64."""

    cache: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor
    max_len: int
    block_size: int
    slots: torch.Tensor

    def layer(self, i: int) -> PagedContext:
        return PagedContext(self.cache[i], self.tables, self.lens, self.max_len, self.block_size, self.slots)


class DSparkAttention(nn.Module):
    """K3-shaped MLA (q/kv LoRA, interleaved rope on the rope dims unless NoPE), no output gate."""

    ops: Backend = REFERENCE  # the drafter's backend, set when the proposer attaches it

    def __init__(self, cfg, dtype: torch.dtype):
        super().__init__()
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.cfg, self.heads = cfg, heads
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(h, cfg.q_lora_rank, dtype=dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype)
            self.q_b_proj = Linear(cfg.q_lora_rank, heads * qk, dtype=dtype)
        else:
            self.q_proj = Linear(h, heads * qk, dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(h, cfg.cache_width, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, dtype)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), dtype=dtype)
        self.o_proj = Linear(heads * cfg.v_head_dim, h, dtype=dtype)
        inv, self.amplitude = yarn_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.__dict__["_inv_freq"] = inv  # a plain attribute: loading (to_empty) must not blank it
        s = cfg.rope_scaling
        self.scale = qk**-0.5 * (yarn_get_mscale(s.factor, s.mscale_all_dim) ** 2 if s and s.mscale_all_dim else 1.0)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if not self.cfg.use_rope:
            return x
        inv = self.__dict__["_inv_freq"]
        if inv.device != x.device:
            inv = self.__dict__["_inv_freq"] = inv.to(x.device)
        return rope_interleaved(x, positions, inv, self.amplitude)

    def latent(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Per row the cached form: the normed latent and the roped k_rope [T, kv_lora + rope]."""
        r = self.cfg.kv_lora_rank
        kv = self.kv_a_proj_with_mqa(x)
        return torch.cat((self.kv_a_layernorm(kv[:, :r]), self._rope(kv[:, None, r:], positions)[:, 0]), dim=-1)

    def _query(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        c, t = self.cfg, x.shape[0]
        nope = c.qk_nope_head_dim
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if c.q_lora_rank else self.q_proj(x)
        q = q.view(t, self.heads, nope + c.qk_rope_head_dim)
        return torch.cat((q[..., :nope], self._rope(q[..., nope:], positions)), dim=-1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, context, valid: torch.Tensor | None, block: int):
        """``x`` [S * block, hidden] (normed), sequence after sequence. ``context``: a ``PagedContext``
        (read in place), or [S, C, kv_lora + rope], each sequence's latent context padded to C rows
        (``valid`` [S, C] marks the real ones: the copy path)."""
        if isinstance(context, PagedContext):
            return self._forward_paged(x, positions, context)
        c, t, heads = self.cfg, x.shape[0], self.heads
        nope, rope, vd, r = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        s_n = t // block
        q = self._query(x, positions)
        own = self.latent(x, positions).view(s_n, block, -1)
        lat = torch.cat((context.to(x.dtype), own), dim=1)  # [S, n, r + rope]
        n = lat.shape[1]
        kvh = self.kv_b_proj(lat[..., :r].reshape(s_n * n, r)).view(s_n, n, heads, nope + vd)
        k = torch.cat((kvh[..., :nope], lat[:, :, None, r:].expand(s_n, n, heads, rope)), dim=-1)
        mask = torch.cat((valid, valid.new_ones(s_n, block)), dim=1)[:, None, None, :]  # [S, 1, 1, n]
        o = F.scaled_dot_product_attention(
            q.view(s_n, block, heads, -1).transpose(1, 2),
            k.transpose(1, 2),
            kvh[..., nope:].transpose(1, 2),
            attn_mask=mask,
            scale=self.scale,
        )
        return self.o_proj(o.transpose(1, 2).reshape(t, heads * vd))

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, nope, r] and W_UV [heads, v, r] from kv_b_proj (cached; the weights never change)."""
        w = self.__dict__.get("_w_ukv")
        if w is None or w[0].device != self.kv_b_proj.weight.device:
            c = self.cfg
            kvb = self.kv_b_proj.weight.view(self.heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
            w = self.__dict__["_w_ukv"] = (
                kvb[:, : c.qk_nope_head_dim].contiguous(),
                kvb[:, c.qk_nope_head_dim :].contiguous(),
            )
        return w

    def _forward_paged(self, x: torch.Tensor, positions: torch.Tensor, ctx: PagedContext) -> torch.Tensor:
        """The block's latents into the paged cache at its own slots, then each row one absorbed
        decode query over its sequence's context and block, read in place."""
        c, t, heads = self.cfg, x.shape[0], self.heads
        nope, rope, r = c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        q = self._query(x, positions)
        ctx.cache.index_copy_(0, ctx.slots, self.latent(x, positions).to(ctx.cache.dtype))
        w_uk, w_uv = self._absorbed()
        q_abs = torch.empty(t, heads, r + rope, dtype=x.dtype, device=x.device)
        q_abs[..., r:] = q[..., nope:]
        self.ops.bmm(q[..., :nope].transpose(0, 1), w_uk.to(x.dtype), out=q_abs[..., :r].transpose(0, 1))
        o_lat = self.ops.mla_decode(q_abs, ctx.cache, ctx.tables, ctx.lens, ctx.max_len, ctx.block_size, r, self.scale)
        o = torch.empty(t, heads, c.v_head_dim, dtype=x.dtype, device=x.device)
        self.ops.bmm(o_lat.to(x.dtype).transpose(0, 1), w_uv.to(x.dtype).transpose(1, 2), out=o.transpose(0, 1))
        return self.o_proj(o.reshape(t, heads * c.v_head_dim))
