"""One interface per compute operation, and the choice of its implementation, made once per model.

A layer holds a ``Backend`` in its ``ops`` attribute and calls ``self.ops.linear(x, w)``,
``self.ops.moe_experts(...)`` and so on; it never asks which backend it is on. The model picks the
backend when its weights are in (``select_backend(device, dtype, settings)``) and hands the same
object to every layer (``DeepseekV3ForCausalLM.post_load``); a layer built on its own keeps
``REFERENCE`` until someone sets its ``ops``.

This base class is the reference backend: every operation is the PyTorch oracle of
``kernels.reference`` and runs on whatever device its tensors are on. ``CpuBackend``
(``kernels.cpu_backend``: the C++ few-row kernels and BLAS-shaped PyTorch paths) and
``TritonBackend`` (``kernels.triton_backend``: CUDA/ROCm, or CPU tensors under the Triton
interpreter) override what they do better. Operations a backend cannot run fused answer "no"
(``mla_decode_fusable``, ``fuse_decoder_layer``) and the layer runs op by op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kimitui.kernels import kda, reference


def written_rows(slots: torch.Tensor) -> torch.Tensor | None:
    """The rows of ``slots`` [N] that name a real cache / state slot, or None when all do. A negative
    slot (-1, vLLM's ``PAD_SLOT_ID``) is a decode graph's padding row, which writes nothing
    (engine/runner/graph_padding.py). The Triton kernels skip such rows themselves; the PyTorch and C++ CPU
    paths drop them with this. A CPU tensor is read through numpy: no device, so no sync, and no op a
    step's launch / sync count would see; on a device only the reference backend gets here (and syncs)."""
    if slots.device.type == "meta":  # a dry run (no values): the memory is the same either way
        return None
    if slots.device.type == "cpu":
        host = slots.numpy()
        if not host.size or host.min() >= 0:
            return None
        return torch.from_numpy((host >= 0).nonzero()[0])
    keep = slots >= 0
    if bool(keep.all()):
        return None
    return keep.nonzero()[:, 0]


class Backend:
    """The PyTorch reference for every operation (the oracle the other backends are tested against)."""

    name = "reference"

    # -- linear layers: x [..., K] -> [..., N] in x.dtype

    def linear(self, x, w):
        """``x [..., K] @ w [N, K].T -> [..., N]`` for a dense weight."""
        return F.linear(x, w)

    def linear_fp8_block(self, x, w, scale_inv, block=(128, 128)):
        """``x [..., K] @ dequant(w [N, K] fp8 e4m3fn, scale_inv).T -> [..., N]`` in x.dtype."""
        return reference.linear_fp8_block(x, w, scale_inv, block)

    def linear_w4a16(self, x, packed, scale, k, group_size=32):
        """``x [..., K] @ dequant_int4(packed [N, ceil(K/8)], scale [N, ceil(K/g)]).T -> [..., N]``."""
        _check_int4_k(x, k)
        return reference.linear_w4a16(x, packed, scale, k, group_size)

    def linear_mxfp4(self, x, packed, scale):
        """``x [..., K] @ dequant_mxfp4(packed [N, K/2], scale [N, K/32]).T -> [..., N]``."""
        return reference.linear_mxfp4(x, packed, scale)

    def bmm(self, a, b, out=None):
        """``torch.bmm(a [n, i, k], b [n, k, j]) -> [n, i, j]``, into ``out`` when given (the MLA
        absorbed products with W_UK and W_UV)."""
        return torch.bmm(a, b, out=out)

    def gated_act(self, gu, act):
        """``act(gu[..., :I], gu[..., I:])`` for the fused gate/up product ``gu [..., 2I]`` of a dense
        MLP; ``act``: its ``engine.layers.activation.GatedActivation``. -> [..., I] in gu.dtype"""
        i = gu.shape[-1] // 2
        return act(gu[..., :i], gu[..., i:])

    # -- norms and routing

    def rms_norm(self, x, weight, eps=1e-6):
        """HF RMSNorm over the last dim of ``x [..., H]``."""
        return reference.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps=1e-6):
        """A residual add and the norm after it: ``(rms_norm(x + residual) * weight, x + residual)``
        for ``x, residual [T, H]``; the sum rounds to x.dtype before the norm (HF order). ``x`` must be
        a fresh tensor the caller gives up: it may hold the sum (here it does, in place: on a CPU each
        new prefill-sized tensor costs more in page faults than the addition itself)."""
        s = x.add_(residual)
        return self.rms_norm(s, weight, eps), s

    def add_rms_norm_fp32(self, x, residual, weight, eps=1e-6):
        """``add_rms_norm`` and an fp32 copy of its normalised output (exact: ``out.float()``; the
        output itself when it is fp32): ``(out, x + residual, out32)``. The MoE router's input, which
        the router would otherwise cast in a launch of its own."""
        out, s = self.add_rms_norm(x, residual, weight, eps)
        return out, s, out.float()

    def moe_route(
        self,
        x,
        weight,
        bias,
        top_k,
        n_group=1,
        topk_group=1,
        scoring_func="sigmoid",
        norm_topk_prob=True,
        scaling=1.0,
        counts=None,
        weights_dtype=None,
        count_rows=None,
    ):
        """DeepSeek-V3 router: x [T, D], weight [E, D], bias [E] -> (topk_ids [T, k] int64,
        topk_weights [T, k] computed in fp32, rounded to ``weights_dtype`` when given). ``counts``: None,
        or the int64 [E] routing statistics, to which each chosen expert adds one; ``count_rows``: None,
        or an integer [>= T] tensor, 0 for the rows that must not count (``count_routing``)."""
        ids, weights = reference.moe_route(
            x, weight, bias, top_k, n_group, topk_group, scoring_func, norm_topk_prob, scaling
        )
        count_routing(counts, ids, count_rows)
        return ids, weights if weights_dtype is None else weights.to(weights_dtype)

    # -- routed experts: x [T, D], topk [T, k] -> [T, D]; an id == E adds nothing. ``activation``: the
    # experts' gated activation (kernels.activation.GatedActivation; None: SiLU, i.e. SwiGLU)

    # the GatedActivation kinds every moe_experts* op of this backend computes; a model whose experts
    # use another is refused when it is loaded (RoutedExperts.post_load), never run with the wrong one
    expert_activations = ("silu", "situ")

    def moe_experts(self, x, topk_ids, topk_weights, w13, w2, activation=None):
        """Dense experts: w13 [E, 2I, D] (gate rows, then up), w2 [E, D, I]."""
        return reference.moe_experts_reference(x, topk_ids, topk_weights, w13, w2, activation)

    def moe_experts_w4a16(
        self, x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size=32, activation=None
    ):
        """INT4 experts (w13_packed [E, 2I, D/8], scales [E, 2I, D/g]; w2 likewise)."""
        return reference.moe_experts_reference_w4a16(
            x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, group_size, activation
        )

    def moe_experts_mxfp4(self, x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, activation=None):
        """MXFP4 experts (w13_packed [E, 2I, D/2], w13_scale [E, 2I, D/32]; w2 likewise)."""
        return reference.moe_experts_reference_mxfp4(
            x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, activation
        )

    def moe_experts_fp8(
        self, x, topk_ids, topk_weights, w13, w13_scale_inv, w2, w2_scale_inv, block=(128, 128), activation=None
    ):
        """Block-FP8 experts (w13 [E, 2I, D] e4m3fn + scale_inv [E, 2I/bn, D/bk]; w2 likewise)."""
        return reference.moe_experts_reference_fp8(
            x, topk_ids, topk_weights, w13, w13_scale_inv, w2, w2_scale_inv, block, activation
        )

    def prepack_int4_experts(self, w13_packed, w13_scale, w2_packed, w2_scale, group_size, dtype):
        """INT4 experts (as ``moe_experts_w4a16`` takes them) converted once, after loading, to the
        layout ``moe_experts_int4pack_cpu`` reads for activations of ``dtype``: (w13, w13_sz, w2,
        w2_sz), or None where this backend has no such layout for them (then they stay as they are)."""
        return None

    def moe_experts_int4pack_cpu(self, x, topk_ids, topk_weights, w13, w13_sz, w2, w2_sz, group_size, activation=None):
        """INT4 experts in torch's CPU int4 layout (from ``prepack_int4_experts``)."""
        raise ValueError(f"the {self.name} backend does not run experts prepacked for the CPU int4 GEMM")

    def prepare_quant_experts(self, fmt, w13_packed, w13_scale, w2_packed, w2_scale, group_size):
        """INT4 / MXFP4 experts (as ``moe_experts_w4a16`` / ``_mxfp4`` take them) converted once, after
        loading, to the tiles ``moe_experts_tiled`` streams: (w13_tiles, w2_tiles), each [E, bytes], or
        None where this backend has no such layout for them (then they stay as they are)."""
        return None

    def moe_experts_tiled(self, x, topk_ids, topk_weights, fmt, w13_tiles, w2_tiles, inter, activation=None):
        """Experts in the tile layout of ``prepare_quant_experts`` (``inter``: the expert width)."""
        raise ValueError(f"the {self.name} backend does not run experts in the CPU tile layout")

    # -- MLA decode over the paged latent cache

    def mla_decode(self, q, cache, block_tables, context_lens, max_context_len, block_size, kv_lora_rank, scale):
        """q [B, H, r + rope], cache [slots, r + rope], block_tables [B, max_blocks] int32,
        context_lens [B] int32 -> [B, H, r] in q.dtype."""
        return reference.mla_decode_reference(
            q, cache, block_tables, context_lens, max_context_len, block_size, kv_lora_rank, scale
        )

    def mla_rope_query(self, q_pe, rope, positions, out=None):
        """YaRN rope of the query heads' rope channels ``q_pe [T, H, R]`` (a strided view is fine) by
        ``positions [T]``; ``rope``: the model's ``YarnRotaryEmbedding`` (cos/sin caches). ``out``: None,
        or a [T, H, R] view (last dim contiguous) to write into. -> [T, H, R] (``out`` when given)"""
        q = rope(q_pe, positions)
        return q if out is None else out.copy_(q)

    def mla_absorb_query(self, q, w_uk, rope, positions):
        """The absorbed decode query ``[q_nope @ W_UK[h], rope(q_pe)]`` per head -> [B, H, r + R], for
        ``q [B, H, nope + R]`` (q_b_proj's output), ``w_uk [H, nope, r]``, ``rope`` the model's
        ``YarnRotaryEmbedding``, or None (NoPE: the tail is q_pe as it is). The rope writes the tail and
        the bmm the head of one buffer (no cat)."""
        b, h, width = q.shape
        nope, r = w_uk.shape[1], w_uk.shape[2]
        out = torch.empty(b, h, r + width - nope, dtype=q.dtype, device=q.device)
        if rope is None:
            out[..., r:] = q[..., nope:]
        else:
            self.mla_rope_query(q[..., nope:], rope, positions, out=out[..., r:])
        # head-major [H, B, nope] @ [H, nope, r] into a transposed view of the head: BLAS takes its row
        # stride as is (cuBLAS/hipBLAS batched GEMMs included, no copy)
        self.bmm(q[..., :nope].transpose(0, 1), w_uk.to(q.dtype), out=out[..., :r].transpose(0, 1))
        return out

    def mla_cache_write(self, kv, norm_weight, eps, rope, positions, slot_mapping, cache):
        """Write the newest latents to the flat cache ``[slots, r + R]`` in place: row ``slot_mapping[t]``
        gets ``[rms_norm(kv[t, :r]) * norm_weight, rope(kv[t, r:])]`` cast to the cache dtype, for
        ``kv [T, r + R]`` (kv_a_proj_with_mqa's output). ``rope`` None: NoPE, the key is written unrotated."""
        r = norm_weight.shape[0]
        c_kv = self.rms_norm(kv[:, :r], norm_weight, eps)
        k_pe = kv[:, r:] if rope is None else rope(kv[:, None, r:], positions)[:, 0]
        rows = written_rows(slot_mapping)
        new = torch.cat([c_kv, k_pe], dim=-1).to(cache.dtype)
        if rows is None:
            cache.index_copy_(0, slot_mapping, new)
        else:  # a decode graph's padding rows (slot -1) write nothing
            cache.index_copy_(0, slot_mapping[rows], new[rows])

    def mla_cache_write_q_norm(
        self, q, q_norm_weight, q_eps, kv, norm_weight, eps, rope, positions, slot_mapping, cache
    ):
        """``mla_cache_write`` and the query LoRA's norm ``rms_norm(q) * q_norm_weight`` of ``q [T, Q]``
        (q_a_proj's output, the other part of the same projection) in one call -> the normed q."""
        self.mla_cache_write(kv, norm_weight, eps, rope, positions, slot_mapping, cache)
        return self.rms_norm(q, q_norm_weight, q_eps)

    def mla_decode_fusable(self, x, cache, w_uk, w_uv) -> bool:
        """Whether a decode-only MLA step on ``x [B, D]`` can run as one ``mla_decode_absorbed`` call."""
        return False

    def mla_decode_absorbed(
        self,
        q,
        kv,
        kv_norm_weight,
        eps,
        cos,
        sin,
        positions,
        slots,
        w_uk,
        w_uv,
        cache,
        block_tables,
        context_lens,
        block_size,
        scale,
    ):
        """Norm, rope and cache write of the newest latents, W_UK absorption, attention over the paged
        cache and W_UV in one call, where ``mla_decode_fusable`` holds -> [B, H, v]."""
        raise ValueError(f"the {self.name} backend has no fused MLA decode (mla_decode_fusable is False)")

    # -- Kimi Delta Attention (shapes and meaning: kernels/kda.py; oracle: reference.kda_recurrence_reference)

    def kda_chunk(self, q, k, v, g, beta, initial_state, cu_seqlens, scale):
        """Prefill of packed sequences from their states: (o [T, H, V], final_state [N, H, K, V] fp32)."""
        return kda.chunk_kda(q, k, v, g, beta, initial_state, cu_seqlens, scale)

    def kda_recurrent(self, q, k, v, g, beta, state, slots, scale):
        """One decode token per sequence; ``state[slots]`` is updated in place. -> o [N, H, V]"""
        return kda.recurrent_kda(q, k, v, g, beta, state, slots, scale)

    def kda_recurrent_spec(self, q, k, v, g, beta, state, indices, lengths, scale):
        """Speculative verification of N sequences of ``lengths`` rows: start from pool row
        ``indices[n, lengths[n] - 1]``, keep the state after position t in row ``indices[n, t]``."""
        return kda.recurrent_kda_spec(q, k, v, g, beta, state, indices, lengths, scale)

    def causal_conv1d(self, x, weight, history, cu_seqlens=None):
        """Short causal conv + SiLU continuing each sequence's history: (y [T, C], new history [N, C, W-1])."""
        return kda.causal_conv1d(x, weight, history, cu_seqlens)

    def kda_decode(
        self,
        qkv,
        f_b,
        b,
        gate,
        conv_weight,
        A_log,
        dt_bias,
        lower_bound,
        norm_weight,
        eps,
        conv_state,
        rec_state,
        slots,
        scale,
    ):
        """A whole KDA decode step between the projections, one token for each of N sequences: the
        short conv + SiLU from each slot's history, the forget gate from ``f_b + dt_bias`` and
        ``A_log`` (``kernels.kda.kda_gate``), beta = sigmoid(b), the delta-rule step on
        ``rec_state[slots]`` and the output's RMSNorm gated by sigmoid(gate). ``qkv [N, 3P]``,
        ``f_b, gate [N, P]``, ``b [N, H]``, ``conv_weight [3P, W]``, ``A_log [H]``, ``dt_bias [P]``,
        ``norm_weight [D]``; both states updated in place. -> [N, P] in qkv.dtype (o_proj's input)"""
        n, h, d = qkv.shape[0], A_log.shape[0], norm_weight.shape[0]
        rows = written_rows(slots)
        if rows is not None:  # a decode graph's padding rows (slot -1): zeros, no state read or written
            out = qkv.new_zeros(n, h * d)
            if rows.numel():
                out[rows] = self.kda_decode(
                    qkv[rows],
                    f_b[rows],
                    b[rows],
                    gate[rows],
                    conv_weight,
                    A_log,
                    dt_bias,
                    lower_bound,
                    norm_weight,
                    eps,
                    conv_state,
                    rec_state,
                    slots[rows],
                    scale,
                )
            return out
        g = kda.kda_gate((f_b.float() + dt_bias).view(n, h, d), A_log, lower_bound)
        beta = torch.sigmoid(b.float())
        y, hist = self.causal_conv1d(qkv, conv_weight, conv_state.index_select(0, slots))
        conv_state.index_copy_(0, slots, hist)
        q, k, v = (t.view(n, h, d) for t in y.split(h * d, dim=-1))
        o = self.kda_recurrent(q, k, v, g, beta, rec_state, slots, scale)
        return kda.gated_rms_norm(o, gate.view(n, h, d), norm_weight, eps).to(qkv.dtype).view(n, h * d)

    def sigmoid_gate(self, x, gate):
        """``x * sigmoid(gate)`` for ``x, gate [T, N]`` (MLA's output gate in Kimi K3)."""
        return x * torch.sigmoid(gate)

    # -- Kimi K3 attention residuals (engine/layers/attn_res.py)

    def attn_res_mix_norm(
        self, x, blocks, n, res_norm_weight, res_eps, proj_weight, norm_weight, norm_eps, delta=None, save=False
    ):
        """``(rms_norm(mix(s, blocks[:n])) * norm_weight, s)``: s = x + delta (x when delta is None), the
        AttnRes softmax mix of the candidates ``blocks[:n] + [s]`` (``reference.attn_res_mix``; s itself
        when n is 0), the norm of the sublayer after it. ``save``: also write s to ``blocks[n]`` (the
        snapshot that begins a block). ``x``, ``delta [T, D]``; ``blocks [>= n, T, D]`` in x.dtype."""
        s = x if delta is None else x + delta
        if save:
            blocks[n].copy_(s)
        h = reference.attn_res_mix(s, list(blocks[:n]), res_norm_weight, res_eps, proj_weight) if n else s
        return self.rms_norm(h, norm_weight, norm_eps), s

    # -- whole decoder halves

    def fuse_decoder_layer(self, layer):
        """An object whose ``attention(x, meta, cache)`` and ``ffn(x)`` run each residual half of
        ``layer`` in one call for the steps ``fusable(x, meta)`` accepts, or None (run op by op).
        Asked once per layer, after loading."""
        return None

    def fuse_latent_moe(self, moe):
        """A callable with ``takes(x)`` running a Kimi Linear / K3 ``KimiMoE`` (normed rows in, its
        output out) in one call, or None (run op by op). Asked once per layer, after loading."""
        return None

    def fuse_attention(self, attn):
        """A callable with ``takes(x, meta, cache)`` running a Kimi Linear / K3 attention layer (an
        ``MLAttention`` or ``KimiDeltaAttention``: normed rows in, its output out, the cache or state
        written) for a decode step in one call, or None (run op by op). Asked once per layer, after
        loading."""
        return None

    def run_fused_layers(self, fused: list, x: torch.Tensor, meta, caches: list[torch.Tensor]):
        """Every decoder layer of a step through its ``fuse_decoder_layer`` object's halves in one loop:
        the hidden state after the last layer, or None (the layers then run one by one, as always
        without this)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def count_routing(counts: torch.Tensor | None, ids: torch.Tensor, count_rows: torch.Tensor | None = None) -> None:
    """Add one to ``counts [E]`` per routed (token, expert) pair of ``ids [T, k]`` (None: nothing).
    ``count_rows``: None, or an integer [>= T] tensor whose row t, when 0, keeps token t out (a decode
    graph's padding rows and its capture warm-ups, engine/runner/graphs.py). index_add_ rather than
    bincount, which syncs with the host on a device to size its output."""
    if counts is None:
        return
    flat = ids.reshape(-1)
    if count_rows is None:
        counts.index_add_(0, flat, torch.ones_like(flat, dtype=counts.dtype))
        return
    t, k = ids.shape
    # expand + reshape (a copy), not repeat_interleave, which asks the host for its output size
    counts.index_add_(0, flat, (count_rows[:t] != 0).to(counts.dtype)[:, None].expand(t, k).reshape(-1))


REFERENCE = Backend()  # stateless: the default of a layer nobody has handed a backend yet


def _check_int4_k(x, k):
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the INT4 weight has {k}")
