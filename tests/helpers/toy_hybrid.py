"""A tiny hybrid model for testing the hybrid cache without Kimi Linear / K3 weights.

Two layers with the same cache contracts as the real ones: layer 0 is paged like MLA (each token
writes its embedding into the paged cache; a row reads the mean of its whole context back through
the block table), layer 1 keeps per-sequence state like KDA (a decayed running sum in the
``KDAState.recurrent`` slot and the last two inputs in ``KDAState.conv``). The state layer never
zeroes a slot itself, so a slot the runner fails to zero, a wrong slot, a missed snapshot restore
or a snapshot taken at the wrong token all change the logits. It computes in float64 so that
batching and chunking change nothing beyond float64 rounding (the state is rounded to fp32 after
every token, as stored, so where a chunk ends changes nothing at all).
"""

from __future__ import annotations

import torch
from torch import nn

from kimitui.engine.kv_cache.pool import MLACacheSpec
from kimitui.engine.kv_cache.state import KDAState, KDAStateSpec
from kimitui.engine.layers.attn_metadata import AttentionMetadata, gather_slots

DECAY = 0.9


class ToyHybrid(nn.Module):
    def __init__(self, vocab_size: int = 320, dim: int = 8, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.dim = dim
        # float32 values (then widened): the fp32 paged cache and conv history hold them exactly
        self.embed = nn.Parameter(torch.randn(vocab_size, dim, generator=g).double())
        self.w_attn = nn.Parameter(torch.randn(dim, dim, generator=g, dtype=torch.float64) / dim**0.5)
        self.w_state = nn.Parameter(torch.randn(dim, dim, generator=g, dtype=torch.float64) / dim**0.5)
        self.lm_head = nn.Parameter(torch.randn(dim, vocab_size, generator=g, dtype=torch.float64) * 2)

    def cache_specs(self, dtype: torch.dtype) -> list:
        # recurrent [slots, 1, 1, dim]; conv [slots, dim + 2, 2] of which the first dim channels are used
        return [
            MLACacheSpec(dim=self.dim, dtype=dtype),
            KDAStateSpec(num_heads=1, head_k_dim=1, head_v_dim=self.dim, conv_kernel=3),
        ]

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, caches: list) -> torch.Tensor:
        x = self.embed[input_ids]  # [T, D] float64
        attn = self._paged(x, meta, caches[0])
        state = self._state(x, meta, caches[1])
        h = x + torch.tanh(attn @ self.w_attn) + torch.tanh(state @ self.w_state)
        return h if meta.out_rows is None else h[meta.out_rows]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.lm_head).float()  # [N, V]

    def _paged(self, x: torch.Tensor, meta: AttentionMetadata, cache: torch.Tensor) -> torch.Tensor:
        flat = cache.view(-1, self.dim)
        flat[meta.slot_mapping] = x.to(cache.dtype)
        out = torch.empty_like(x)
        bs = meta.block_size
        for i in range(meta.num_decode_tokens):
            n = int(meta.decode_context_lens[i])
            out[i] = flat[gather_slots(meta.decode_block_tables[i], n, bs)].double().mean(0)
        for c in meta.prefills:
            ctx = flat[gather_slots(c.block_table, c.context_len, bs)].double()  # [context_len, D]
            means = ctx.cumsum(0) / torch.arange(1, c.context_len + 1, dtype=torch.float64)[:, None]
            out[c.start : c.end] = means[c.context_len - (c.end - c.start) :]
        return out

    def _state(self, x: torch.Tensor, meta: AttentionMetadata, state: KDAState) -> torch.Tensor:
        if meta.state_slots is None:
            raise ValueError("ToyHybrid: AttentionMetadata.state_slots is None; the runner gave no state slots")
        slots = meta.state_slots.tolist()
        spans = [(i, i + 1) for i in range(meta.num_decode_tokens)] + [(c.start, c.end) for c in meta.prefills]
        if len(slots) != len(spans):
            raise ValueError(f"ToyHybrid: {len(slots)} state slots for {len(spans)} sequences in the step")
        d = self.dim
        out = torch.empty_like(x)
        for slot, (a, b) in zip(slots, spans):
            r = state.recurrent[slot, 0, 0].double()
            c0, c1 = state.conv[slot, :d, 0].double(), state.conv[slot, :d, 1].double()
            for t in range(a, b):
                r = (DECAY * r + x[t]).float().double()  # fp32 like the stored state, so chunking is exact
                out[t] = r + 0.5 * c1 + 0.25 * c0
                c0, c1 = c1, x[t]
            state.recurrent[slot, 0, 0] = r.float()
            state.conv[slot, :d, 0], state.conv[slot, :d, 1] = c0.float(), c1.float()
        return out
