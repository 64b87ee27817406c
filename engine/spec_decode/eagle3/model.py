"""The EAGLE-3 drafter: one decoder layer over the target's hidden states.

``architectures`` picks the layer's attention: Llama-style (``LlamaForCausalLMEagle3``,
``Eagle3LlamaForCausalLM``: SpecForge, AQ-MedAI's and the torchspec Kimi K2.x drafters) or DeepSeek's
MLA (``Eagle3DeepseekV2ForCausalLM`` / ``Eagle3DeepseekV3ForCausalLM``: lightseekorg/kimi-k2.6-eagle3-mla,
nvidia/Kimi-K2.6-Eagle3; see eagle3_mla.py). Any other value is an error before a weight is read.
EAGLE-3.1 configs add ``fc_norm`` (an RMSNorm over each aux chunk before ``fc``, ``fc_norm.<i>.weight``)
and ``norm_output`` (the chain feeds back the normed output, not the pre-norm one), as vLLM reads them.
The checkpoints hold:

- ``fc``: [hidden, n_aux * target_hidden], folding the hidden states of three target layers
  (``eagle_config.eagle_aux_hidden_state_layer_ids``, default ``(2, L // 2, L - 3)``) into one;
- one decoder layer (``layers.0.*``, or ``midlayer.*`` in SpecForge exports, with or without a
  ``model.`` prefix) whose attention reads ``cat(input_layernorm(token embedding),
  hidden_norm(hidden))``, 2 x hidden wide, then the usual SiLU MLP;
- ``norm`` and ``lm_head`` over a reduced ``draft_vocab_size``, with ``d2t`` (target id = draft id +
  d2t[draft id]) and ``t2d`` (target-side membership, unused here, as in vLLM);
- optionally ``embed_tokens`` and ``lm_head`` (full vocabulary); without them the drafter shares the
  target's.

Which target layers feed ``fc``: vLLM reads id k as the hidden state *entering* layer k; SGLang and
DSpark's trainers as layer k's *output* (the state entering k + 1). Drafter configs do not say
which, so the reading is ``speculative_config``'s ``eagle_aux_hidden_state_layer_convention``
(``input`` by default, vLLM's, with a warning naming it). Ids come from ``speculative_config``'s
``eagle_aux_hidden_state_layer_ids``, else ``eagle_config``'s, else the config's top level, else the
``(2, L // 2, L - 3)`` default.

The forward follows vLLM's ``model_executor/models/llama_eagle3.py``: ``norm_before_residual``
decides whether the residual is the hidden state before or after ``hidden_norm``, and the layer
returns both the normed output (for the logits) and the pre-norm one, which is what the next chain
step feeds back as its hidden state.

The drafter's KV cache is its own paged tensor ``[num_blocks, block_size, 2, kv_heads, head_dim]``
addressed by the target's block tables and positions, so it needs no allocator of its own: a
position the target holds a slot for is a position the drafter may write. Attention gathers the
cache by block table in plain PyTorch, which runs on any device.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kimitui.engine.config import RopeScaling, yarn_get_mscale
from kimitui.engine.layers.attn_metadata import PrefillChunk
from kimitui.engine.layers.embedding import VocabEmbedding
from kimitui.engine.layers.linear import Linear
from kimitui.engine.layers.norm import RMSNorm
from kimitui.engine.layers.rope import yarn_inv_freq
from kimitui.engine.spec_decode.eagle3.mla import Eagle3MLAAttention, MLAShape

log = logging.getLogger(__name__)

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
LLAMA_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
MLA_ARCHS = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")


def drafter_architecture(d: dict) -> str:
    """``llama`` or ``mla`` from a drafter config's ``architectures`` (absent: by its keys)."""
    archs = d.get("architectures")
    if not archs:
        return "mla" if d.get("kv_lora_rank") else "llama"
    known = [a for a in archs if a in LLAMA_ARCHS + MLA_ARCHS]
    if not known:
        raise ValueError(
            f"eagle3 drafter config: architectures {archs} not supported "
            f"(supported: {', '.join(LLAMA_ARCHS + MLA_ARCHS)})"
        )
    return "mla" if known[0] in MLA_ARCHS else "llama"


def aux_layer_ids(d: dict, target_layers: int, override=None, convention: str | None = None) -> tuple[int, ...]:
    """The target capture ids (hidden state entering layer k, as the target keeps them) of a drafter
    config ``d``; see the module docstring for the precedence and the two readings."""
    nested = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = d.get("eagle_aux_hidden_state_layer_ids")
    if nested is not None and top is not None and list(nested) != list(top):
        raise ValueError(
            f"eagle3 drafter config: eagle_config.eagle_aux_hidden_state_layer_ids {list(nested)} and "
            f"the top-level eagle_aux_hidden_state_layer_ids {list(top)} disagree"
        )
    given = override if override is not None else nested if nested is not None else top
    if given is None:  # the default is defined in vLLM's reading
        return default_aux_layer_ids(target_layers)
    ids = tuple(int(k) for k in given)
    if convention is None:
        log.warning(
            "eagle3 drafter: aux layer ids %s read as layer inputs (vLLM's convention: the hidden state "
            "entering layer k); for a drafter trained on layer outputs (SGLang, DSpark) set "
            "speculative_config eagle_aux_hidden_state_layer_convention 'output'",
            list(ids),
        )
    elif convention == "output":
        ids = tuple(k + 1 for k in ids)
    if len(set(ids)) != len(ids) or not all(0 <= k <= target_layers for k in ids):
        raise ValueError(
            f"eagle3 drafter config: aux hidden state layer ids {list(given)} ({convention or 'input'} "
            f"convention) must be distinct and in 0..{target_layers} for a {target_layers}-layer target"
        )
    return ids


def default_aux_layer_ids(target_layers: int) -> tuple[int, ...]:
    """vLLM's and SpecForge's default: early, middle and late layers of an L-layer target."""
    return (2, target_layers // 2, target_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    norm_before_residual: bool
    aux_layer_ids: tuple[int, ...]  # ascending capture ids (state entering layer k), the target's order
    attention_bias: bool = False
    mla: MLAShape | None = None  # the MLA attention's shape (Eagle3DeepseekV2ForCausalLM), None: Llama-style
    fc_norm: bool = False  # EAGLE-3.1: an RMSNorm over each aux chunk before fc
    norm_output: bool = False  # EAGLE-3.1: the chain feeds back the normed output

    @classmethod
    def from_dict(
        cls,
        d: dict,
        target_layers: int,
        target_hidden_size: int,
        target_vocab_size: int,
        aux_override=None,
        aux_convention: str | None = None,
    ) -> Eagle3Config:
        """From a drafter's config.json, checked against the target (layers, hidden size, vocabulary).
        ``aux_override`` / ``aux_convention``: speculative_config's layer ids and their reading."""

        def need(key):
            if key not in d:
                raise ValueError(f"eagle3 drafter config: missing {key!r}")
            return d[key]

        arch = drafter_architecture(d)
        if d.get("num_hidden_layers", 1) != 1:
            raise ValueError(
                f"eagle3 drafter config: num_hidden_layers must be 1 (one EAGLE-3 layer), got {d['num_hidden_layers']}"
            )
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"eagle3 drafter config: hidden_act must be 'silu', got {d['hidden_act']!r}")
        eagle = d.get("eagle_config") or {}
        if eagle.get("use_aux_hidden_state", True) is False:
            raise ValueError("eagle3 drafter config: use_aux_hidden_state false (EAGLE-1 style input) is not supported")
        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kv_heads = int(d.get("num_key_value_heads") or heads)
        head_dim = int(d.get("head_dim") or hidden // heads)
        if heads % kv_heads and arch == "llama":
            raise ValueError(
                f"eagle3 drafter config: num_attention_heads ({heads}) must be a multiple of "
                f"num_key_value_heads ({kv_heads})"
            )
        vocab = int(d.get("vocab_size") or target_vocab_size)
        if vocab != target_vocab_size:
            raise ValueError(f"eagle3 drafter config: vocab_size {vocab} differs from the target's {target_vocab_size}")
        draft_vocab = int(d.get("draft_vocab_size") or vocab)
        if not 1 <= draft_vocab <= vocab:
            raise ValueError(f"eagle3 drafter config: draft_vocab_size must be in 1..{vocab}, got {draft_vocab}")
        target_hidden = int(d.get("target_hidden_size") or hidden)
        if target_hidden != target_hidden_size:
            raise ValueError(
                f"eagle3 drafter config: target_hidden_size {target_hidden} differs from the "
                f"target's hidden_size {target_hidden_size}"
            )
        ids = aux_layer_ids(d, target_layers, aux_override, aux_convention)
        mla = MLAShape.from_dict(d) if arch == "mla" else None
        scaling = d.get("rope_scaling")
        if scaling is not None and mla is None:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ROPE_TYPES:
                raise ValueError(
                    f"eagle3 drafter config: rope_scaling type {kind!r} is not supported ({', '.join(ROPE_TYPES)})"
                )
            scaling = None if kind == "default" else {**scaling, "rope_type": kind}
        elif mla is not None:
            scaling = None  # the MLA attention keeps its own (DeepSeek YaRN) rope
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int(need("intermediate_size")),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            vocab_size=vocab,
            draft_vocab_size=draft_vocab,
            target_hidden_size=target_hidden,
            norm_before_residual=bool(d.get("norm_before_residual", False)),
            aux_layer_ids=tuple(sorted(ids)),
            attention_bias=bool(d.get("attention_bias", False) or d.get("qkv_bias", False)),
            mla=mla,
            fc_norm=bool(d.get("fc_norm", False)),
            norm_output=bool(d.get("norm_output", False)),
        )


def rope_parameters(cfg: Eagle3Config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] (fp32) and the cos/sin amplitude, as Hugging Face computes
    them for Llama (``default``, ``linear``, ``llama3``, ``yarn``)."""
    dim, base, s = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if s is None:
        return inv, 1.0
    kind, factor = s["rope_type"], float(s["factor"])
    if kind == "linear":
        return inv / factor, 1.0
    if kind == "llama3":
        low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
        old = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        between = (wavelen >= old / high) & (wavelen <= old / low)
        return torch.where(between, mid, scaled), 1.0
    # yarn: the same frequency blend as the target's YaRN; the amplitude by Hugging Face's rule
    # (an explicit attention_factor, else the mscale ratio when both are given, else mscale(factor))
    old = int(s.get("original_max_position_embeddings") or 0)
    if old < 1:
        raise ValueError("eagle3 drafter config: yarn rope_scaling needs original_max_position_embeddings")
    scaling = RopeScaling(
        factor=factor,
        original_max_position_embeddings=old,
        beta_fast=float(s.get("beta_fast") or 32.0),
        beta_slow=float(s.get("beta_slow") or 1.0),
    )
    inv, _ = yarn_inv_freq(dim, base, scaling)
    amp = s.get("attention_factor")
    if amp is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        amp = yarn_get_mscale(factor, m) / yarn_get_mscale(factor, m_all) if m and m_all else yarn_get_mscale(factor)
    return inv, float(amp)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotary embedding on halves (``rotate_half``), x [T, heads, D], cos/sin [T, D/2] fp32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    c, s = cos[:, None], sin[:, None]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


class BiasLinear(Linear):
    """A dense ``Linear`` with an optional bias (some drafters train q/k/v/o with one)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__(in_features, out_features, dtype=dtype)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y if self.bias is None else y + self.bias


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config, dtype: torch.dtype):
        super().__init__()
        h, kv, d, b = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.attention_bias
        self.heads, self.kv_heads, self.head_dim = h, kv, d
        self.q_proj = BiasLinear(2 * cfg.hidden_size, h * d, b, dtype)
        self.k_proj = BiasLinear(2 * cfg.hidden_size, kv * d, b, dtype)
        self.v_proj = BiasLinear(2 * cfg.hidden_size, kv * d, b, dtype)
        self.o_proj = BiasLinear(h * d, cfg.hidden_size, b, dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        chunks: list[PrefillChunk],
        cache: torch.Tensor,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = rotate(self.q_proj(x).view(t, self.heads, self.head_dim), cos, sin)
        k = rotate(self.k_proj(x).view(t, self.kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        flat = cache.view(-1, 2, self.kv_heads, self.head_dim)
        flat.index_copy_(0, slots, torch.stack((k, v), dim=1).to(cache.dtype))
        out = paged_attention(q, flat, chunks, cache.shape[1])
        return self.o_proj(out.reshape(t, self.heads * self.head_dim))


QUERY_TILE = 256  # query rows per attention call in a long chunk: bounds the [H, rows, context] scores


def paged_attention(q: torch.Tensor, flat: torch.Tensor, chunks: list[PrefillChunk], block_size: int) -> torch.Tensor:
    """Causal attention of q [T, H, D] over each chunk's cached positions 0..context_len-1, read from
    ``flat`` [slots, 2, KV, D] through the chunk's block table; the chunk's rows are its last
    ``end - start`` positions. One-row chunks (chain steps) run as one padded batch. Key/value heads
    are shared by H / KV query heads each (``enable_gqa``: never copied per query head)."""
    scale = q.shape[2] ** -0.5
    out = torch.empty_like(q)
    if chunks and all(c.end - c.start == 1 for c in chunks):
        width = max(c.context_len for c in chunks)
        nblk = -(-width // block_size)
        tables = torch.stack(
            [F.pad(c.block_table[:nblk].long(), (0, max(0, nblk - len(c.block_table)))) for c in chunks]
        )  # [S, nblk]; padding is masked below
        j = torch.arange(width, device=q.device)
        kv = flat[tables[:, j // block_size] * block_size + j % block_size]  # [S, W, 2, KV, D]
        valid = j[None] < torch.tensor([c.context_len for c in chunks], device=q.device)[:, None]
        rows = torch.tensor([c.start for c in chunks], device=q.device)
        o = F.scaled_dot_product_attention(
            q[rows].unsqueeze(2).to(kv.dtype),
            kv[:, :, 0].transpose(1, 2),
            kv[:, :, 1].transpose(1, 2),
            attn_mask=valid[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )  # [S, H, 1, D]
        out[rows] = o.squeeze(2).to(q.dtype)
        return out
    for c in chunks:
        n, ctx = c.end - c.start, c.context_len
        pos = torch.arange(ctx, device=q.device)
        kv = flat[c.block_table[pos // block_size].long() * block_size + pos % block_size]  # [ctx, 2, KV, D]
        k, v = kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)  # [KV, ctx, D]
        for a in range(0, n, QUERY_TILE):
            b = min(n, a + QUERY_TILE)
            qpos = torch.arange(ctx - n + a, ctx - n + b, device=q.device)
            mask = pos[None, :] <= qpos[:, None]  # [rows, ctx]
            o = F.scaled_dot_product_attention(
                q[c.start + a : c.start + b].transpose(0, 1).to(k.dtype),
                k,
                v,
                attn_mask=mask,
                scale=scale,
                enable_gqa=True,
            )
            out[c.start + a : c.start + b] = o.transpose(0, 1).to(q.dtype)
    return out


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, dtype=dtype)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, dtype=dtype)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config, dtype: torch.dtype):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mla = cfg.mla is not None
        self.self_attn = Eagle3MLAAttention(cfg, dtype) if self.mla else Eagle3Attention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = Eagle3MLP(cfg, dtype)

    def forward(self, embeds, hidden, positions, cos, sin, slots, chunks, cache) -> torch.Tensor:
        """The pre-norm output (MLP output plus residual)."""
        h = self.hidden_norm(hidden)
        residual = h if self.norm_before_residual else hidden
        x = torch.cat((self.input_layernorm(embeds), h), dim=-1)
        attn = (
            self.self_attn(x, positions, slots, chunks, cache)
            if self.mla
            else self.self_attn(x, cos, sin, slots, chunks, cache)
        )
        residual = attn + residual
        return self.mlp(self.post_attention_layernorm(residual)) + residual


class Eagle3Drafter(nn.Module):
    """The drafter's weights and forward; parameter names are the checkpoint's after
    ``checkpoint_name`` (``fc.weight``, ``layers.0.self_attn.q_proj.weight``, ``lm_head.weight``...)."""

    def __init__(self, cfg: Eagle3Config, dtype: torch.dtype, own_embedding: bool, own_lm_head: bool = True):
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.fc = Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, cfg.hidden_size, dtype=dtype)
        self.fc_norm = (
            nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps, dtype) for _ in cfg.aux_layer_ids)
            if cfg.fc_norm
            else None
        )
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype) if own_embedding else None
        self.layers = nn.ModuleList([Eagle3Layer(cfg, dtype)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.draft_vocab_size, dtype=dtype) if own_lm_head else None
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self._shared_embedding = None  # the target's, when the checkpoint has none (not a submodule)
        self._shared_lm_head = None  # likewise the target's LM head (fp32 logits over the whole vocabulary)
        inv_freq, self.rope_amplitude = rope_parameters(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    # -- wiring ----------------------------------------------------------------------------------
    def share_embedding(self, embedding: nn.Module) -> None:
        """Use the target's token embedding (checkpoints without ``embed_tokens``)."""
        if self.embed_tokens is None:  # a plain attribute: the weights stay the target's, not the drafter's
            self.__dict__["_shared_embedding"] = embedding

    def share_lm_head(self, lm_head: nn.Module) -> None:
        """Use the target's LM head (checkpoints without ``lm_head``; full vocabulary)."""
        if self.lm_head is None:
            self.__dict__["_shared_lm_head"] = lm_head

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        module = self.embed_tokens if self.embed_tokens is not None else self._shared_embedding
        if module is None:
            raise RuntimeError("eagle3 drafter: no embed_tokens in the checkpoint and no target embedding shared")
        return module(ids).to(self.dtype)

    def allocate_cache(
        self, num_blocks: int, block_size: int, device: torch.device | str, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The drafter's paged KV cache, block ids shared with the target's (``dtype`` None: the drafter's)."""
        c, dtype = self.config, dtype or self.dtype
        if c.mla is not None:
            return torch.zeros(num_blocks, block_size, c.mla.cache_width, dtype=dtype, device=device)
        return torch.zeros(num_blocks, block_size, 2, c.num_key_value_heads, c.head_dim, dtype=dtype, device=device)

    def cache_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        c, size = self.config, (dtype or self.dtype).itemsize
        return (c.mla.cache_width if c.mla is not None else 2 * c.num_key_value_heads * c.head_dim) * size

    # -- compute ---------------------------------------------------------------------------------
    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux hidden states [T, n_aux * target_hidden] -> the drafter's hidden [T, hidden]."""
        aux = aux.to(self.dtype)
        if self.fc_norm is not None:
            d = self.config.target_hidden_size
            aux = torch.cat([norm(aux[:, j * d : (j + 1) * d]) for j, norm in enumerate(self.fc_norm)], dim=-1)
        return self.fc(aux)

    def forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, chunks: list[PrefillChunk], cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter pass over rows laid out as ``chunks`` (each a run of consecutive positions ending
        at ``context_len - 1``, its block table the target's). ``input_ids`` [T]: each row's input
        token (the one *after* the target position it sits at), ``hidden`` [T, hidden]: ``combine``'s
        output or a previous pass's first output. Writes the rows' KV into ``cache``. Returns
        (the hidden state the next chain pass takes [T, hidden]: the pre-norm output, or the normed
        one under ``norm_output``; normed hidden [T, hidden] for ``draft_logits``)."""
        device = hidden.device
        bs = cache.shape[1]
        positions, slots = [], []
        for c in chunks:
            pos = torch.arange(c.context_len - (c.end - c.start), c.context_len, device=device)
            positions.append(pos)
            slots.append(c.block_table[pos // bs].long() * bs + pos % bs)
        positions, slots = torch.cat(positions), torch.cat(slots)
        cos = sin = None
        if self.config.mla is None:
            freqs = positions.float()[:, None] * self.inv_freq[None]
            cos, sin = freqs.cos() * self.rope_amplitude, freqs.sin() * self.rope_amplitude
        out = self.layers[0](self.embed(input_ids), hidden.to(self.dtype), positions, cos, sin, slots, chunks, cache)
        normed = self.norm(out)
        return (normed if self.config.norm_output else out), normed

    def draft_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the draft vocabulary [N, draft_vocab_size]."""
        head = self.lm_head if self.lm_head is not None else self._shared_lm_head
        if head is None:
            raise RuntimeError("eagle3 drafter: no lm_head in the checkpoint and no target LM head shared")
        return head(normed).float()

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the target vocabulary [N, vocab_size], -inf outside the draft vocabulary
        (vLLM's scatter through d2t)."""
        draft = self.draft_logits(normed)
        full = draft.new_full((draft.shape[0], self.config.vocab_size), float("-inf"))
        full[:, self.draft_to_target()] = draft
        return full

    def greedy(self, normed: torch.Tensor) -> torch.Tensor:
        """The most likely next token of each row, as target ids [N] int64."""
        return self.draft_to_target()[self.draft_logits(normed).argmax(dim=-1)]

    def draft_to_target(self) -> torch.Tensor:
        ids = self.__dict__.get("_d2t_ids")
        if ids is None or ids.device != self.d2t.device:
            ids = self.__dict__["_d2t_ids"] = (
                torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t
            )
        return ids
