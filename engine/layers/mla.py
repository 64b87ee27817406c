"""Multi-head latent attention (DeepSeek-V3 / Kimi K2).

The cache holds, per token, the normed latent c_kv [kv_lora_rank] and the roped shared key k_pe
[qk_rope_head_dim]. Prefill chunks expand the latent through kv_b_proj (the "naive" path, cheaper
when many queries share the keys); decodes absorb W_UK into the query and W_UV into the output
(the "absorbed" path, no per-token expansion). Both compute the same function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kimitui.engine.config import ModelConfig
from kimitui.engine.layers.attn_metadata import AttentionMetadata, gather_slots
from kimitui.engine.layers.linear import Linear, fuse_dense_rows
from kimitui.engine.layers.norm import RMSNorm
from kimitui.engine.layers.rope import YarnRotaryEmbedding
from kimitui.engine.parallel.state import SINGLE, ParallelState
from kimitui.kernels.backend import REFERENCE, Backend

# Cached tokens expanded through kv_b_proj at once by a prefill chunk. Beyond this the context goes
# in slices merged by online softmax, so a chunk's live memory is bounded by the slice, not by the
# context: per slice S * H * (2 * nope + v + rope) float32 keys/values (K2, 64 heads, S = 4096:
# about 0.6 GiB) and one [H, n, S] float32 score buffer (2 GiB for a 2048-query chunk). Expanding a
# 128K context whole holds about 13 GiB of keys/values, and its boolean mask sends SDPA to the math
# kernel with [H, n, L] float32 scores.
PREFILL_SLICE = 4096


class MLAttention(nn.Module):
    ops: Backend = REFERENCE  # the model's backend, set when it is loaded
    param_class = "attention"  # for the planner, see engine.registry
    prefill_slice = PREFILL_SLICE  # an instance may set its own (tests use small slices)

    def __init__(
        self,
        config: ModelConfig,
        prefix: str,
        rope: YarnRotaryEmbedding | None,
        par: ParallelState = SINGLE,
        dtype: torch.dtype = torch.float32,
    ):
        """``rope`` None: NoPE (Kimi Linear / K3), the rope dims are plain unrotated content dims."""
        super().__init__()
        c = config
        q = c.quantization
        self.par = par
        if c.num_attention_heads < par.world_size:
            raise ValueError(f"{c.num_attention_heads} attention heads cannot be split over {par.world_size} ranks")
        # Heads split across ranks (unevenly when needed); the latent projections are replicated,
        # so every rank holds the whole latent cache and computes it itself.
        h0, h1 = par.range(c.num_attention_heads)
        self.num_heads = h1 - h0
        self.nope, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.qk_dim = self.nope + self.rope_dim
        self.kv_lora_rank = c.kv_lora_rank
        self.scale = c.softmax_scale
        self.rope = rope
        h = c.num_attention_heads
        norm_eps = c.rms_norm_eps if c.mla_norm_eps is None else c.mla_norm_eps

        def heads(width: int, axis: int = 0):
            return (axis, h0 * width, h1 * width) if par.is_parallel else None

        if c.q_lora_rank is None:
            self.q_proj = Linear(c.hidden_size, h * self.qk_dim, q, f"{prefix}.q_proj", heads(self.qk_dim), dtype)
        else:
            self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, q, f"{prefix}.q_a_proj", dtype=dtype)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, norm_eps, dtype)
            self.q_b_proj = Linear(c.q_lora_rank, h * self.qk_dim, q, f"{prefix}.q_b_proj", heads(self.qk_dim), dtype)
        self.kv_a_proj_with_mqa = Linear(
            c.hidden_size, c.kv_lora_rank + self.rope_dim, q, f"{prefix}.kv_a_proj_with_mqa", dtype=dtype
        )
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, norm_eps, dtype)
        self.kv_b_proj = Linear(
            c.kv_lora_rank, h * (self.nope + self.v_dim), q, f"{prefix}.kv_b_proj", heads(self.nope + self.v_dim), dtype
        )
        # Kimi K3: y = o_proj(sigmoid(g_proj(x)) * attn), a per-channel output gate [T, H * v]
        self.g_proj = (
            Linear(c.hidden_size, h * self.v_dim, q, f"{prefix}.g_proj", heads(self.v_dim), dtype)
            if c.mla_use_output_gate
            else None
        )
        self.o_proj = Linear(h * self.v_dim, c.hidden_size, q, f"{prefix}.o_proj", heads(self.v_dim, axis=1), dtype)
        self.w_uk: torch.Tensor | None = None  # [H, nope, r], set by post_load
        self.w_uv: torch.Tensor | None = None  # [H, v, r]
        # q_a_proj (or q_proj) and kv_a_proj_with_mqa as one weight when dense, set by post_load
        self.register_buffer("in_proj", None, persistent=False)
        # Kimi Linear / K3: a decode step in one call where the backend offers it (Backend.fuse_attention,
        # asked once after loading); None: op by op
        self.fused = None

    def post_load(self) -> None:
        """Split kv_b_proj into the absorbed-path matrices once the weights are in."""
        w = self.kv_b_proj.dense_weight(self._compute_dtype())
        w = w.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        self.w_uk = w[:, : self.nope].contiguous()
        self.w_uv = w[:, self.nope :].contiguous()
        self.in_proj = fuse_dense_rows(self._q_in_proj(), self.kv_a_proj_with_mqa)

    def _compute_dtype(self) -> torch.dtype:
        return self.kv_a_layernorm.weight.dtype

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, cache: torch.Tensor, last: bool = False
    ) -> torch.Tensor:
        # x: [T, D]; cache: [num_blocks, block_size, r + rope]. Every row's latent goes to the
        # cache; in the last layer (``last``) only meta.out_rows, when set, need an output.
        fused = self.fused
        if fused is not None and fused.takes(x, meta):  # the backend's one call (Kimi Linear / K3 decodes)
            return fused(x, meta, cache)
        if (
            meta.decodes_only(x.shape[0])
            and self.rope is not None
            and self.g_proj is None
            and self.ops.mla_decode_fusable(x, cache, self.w_uk, self.w_uv)
        ):
            return self._decode_fused(x, meta, cache)
        qmeta = meta
        if last and meta.out_rows is not None:  # queries for the output rows only
            qmeta = meta.out_meta
            kv = self.kv_a_proj_with_mqa(x)
            x = x.index_select(0, meta.out_rows)
            q_in = self._q_in_proj()(x)
        else:
            q_in, kv = self._project(x)
        t = x.shape[0]
        # every row's normed latent and roped key to its slot; attention then reads them from the cache
        flat = cache.view(-1, cache.shape[-1])
        kv_norm = self.kv_a_layernorm
        if hasattr(self, "q_a_proj") and q_in.shape[0] == kv.shape[0]:
            # the query LoRA's norm rides along with the latent's (one launch on a device)
            q_a = self.ops.mla_cache_write_q_norm(
                q_in,
                self.q_a_layernorm.weight,
                self.q_a_layernorm.eps,
                kv,
                kv_norm.weight,
                kv_norm.eps,
                self.rope,
                meta.positions,
                meta.slot_mapping,
                flat,
            )
            q = self.q_b_proj(q_a)
        else:
            q = self._query(q_in)
            self.ops.mla_cache_write(
                kv, kv_norm.weight, kv_norm.eps, self.rope, meta.positions, meta.slot_mapping, flat
            )
        q = q.view(t, self.num_heads, self.qk_dim)
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope :]
        d = qmeta.num_decode_tokens
        q_abs = None
        if d and d == t:
            # decodes only: the absorbed query [B, H, r + rope] (W_UK product and rope, or NoPE's copy
            # of q_pe) in one call
            q_abs = self.ops.mla_absorb_query(q, self.w_uk, self.rope, qmeta.positions)
        elif self.rope is not None:  # NoPE: q_pe (and k_pe) enter the dot product unrotated
            q_pe = self.ops.mla_rope_query(q_pe, self.rope, qmeta.positions)

        out = torch.empty(t, self.num_heads, self.v_dim, dtype=x.dtype, device=x.device)
        if d:
            self._decode(q_nope[:d], q_pe[:d], qmeta, flat, out[:d], q_abs)
        for chunk in qmeta.prefills:
            s, e = chunk.start, chunk.end
            if e > s:
                out[s:e] = self._prefill(
                    q_nope[s:e], q_pe[s:e], chunk.context_len, chunk.block_table, meta.block_size, flat
                )
        out = out.view(t, -1)
        if self.g_proj is not None:
            out = self.ops.sigmoid_gate(out, self.g_proj(x))  # x: the query rows' normed input
        return self.par.all_reduce(self.o_proj(out))

    def _q_in_proj(self) -> Linear:
        return self.q_proj if hasattr(self, "q_proj") else self.q_a_proj

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The two products of the layer input: (q_proj's or q_a_proj's output, kv_a_proj_with_mqa's)."""
        if self.in_proj is None:
            return self._q_in_proj()(x), self.kv_a_proj_with_mqa(x)
        y = self.ops.linear(x, self.in_proj)
        n = self._q_in_proj().out_features
        return y[:, :n], y[:, n:]

    def _query(self, q_in: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return q_in
        return self.q_b_proj(self.q_a_layernorm(q_in))

    def _decode_fused(self, x, meta: AttentionMetadata, cache):
        # Decodes only, where the backend can: everything between the projections (the kv norm, rope,
        # cache write, W_UK, attention, W_UV) is one call instead of ~40 small operations.
        t = x.shape[0]
        q_in, kv = self._project(x)
        q = self._query(q_in).view(t, self.num_heads, self.qk_dim)
        out = self.ops.mla_decode_absorbed(
            q,
            kv,
            self.kv_a_layernorm.weight,
            self.kv_a_layernorm.eps,
            self.rope.cos,
            self.rope.sin,
            meta.positions,
            meta.slot_mapping,
            self.w_uk,
            self.w_uv,
            cache.view(-1, cache.shape[-1]),
            meta.decode_block_tables,
            meta.decode_context_lens,
            meta.block_size,
            self.scale,
        )
        return self.par.all_reduce(self.o_proj(out.view(t, -1)))

    def _prefill(self, q_nope, q_pe, context_len, block_table, block_size, flat):
        # Naive path for one sequence's chunk of n queries over context_len cached tokens.
        if context_len > self.prefill_slice:
            return self._prefill_sliced(q_nope, q_pe, context_len, block_table, block_size, flat)
        n = q_nope.shape[0]
        # index_select copies whole rows: several times faster than advanced indexing on CPU
        lat = flat.index_select(0, gather_slots(block_table, context_len, block_size)).to(q_nope.dtype)  # [L, r+rope]
        kv = self.kv_b_proj(lat[:, : self.kv_lora_rank]).view(context_len, self.num_heads, -1)
        k_nope, v = kv[..., : self.nope], kv[..., self.nope :]
        k_pe = lat[:, None, self.kv_lora_rank :].expand(-1, self.num_heads, -1)
        # One head size for q, k and v (the narrower side padded with zeros, which adds nothing to a
        # dot product) and 4-d inputs: SDPA then takes its flash kernel (on a CPU 1.9x faster at 256
        # tokens than the unfused product it falls back to for a 64-wide v), and with no cached
        # context the causal form that skips the masked half (4x at 2048 tokens).
        width = max(self.qk_dim, self.v_dim)
        q = _pad_heads(torch.cat([q_nope, q_pe], dim=-1), width)  # [1, H, n, width]
        k = _pad_heads(torch.cat([k_nope, k_pe], dim=-1), width)  # [1, H, L, width]
        v = _pad_heads(v, width)
        if context_len == n:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            # Query i sits at position context_len - n + i and sees keys at positions <= its own.
            qpos = torch.arange(context_len - n, context_len, device=q.device)
            mask = torch.arange(context_len, device=q.device)[None, :] <= qpos[:, None]  # [n, L]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return o[0, ..., : self.v_dim].transpose(0, 1)  # [n, H, v]

    def _prefill_sliced(self, q_nope, q_pe, context_len, block_table, block_size, flat):
        """The naive path over a context longer than ``prefill_slice``: the context goes through
        kv_b_proj ``prefill_slice`` tokens at a time and each slice's softmax is merged into a running
        one (online softmax, as in FlashAttention: Dao et al. 2022, arXiv:2205.14135), so nothing of
        context length is ever live but the slot indices. Scores and sums are float32. -> [n, H, v]"""
        n, dtype, size = q_nope.shape[0], q_nope.dtype, self.prefill_slice
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1).float()  # [H, n, qk]
        qpos = torch.arange(context_len - n, context_len, device=q.device)  # query i's position
        # Slice 0 holds position 0, which every query sees, so the running max is finite from then on.
        m = l = acc = None  # running max [H, n], sum of exp [H, n], unnormalised output [H, n, v]
        for a in range(0, context_len, size):
            b = min(a + size, context_len)
            s, v = self._slice_scores(q, a, b, block_table, block_size, flat, dtype)  # [H, n, S], [H, S, v]
            if b - 1 > context_len - n:  # keys past the first query's position: the causal edge
                s.masked_fill_(torch.arange(a, b, device=q.device)[None, :] > qpos[:, None], float("-inf"))
            m_new = s.amax(-1) if m is None else torch.maximum(m, s.amax(-1))
            p = s.sub_(m_new[..., None]).exp_()  # in place: one [H, n, S] buffer per slice
            pv = torch.bmm(p, v)
            if m is None:
                l, acc = p.sum(-1), pv
            else:
                alpha = torch.exp(m - m_new)
                l = l * alpha + p.sum(-1)
                acc = acc * alpha[..., None] + pv
            m = m_new
            del s, v, p, pv  # free this slice before the next one is made: one slice live, not two
        return (acc / l[..., None]).transpose(0, 1).to(dtype)

    def _slice_scores(self, q, a, b, block_table, block_size, flat, dtype):
        """Scaled scores of q [H, n, qk] (float32) against cached positions a..b-1 of one sequence,
        and those positions' values; kv_b_proj runs in ``dtype`` (the queries' dtype, as in the
        unsliced path). -> ([H, n, b - a], [H, b - a, v]) float32"""
        pos = torch.arange(a, b, device=block_table.device)
        slots = block_table[pos // block_size].long() * block_size + pos % block_size
        lat = flat.index_select(0, slots).to(dtype)  # [S, r + rope]
        kv = self.kv_b_proj(lat[:, : self.kv_lora_rank]).view(b - a, self.num_heads, -1).float()
        k_pe = lat[:, None, self.kv_lora_rank :].float().expand(-1, self.num_heads, -1)
        k = torch.cat([kv[..., : self.nope], k_pe], dim=-1).transpose(0, 1)  # [H, S, qk]
        return torch.bmm(q, k.transpose(1, 2)).mul_(self.scale), kv[..., self.nope :].transpose(0, 1)

    def _decode(self, q_nope, q_pe, meta: AttentionMetadata, flat, out, q=None):
        """Absorbed path, one query per sequence, batched over sequences: writes ``out [B, H, v]``.
        ``q``: None (built here from ``q_nope`` and the roped ``q_pe``), or the absorbed query
        ``[B, H, r + rope]`` already made."""
        dtype = q_nope.dtype
        r = self.kv_lora_rank
        if q is None:
            q = torch.empty(q_nope.shape[0], self.num_heads, r + self.rope_dim, dtype=dtype, device=q_nope.device)
            q[..., r:] = q_pe
            # W_UK folded into the query, head-major bmm [H, B, nope] @ [H, nope, r] -> [H, B, r], written
            # into the head of q through a transposed view (cuBLAS/hipBLAS take its row stride as is)
            self.ops.bmm(q_nope.transpose(0, 1), self.w_uk.to(dtype), out=q[..., :r].transpose(0, 1))
        o_lat = self.ops.mla_decode(
            q,
            flat,
            meta.decode_block_tables,
            meta.decode_context_lens,
            meta.decode_max_context_len,
            meta.block_size,
            r,
            self.scale,
        )
        # W_UV per head, [H, B, r] @ [H, r, v] -> [H, B, v], straight into the caller's [B, H, v] rows
        self.ops.bmm(o_lat.transpose(0, 1), self.w_uv.to(dtype).transpose(1, 2), out=out.transpose(0, 1))


def _pad_heads(x: torch.Tensor, width: int) -> torch.Tensor:
    """[T, H, d] -> [1, H, T, width], zero-padded on the right."""
    x = x.transpose(0, 1)
    return (F.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x)[None]
