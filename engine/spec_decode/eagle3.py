"""The EAGLE-3 drafter: one Llama-style decoder layer over the target's hidden states.

Published EAGLE-3 checkpoints (``LlamaForCausalLMEagle3`` configs: SpecForge, AQ-MedAI's and the
torchspec Kimi K2.x drafters) hold:

- ``fc``: [hidden, n_aux * target_hidden], folding the hidden states of three target layers
  (``eagle_config.eagle_aux_hidden_state_layer_ids``, default ``(2, L // 2, L - 3)``) into one;
- one decoder layer (``layers.0.*``, or ``midlayer.*`` in SpecForge exports, with or without a
  ``model.`` prefix) whose attention reads ``cat(input_layernorm(token embedding),
  hidden_norm(hidden))``, 2 x hidden wide, then the usual SiLU MLP;
- ``norm`` and ``lm_head`` over a reduced ``draft_vocab_size``, with ``d2t`` (target id = draft id +
  d2t[draft id]) and ``t2d`` (target-side membership, unused here, as in vLLM);
- optionally ``embed_tokens``; without it the drafter shares the target's embedding.

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

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kimitui.engine.config import RopeScaling, yarn_get_mscale
from kimitui.engine.layers.attn_metadata import PrefillChunk
from kimitui.engine.layers.embedding import VocabEmbedding
from kimitui.engine.layers.linear import Linear
from kimitui.engine.layers.norm import RMSNorm
from kimitui.engine.layers.rope import yarn_inv_freq

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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
    aux_layer_ids: tuple[int, ...]  # ascending, the order the target concatenates them in
    attention_bias: bool = False

    @classmethod
    def from_dict(cls, d: dict, target_layers: int, target_hidden_size: int, target_vocab_size: int
                  ) -> Eagle3Config:
        """From a drafter's config.json, checked against the target (layers, hidden size, vocabulary)."""
        def need(key):
            if key not in d:
                raise ValueError(f"eagle3 drafter config: missing {key!r}")
            return d[key]

        if d.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"eagle3 drafter config: num_hidden_layers must be 1 (one EAGLE-3 layer), "
                             f"got {d['num_hidden_layers']}")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"eagle3 drafter config: hidden_act must be 'silu', got {d['hidden_act']!r}")
        eagle = d.get("eagle_config") or {}
        if eagle.get("use_aux_hidden_state", True) is False:
            raise ValueError("eagle3 drafter config: use_aux_hidden_state false (EAGLE-1 style input) "
                             "is not supported")
        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kv_heads = int(d.get("num_key_value_heads") or heads)
        head_dim = int(d.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ValueError(f"eagle3 drafter config: num_attention_heads ({heads}) must be a multiple of "
                             f"num_key_value_heads ({kv_heads})")
        vocab = int(d.get("vocab_size") or target_vocab_size)
        if vocab != target_vocab_size:
            raise ValueError(f"eagle3 drafter config: vocab_size {vocab} differs from the target's "
                             f"{target_vocab_size}")
        draft_vocab = int(d.get("draft_vocab_size") or vocab)
        if not 1 <= draft_vocab <= vocab:
            raise ValueError(f"eagle3 drafter config: draft_vocab_size must be in 1..{vocab}, got {draft_vocab}")
        target_hidden = int(d.get("target_hidden_size") or hidden)
        if target_hidden != target_hidden_size:
            raise ValueError(f"eagle3 drafter config: target_hidden_size {target_hidden} differs from the "
                             f"target's hidden_size {target_hidden_size}")
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        ids = default_aux_layer_ids(target_layers) if ids is None else tuple(int(k) for k in ids)
        if len(set(ids)) != len(ids) or not all(0 <= k <= target_layers for k in ids):
            raise ValueError(f"eagle3 drafter config: aux hidden state layer ids {list(ids)} must be distinct "
                             f"and in 0..{target_layers} for a {target_layers}-layer target")
        scaling = d.get("rope_scaling")
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ROPE_TYPES:
                raise ValueError(f"eagle3 drafter config: rope_scaling type {kind!r} is not supported "
                                 f"({', '.join(ROPE_TYPES)})")
            scaling = None if kind == "default" else {**scaling, "rope_type": kind}
        return cls(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                   intermediate_size=int(need("intermediate_size")), rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                   rope_theta=float(d.get("rope_theta", 10000.0)), rope_scaling=scaling, vocab_size=vocab,
                   draft_vocab_size=draft_vocab, target_hidden_size=target_hidden,
                   norm_before_residual=bool(d.get("norm_before_residual", False)),
                   aux_layer_ids=tuple(sorted(ids)),
                   attention_bias=bool(d.get("attention_bias", False) or d.get("qkv_bias", False)))


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
    scaling = RopeScaling(factor=factor, original_max_position_embeddings=old,
                          beta_fast=float(s.get("beta_fast") or 32.0), beta_slow=float(s.get("beta_slow") or 1.0))
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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                chunks: list[PrefillChunk], cache: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q = rotate(self.q_proj(x).view(t, self.heads, self.head_dim), cos, sin)
        k = rotate(self.k_proj(x).view(t, self.kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        flat = cache.view(-1, 2, self.kv_heads, self.head_dim)
        flat.index_copy_(0, slots, torch.stack((k, v), dim=1).to(cache.dtype))
        out = paged_attention(q, flat, chunks, cache.shape[1])
        return self.o_proj(out.reshape(t, self.heads * self.head_dim))


QUERY_TILE = 256  # query rows per attention call in a long chunk: bounds the [H, rows, context] scores


def paged_attention(q: torch.Tensor, flat: torch.Tensor, chunks: list[PrefillChunk], block_size: int
                    ) -> torch.Tensor:
    """Causal attention of q [T, H, D] over each chunk's cached positions 0..context_len-1, read from
    ``flat`` [slots, 2, KV, D] through the chunk's block table; the chunk's rows are its last
    ``end - start`` positions. One-row chunks (chain steps) run as one padded batch. Key/value heads
    are shared by H / KV query heads each (``enable_gqa``: never copied per query head)."""
    scale = q.shape[2] ** -0.5
    out = torch.empty_like(q)
    if chunks and all(c.end - c.start == 1 for c in chunks):
        width = max(c.context_len for c in chunks)
        nblk = -(-width // block_size)
        tables = torch.stack([F.pad(c.block_table[:nblk].long(), (0, max(0, nblk - len(c.block_table))))
                              for c in chunks])  # [S, nblk]; padding is masked below
        j = torch.arange(width, device=q.device)
        kv = flat[tables[:, j // block_size] * block_size + j % block_size]  # [S, W, 2, KV, D]
        valid = j[None] < torch.tensor([c.context_len for c in chunks], device=q.device)[:, None]
        rows = torch.tensor([c.start for c in chunks], device=q.device)
        o = F.scaled_dot_product_attention(q[rows].unsqueeze(2).to(kv.dtype), kv[:, :, 0].transpose(1, 2),
                                           kv[:, :, 1].transpose(1, 2), attn_mask=valid[:, None, None, :],
                                           scale=scale, enable_gqa=True)  # [S, H, 1, D]
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
            o = F.scaled_dot_product_attention(q[c.start + a:c.start + b].transpose(0, 1).to(k.dtype), k, v,
                                               attn_mask=mask, scale=scale, enable_gqa=True)
            out[c.start + a:c.start + b] = o.transpose(0, 1).to(q.dtype)
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
        self.self_attn = Eagle3Attention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = Eagle3MLP(cfg, dtype)

    def forward(self, embeds, hidden, cos, sin, slots, chunks, cache) -> torch.Tensor:
        """The pre-norm output (MLP output plus residual)."""
        h = self.hidden_norm(hidden)
        residual = h if self.norm_before_residual else hidden
        x = torch.cat((self.input_layernorm(embeds), h), dim=-1)
        residual = self.self_attn(x, cos, sin, slots, chunks, cache) + residual
        return self.mlp(self.post_attention_layernorm(residual)) + residual


class Eagle3Drafter(nn.Module):
    """The drafter's weights and forward; parameter names are the checkpoint's after
    ``checkpoint_name`` (``fc.weight``, ``layers.0.self_attn.q_proj.weight``, ``lm_head.weight``...)."""

    def __init__(self, cfg: Eagle3Config, dtype: torch.dtype, own_embedding: bool):
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.fc = Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, cfg.hidden_size, dtype=dtype)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype) if own_embedding else None
        self.layers = nn.ModuleList([Eagle3Layer(cfg, dtype)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.draft_vocab_size, dtype=dtype)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self._shared_embedding = None  # the target's, when the checkpoint has none (not a submodule)
        inv_freq, self.rope_amplitude = rope_parameters(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    # -- wiring ----------------------------------------------------------------------------------
    def share_embedding(self, embedding: nn.Module) -> None:
        """Use the target's token embedding (checkpoints without ``embed_tokens``)."""
        if self.embed_tokens is None:  # a plain attribute: the weights stay the target's, not the drafter's
            self.__dict__["_shared_embedding"] = embedding

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        module = self.embed_tokens if self.embed_tokens is not None else self._shared_embedding
        if module is None:
            raise RuntimeError("eagle3 drafter: no embed_tokens in the checkpoint and no target embedding shared")
        return module(ids).to(self.dtype)

    def allocate_cache(self, num_blocks: int, block_size: int, device: torch.device | str) -> torch.Tensor:
        """The drafter's paged KV cache, block ids shared with the target's."""
        c = self.config
        return torch.zeros(num_blocks, block_size, 2, c.num_key_value_heads, c.head_dim, dtype=self.dtype,
                           device=device)

    def cache_bytes_per_token(self) -> int:
        c = self.config
        return 2 * c.num_key_value_heads * c.head_dim * self.dtype.itemsize

    # -- compute ---------------------------------------------------------------------------------
    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux hidden states [T, n_aux * target_hidden] -> the drafter's hidden [T, hidden]."""
        return self.fc(aux.to(self.dtype))

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, chunks: list[PrefillChunk],
                cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter pass over rows laid out as ``chunks`` (each a run of consecutive positions ending
        at ``context_len - 1``, its block table the target's). ``input_ids`` [T]: each row's input
        token (the one *after* the target position it sits at), ``hidden`` [T, hidden]: ``combine``'s
        output or a previous pass's pre-norm output. Writes the rows' KV into ``cache``. Returns
        (pre-norm hidden [T, hidden], normed hidden [T, hidden] for ``draft_logits``)."""
        device = hidden.device
        bs = cache.shape[1]
        positions, slots = [], []
        for c in chunks:
            pos = torch.arange(c.context_len - (c.end - c.start), c.context_len, device=device)
            positions.append(pos)
            slots.append(c.block_table[pos // bs].long() * bs + pos % bs)
        positions, slots = torch.cat(positions), torch.cat(slots)
        freqs = positions.float()[:, None] * self.inv_freq[None]
        cos, sin = freqs.cos() * self.rope_amplitude, freqs.sin() * self.rope_amplitude
        out = self.layers[0](self.embed(input_ids), hidden.to(self.dtype), cos, sin, slots, chunks, cache)
        return out, self.norm(out)

    def draft_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the draft vocabulary [N, draft_vocab_size]."""
        return self.lm_head(normed).float()

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
            ids = self.__dict__["_d2t_ids"] = torch.arange(self.config.draft_vocab_size, device=self.d2t.device) \
                + self.d2t
        return ids


# -- loading -------------------------------------------------------------------------------------

_IGNORED = ("t2d", "mask_hidden")  # unused by greedy chain drafting (vLLM skips them too)


def checkpoint_name(name: str) -> str | None:
    """A checkpoint tensor's parameter name (``model.`` dropped, ``midlayer.`` = ``layers.0.``), or
    None for tensors the drafter does not use."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("midlayer."):
        name = "layers.0." + name[len("midlayer."):]
    if name in _IGNORED or name.endswith("rotary_emb.inv_freq"):
        return None
    return name


def load_eagle3(path: str | Path, target_config, device: torch.device | str, dtype: torch.dtype,
                target_embedding: nn.Module | None = None) -> Eagle3Drafter:
    """Load an EAGLE-3 drafter checkpoint (config.json and *.safetensors, any float dtype on disk) for a
    target with ``target_config`` (engine ``ModelConfig``), on ``device`` in ``dtype``."""
    from safetensors import safe_open

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"eagle3 drafter: no config.json in {path}")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"eagle3 drafter: no .safetensors files in {path}")
    cfg = Eagle3Config.from_dict(json.loads(cfg_file.read_text()), target_config.num_hidden_layers,
                                 target_config.hidden_size, target_config.vocab_size)
    names: dict[str, tuple[Path, str]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as r:
            for key in r.keys():
                name = checkpoint_name(key)
                if name is None:
                    continue
                if name in names:
                    raise ValueError(f"eagle3 drafter: {key!r} in {f.name} duplicates {names[name][1]!r}")
                names[name] = (f, key)
    own_embedding = "embed_tokens.weight" in names
    if not own_embedding and cfg.hidden_size != target_config.hidden_size:
        raise ValueError(f"eagle3 drafter: no embed_tokens in the checkpoint, and its hidden_size {cfg.hidden_size} "
                         f"differs from the target's {target_config.hidden_size}, so it cannot share the target's")
    drafter = Eagle3Drafter(cfg, dtype, own_embedding)
    drafter.to_empty(device=torch.device(device))  # storage only: each tensor is filled below
    drafter.inv_freq.copy_(rope_parameters(cfg)[0])
    params = dict(drafter.named_parameters())
    params["d2t"] = drafter.d2t
    unknown = sorted(set(names) - set(params))
    if unknown:
        raise ValueError(f"eagle3 drafter: unexpected tensor {names[unknown[0]][1]!r} in {names[unknown[0]][0].name}")
    if "d2t" not in names:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise ValueError(f"eagle3 drafter: draft_vocab_size {cfg.draft_vocab_size} < vocab_size "
                             f"{cfg.vocab_size} needs a d2t tensor")
        drafter.d2t.zero_()
        names.pop("d2t", None)
        params.pop("d2t")
    missing = sorted(set(params) - set(names))
    if missing:
        raise ValueError(f"eagle3 drafter: checkpoint lacks {missing[0]!r}")
    for name, (f, key) in names.items():
        with safe_open(str(f), framework="pt") as r:
            t = r.get_tensor(key)
        p = params[name]
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"eagle3 drafter: {key!r} has shape {list(t.shape)}, expected {list(p.shape)}")
        if name == "d2t":
            if t.is_floating_point():
                raise ValueError(f"eagle3 drafter: d2t must hold integers, got {t.dtype}")
            target = torch.arange(cfg.draft_vocab_size) + t.long()
            if target.min() < 0 or target.max() >= cfg.vocab_size:
                raise ValueError(f"eagle3 drafter: d2t maps draft ids outside the target vocabulary "
                                 f"0..{cfg.vocab_size - 1}")
        elif not t.is_floating_point():
            raise ValueError(f"eagle3 drafter: {key!r} must be floating point, got {t.dtype}")
        with torch.no_grad():
            p.copy_(t)
    if target_embedding is not None:
        drafter.share_embedding(target_embedding)
    return drafter
