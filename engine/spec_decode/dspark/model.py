"""The DSpark drafter (arXiv 2607.05147) for Kimi K3 / Kimi Linear targets, in the published layout
of Inferact/Kimi-K3-DSpark, Inferact/Kimi-K3.1-Pro-DSpark-preview and lightseekorg/kimi-k3-dspark
(``architectures: ["K3DSparkModel"]``, ``model_type: "k3_dspark"``).

How it drafts (vLLM's ``v1/spec_decode/dspark.py`` + ``dspark_sampling.py`` and
``vllm/models/kimi_k3/nvidia/dspark_mla.py``; the trainer is speculators' ``models/dspark``):

- **Context.** The target keeps, for every row it computes, the hidden states of five of its layers
  (``target_layer_ids``: layer *outputs*, 0-based, DSpark's convention; ``aux_hidden_stream``
  ``prefix``: the AttnRes running sum after the layer, ``attn_res``: the AttnRes mix the next layer's
  attention reads, the model output mix after the last layer). They are folded into one row per
  position: ``context_norm(context_proj(cat(fc_norm[i](tap_i))))`` (``fc_norm`` only when the config
  says so). Each of the five dense MLA layers turns that row into its own latent KV
  (``kv_a_proj_with_mqa`` -> ``kv_a_layernorm`` latent + roped k_rope) and keeps it in a paged cache
  on the target's block ids: the drafter never runs its layers over the context.
- **Block.** After the target has verified position p, the token just sampled is the *anchor*
  (position p + 1). One drafter pass runs ``num_speculative_tokens`` rows: the anchor, then
  ``mask_token_id`` rows, at positions p + 1 .. p + K; each row attends to the whole context (0..p)
  and to every row of the block (non-causal); pre-norm MLA + gated MLP layers; ``final_norm``; the
  target's LM head. Row j scores draft j + 1 (the token at position p + 2 + j: "sample from anchor").
- **Markov head.** ``markov_head.markov_w1`` [V, r] embeds the previous token, ``markov_w2`` [V, r]
  projects it to a logit bias: row j's logits + ``w2 @ w1[prev]`` with prev = the anchor for j = 0,
  else draft j. Drafts are chosen left to right (greedy argmax, or sampled from the biased
  distribution at the request's temperature / top-k / top-p: ``draft_sample_method``).
- **Confidence head.** ``confidence_head.proj`` [1, hidden + r] (+ bias) on ``cat(hidden_j,
  w1[prev_j])``: the probability that draft j + 1 is accepted given the earlier ones. The proposer
  verifies draft j only while the product of these (its expected gain in tokens) stays above
  ``MIN_PREDICTED_GAIN``.
- **Shared with the target:** the token embedding (unless the checkpoint ships ``embed_tokens``, as
  Inferact/Kimi-K3-DSpark does) and the LM head (never stored).

The attention (engine/spec_decode/dspark/attention.py) reads the latent context in place through the
block tables, absorbed as the target's MLA decode is; a copy of the context is the fallback.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kimitui.engine.config import RopeScaling
from kimitui.engine.layers.embedding import VocabEmbedding
from kimitui.engine.layers.linear import Linear
from kimitui.engine.layers.norm import RMSNorm
from kimitui.engine.sampling.sampler import apply_top_k_top_p
from kimitui.engine.spec_decode.dspark.attention import DSparkAttention, PagedContext
from kimitui.engine.spec_decode.footprint import DrafterFootprint, read_drafter_config

ARCHITECTURES = ("K3DSparkModel",)
AUX_STREAMS = ("prefix", "attn_res")
MIN_PREDICTED_GAIN = 0.04  # TensorRT-LLM DSparkDecodingConfig's confidence_min_predicted_gain default


def _rope_scaling(d: dict) -> tuple[float, RopeScaling | None]:
    """(rope_theta, YaRN parameters or None) from ``rope_parameters`` (transformers 5) or ``rope_scaling``."""
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    theta = float(rp.get("rope_theta") or d.get("rope_theta") or 10000.0)
    kind = rp.get("rope_type", rp.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ("yarn", "deepseek_yarn"):
        raise ValueError(f"dspark drafter config: rope type {kind!r} is not supported (yarn, default)")
    if not rp.get("original_max_position_embeddings") or not rp.get("factor"):
        raise ValueError("dspark drafter config: yarn rope needs factor and original_max_position_embeddings")
    return theta, RopeScaling(
        factor=float(rp["factor"]),
        original_max_position_embeddings=int(rp["original_max_position_embeddings"]),
        beta_fast=float(rp.get("beta_fast") or 32.0),
        beta_slow=float(rp.get("beta_slow") or 1.0),
        mscale=float(rp.get("mscale") or 1.0),
        mscale_all_dim=float(rp.get("mscale_all_dim") or 0.0),
    )


@dataclass(frozen=True)
class DSparkConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    use_rope: bool  # not mla_use_nope
    rope_theta: float
    rope_scaling: RopeScaling | None
    rms_norm_eps: float
    vocab_size: int
    target_hidden_size: int
    target_layer_ids: tuple[int, ...]  # layer outputs, 0-based, in the checkpoint's (training) order
    aux_hidden_stream: str
    fc_norm: bool
    mask_token_id: int
    markov_rank: int
    confidence_head: bool
    confidence_head_with_markov: bool
    hidden_act: str = "silu"
    situ_beta: float = 1.0
    situ_linear_beta: float | None = None

    @property
    def cache_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def capture_ids(self) -> tuple[int, ...]:
        """The taps as the target's capture ids (k = the state entering layer k = layer k - 1's output)."""
        return tuple(k + 1 for k in self.target_layer_ids)

    @classmethod
    def from_dict(
        cls,
        d: dict,
        target_layers: int,
        target_hidden_size: int,
        target_vocab_size: int,
        target_has_attn_res: bool = True,
    ) -> DSparkConfig:
        """From a drafter's config.json, checked against the target; every problem is one line."""

        def need(key):
            if d.get(key) is None:
                raise ValueError(f"dspark drafter config: missing {key!r}")
            return d[key]

        archs = d.get("architectures") or []
        if not any(a in ARCHITECTURES for a in archs):
            raise ValueError(
                f"dspark drafter config: architectures {archs} not supported (supported: {', '.join(ARCHITECTURES)})"
            )
        if d.get("mla_use_output_gate"):
            raise ValueError(
                "dspark drafter config: mla_use_output_gate true is not supported (the published "
                "K3 DSpark drafters have none)"
            )
        head_type = d.get("markov_head_type", "vanilla")
        if head_type != "vanilla":
            raise ValueError(f"dspark drafter config: markov_head_type {head_type!r} is not supported (vanilla)")
        vocab = int(d.get("vocab_size") or target_vocab_size)
        if vocab != target_vocab_size or int(d.get("draft_vocab_size") or vocab) != vocab:
            raise ValueError(
                f"dspark drafter config: vocab_size {vocab} (draft_vocab_size "
                f"{d.get('draft_vocab_size')}) must equal the target's {target_vocab_size}"
            )
        t_hidden = int(d.get("target_hidden_size") or target_hidden_size)
        if t_hidden != target_hidden_size:
            raise ValueError(
                f"dspark drafter config: target_hidden_size {t_hidden} differs from the target's "
                f"hidden_size {target_hidden_size}"
            )
        t_layers = d.get("target_num_hidden_layers")
        if t_layers is not None and int(t_layers) != target_layers:
            raise ValueError(
                f"dspark drafter config: target_num_hidden_layers {t_layers} differs from the "
                f"target's num_hidden_layers {target_layers}"
            )
        ids = need("target_layer_ids")
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(k, int) and 0 <= k < target_layers for k in ids)
            or len(set(ids)) != len(ids)
        ):
            raise ValueError(
                f"dspark drafter config: target_layer_ids {ids} must be distinct layer ids in "
                f"0..{target_layers - 1} (layer outputs)"
            )
        n_taps = d.get("num_target_layers")
        if n_taps is not None and int(n_taps) != len(ids):
            raise ValueError(
                f"dspark drafter config: num_target_layers {n_taps} differs from len(target_layer_ids) {len(ids)}"
            )
        stream = d.get("aux_hidden_stream") or "prefix"
        if stream not in AUX_STREAMS:
            raise ValueError(
                f"dspark drafter config: aux_hidden_stream {stream!r} not supported ({', '.join(AUX_STREAMS)})"
            )
        if stream == "attn_res" and not target_has_attn_res:
            raise ValueError(
                "dspark drafter config: aux_hidden_stream 'attn_res' needs a target with attention "
                "residuals (attn_res_block_size)"
            )
        rank = int(d.get("markov_rank", 0))
        if rank < 1:
            raise ValueError(f"dspark drafter config: markov_rank must be >= 1, got {rank}")
        conf = bool(d.get("enable_confidence_head", True))
        theta, scaling = _rope_scaling(d)
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "situ"):
            raise ValueError(f"dspark drafter config: hidden_act {act!r} not supported (silu, situ)")
        heads = int(need("num_attention_heads"))
        kv_heads = int(d.get("num_key_value_heads") or heads)
        if kv_heads != heads:
            raise ValueError(
                f"dspark drafter config: num_key_value_heads {kv_heads} must equal num_attention_heads {heads} (MLA)"
            )
        return cls(
            hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            q_lora_rank=int(d["q_lora_rank"]) if d.get("q_lora_rank") else None,
            kv_lora_rank=int(need("kv_lora_rank")),
            qk_nope_head_dim=int(need("qk_nope_head_dim")),
            qk_rope_head_dim=int(need("qk_rope_head_dim")),
            v_head_dim=int(need("v_head_dim")),
            use_rope=not bool(d.get("mla_use_nope", False)),
            rope_theta=theta,
            rope_scaling=scaling,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            vocab_size=vocab,
            target_hidden_size=t_hidden,
            target_layer_ids=tuple(int(k) for k in ids),
            aux_hidden_stream=stream,
            fc_norm=bool(d.get("fc_norm", False)),
            mask_token_id=int(need("mask_token_id")),
            markov_rank=rank,
            confidence_head=conf,
            confidence_head_with_markov=conf and bool(d.get("confidence_head_with_markov", True)),
            hidden_act=act,
            situ_beta=float(d.get("activation_situ_beta") or 1.0),
            situ_linear_beta=(
                float(d["activation_situ_linear_beta"]) if d.get("activation_situ_linear_beta") else None
            ),
        )


class DSparkMLP(nn.Module):
    def __init__(self, cfg: DSparkConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, dtype=dtype)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, dtype=dtype)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u, c = self.gate_proj(x).float(), self.up_proj(x).float(), self.cfg
        if c.hidden_act == "situ":  # K3's SiTU: beta tanh(g / beta) sigmoid(g) * bounded up
            up = u if c.situ_linear_beta is None else c.situ_linear_beta * torch.tanh(u / c.situ_linear_beta)
            a = c.situ_beta * torch.tanh(g / c.situ_beta) * torch.sigmoid(g) * up
        else:
            a = F.silu(g) * u
        return self.down_proj(a.to(x.dtype))


class DSparkLayer(nn.Module):
    def __init__(self, cfg: DSparkConfig, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = DSparkAttention(cfg, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = DSparkMLP(cfg, dtype)

    def forward(self, x, positions, context, valid, block):
        x = x + self.self_attn(self.input_layernorm(x), positions, context, valid, block)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Markov(nn.Module):
    def __init__(self, cfg: DSparkConfig, dtype: torch.dtype):
        super().__init__()
        self.markov_w1 = VocabEmbedding(cfg.vocab_size, cfg.markov_rank, dtype=dtype)
        self.markov_w2 = Linear(cfg.markov_rank, cfg.vocab_size, dtype=dtype)


class _Confidence(nn.Module):
    def __init__(self, cfg: DSparkConfig, dtype: torch.dtype):
        super().__init__()
        width = cfg.hidden_size + (cfg.markov_rank if cfg.confidence_head_with_markov else 0)
        self.proj = Linear(width, 1, dtype=dtype)
        self.proj.bias = nn.Parameter(torch.zeros(1, dtype=dtype), requires_grad=False)


@dataclass
class DSparkBlock:
    """One drafter pass over S sequences: ``tokens`` [S, K] (target ids), ``probs`` [S, K, V] fp32 (the
    distributions sampled drafts were drawn from; None when every row is greedy), ``confidence``
    [S, K] (the confidence head's acceptance probabilities; None without the head)."""

    tokens: torch.Tensor
    probs: torch.Tensor | None
    confidence: torch.Tensor | None


class DSparkDrafter(nn.Module):
    """The drafter's weights (parameter names are the checkpoint's) and its passes."""

    def __init__(self, cfg: DSparkConfig, dtype: torch.dtype, own_embedding: bool = False):
        super().__init__()
        self.config, self.dtype = cfg, dtype
        n_taps = len(cfg.target_layer_ids)
        self.context_proj = Linear(n_taps * cfg.target_hidden_size, cfg.hidden_size, dtype=dtype)
        self.context_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.fc_norm = (
            nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps, dtype) for _ in range(n_taps))
            if cfg.fc_norm
            else None
        )
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype) if own_embedding else None
        self.layers = nn.ModuleList(DSparkLayer(cfg, dtype) for _ in range(cfg.num_hidden_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.markov_head = _Markov(cfg, dtype)
        self.confidence_head = _Confidence(cfg, dtype) if cfg.confidence_head else None
        self.__dict__["_shared_embedding"] = None
        self.__dict__["_lm_head"] = None
        # the taps as the target hands them over (ascending capture ids) -> the checkpoint's order
        order = sorted(range(n_taps), key=lambda i: cfg.target_layer_ids[i])
        self.__dict__["_tap_order"] = [order.index(i) for i in range(n_taps)]

    # -- wiring ----------------------------------------------------------------------------------
    def share(self, embedding: nn.Module | None, lm_head: nn.Module) -> None:
        """The target's embedding (used when the checkpoint has none) and LM head (fp32 logits)."""
        self.__dict__["_shared_embedding"] = embedding
        self.__dict__["_lm_head"] = lm_head

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        module = self.embed_tokens if self.embed_tokens is not None else self.__dict__["_shared_embedding"]
        if module is None:
            raise RuntimeError("dspark drafter: no embed_tokens in the checkpoint and no target embedding shared")
        return module(ids).to(self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.__dict__["_lm_head"]
        if head is None:
            raise RuntimeError("dspark drafter: the target's LM head was not shared")
        return head(hidden).float()

    def allocate_cache(
        self, num_blocks: int, block_size: int, device, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Per drafter layer and token, the latent context KV: [layers, blocks, block_size, kv_lora + rope]
        (each layer's cache contiguous, as the paged MLA decode reads it)."""
        c = self.config
        return torch.zeros(
            c.num_hidden_layers, num_blocks, block_size, c.cache_width, dtype=dtype or self.dtype, device=device
        )

    def cache_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        return self.config.num_hidden_layers * self.config.cache_width * (dtype or self.dtype).itemsize

    # -- compute ---------------------------------------------------------------------------------
    def context_features(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's taps [T, n_taps * target_hidden] (ascending layer order, as captured) -> [T, hidden]."""
        d = self.config.target_hidden_size
        chunks = [aux[:, j * d : (j + 1) * d].to(self.dtype) for j in self.__dict__["_tap_order"]]
        if self.fc_norm is not None:
            chunks = [norm(x) for norm, x in zip(self.fc_norm, chunks)]
        return self.context_norm(self.context_proj(torch.cat(chunks, dim=-1)))

    def context_latents(self, feats: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T, layers, kv_lora + rope]: what each layer caches for those context rows."""
        return torch.stack([layer.self_attn.latent(feats, positions) for layer in self.layers], dim=1)

    def block_hidden(
        self,
        anchors: torch.Tensor,
        first_positions: torch.Tensor,
        context,
        valid: torch.Tensor | None,
        block: int,
    ) -> torch.Tensor:
        """The block pass: ``anchors`` [S] (the token at ``first_positions[s]``); ``context`` a
        ``PagedContext`` (the cache read in place), or [S, C, layers, width] (the latent context of
        positions 0 .. first_positions[s] - 1, padded to C rows; ``valid`` [S, C] marks the real ones).
        -> final-normed hidden [S, K, H]."""
        s_n = anchors.shape[0]
        ids = torch.full((s_n, block), self.config.mask_token_id, dtype=torch.int64, device=anchors.device)
        ids[:, 0] = anchors
        positions = (first_positions[:, None] + torch.arange(block, device=anchors.device)[None]).reshape(-1)
        x = self.embed(ids.reshape(-1))
        for i, layer in enumerate(self.layers):
            ctx = context.layer(i) if isinstance(context, PagedContext) else context[:, :, i]
            x = layer(x, positions, ctx, valid, block)
        return self.final_norm(x).view(s_n, block, -1)

    def markov_embed(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_head.markov_w1(prev).to(self.dtype)

    def draft(
        self,
        hidden: torch.Tensor,
        anchors: torch.Tensor,
        temperature: torch.Tensor | None = None,
        top_k: torch.Tensor | None = None,
        top_p: torch.Tensor | None = None,
        generators: list | None = None,
    ) -> DSparkBlock:
        """Drafts left to right through the Markov head. ``temperature`` [S] (None or 0: greedy rows)."""
        s_n, block, _ = hidden.shape
        base = self.logits(hidden.reshape(s_n * block, -1)).view(s_n, block, -1)
        sampled = temperature is not None and bool((temperature > 0).any())
        tokens = torch.empty(s_n, block, dtype=torch.int64, device=hidden.device)
        probs = torch.zeros(s_n, block, base.shape[-1], dtype=torch.float32, device=hidden.device) if sampled else None
        conf = torch.empty(s_n, block, dtype=torch.float32, device=hidden.device) if self.confidence_head else None
        prev = anchors.long()
        for j in range(block):
            emb = self.markov_embed(prev)
            step = base[:, j] + self.markov_head.markov_w2(emb).float()
            if conf is not None:
                feat = (
                    torch.cat((hidden[:, j], emb), dim=-1) if self.config.confidence_head_with_markov else hidden[:, j]
                )
                conf[:, j] = torch.sigmoid(
                    self.confidence_head.proj(feat).float()[:, 0] + self.confidence_head.proj.bias.float()
                )
            nxt = step.argmax(dim=-1)
            if sampled:
                temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
                scaled = step / temp[:, None]
                if top_k is not None or top_p is not None:
                    scaled = apply_top_k_top_p(scaled, top_k, top_p)
                p = scaled.softmax(dim=-1)
                noise = torch.empty_like(p).exponential_()
                for i, gen in enumerate(generators or []):
                    if gen is not None:
                        noise[i].exponential_(generator=gen)
                drawn = (p / noise).argmax(dim=-1)
                greedy_row = temperature <= 0
                nxt = torch.where(greedy_row, nxt, drawn)
                probs[:, j] = torch.where(greedy_row[:, None], F.one_hot(nxt, p.shape[-1]).float(), p)
            tokens[:, j] = nxt
            prev = nxt
        return DSparkBlock(tokens, probs, conf)


def confident_length(confidence: torch.Tensor, min_gain: float = MIN_PREDICTED_GAIN) -> torch.Tensor:
    """How many drafts of each row to verify: draft j is worth a verified row while the expected
    number of tokens it adds, the product of the acceptance probabilities up to it, is at least
    ``min_gain``. [S, K] -> [S] int64."""
    gain = torch.cumprod(confidence.clamp(0.0, 1.0), dim=1)
    return (gain >= min_gain).to(torch.int64).cumprod(dim=1).sum(dim=1)


def param_count(cfg: DSparkConfig, own_embedding: bool) -> int:
    """The drafter's weights (the target's shared LM head not counted), for the memory plan."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q = h * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * heads * qk if cfg.q_lora_rank else h * heads * qk
    attn = (
        q + h * cfg.cache_width + cfg.kv_lora_rank + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    )
    attn += heads * cfg.v_head_dim * h
    layer = attn + 3 * h * cfg.intermediate_size + 2 * h
    n_taps = len(cfg.target_layer_ids)
    total = cfg.num_hidden_layers * layer + n_taps * cfg.target_hidden_size * h + h + h
    total += n_taps * cfg.target_hidden_size if cfg.fc_norm else 0
    total += 2 * cfg.vocab_size * cfg.markov_rank
    total += (h + cfg.markov_rank + 1) if cfg.confidence_head else 0
    total += cfg.vocab_size * h if own_embedding else 0
    return total


def dspark_footprint(model_dir, target_config, dtype_bytes: int):
    """(weight bytes, context-cache bytes per token) of a DSpark drafter, from its config.json alone
    (``embed_tokens`` counted when the checkpoint holds it: its size is read from the safetensors
    header), for the memory plan."""

    path = Path(model_dir)
    _, d = read_drafter_config(path)
    cfg = DSparkConfig.from_dict(
        d,
        target_config.num_hidden_layers,
        target_config.hidden_size,
        target_config.vocab_size,
        bool(getattr(target_config, "attn_res_block_size", None)),
    )
    own = False
    for f in path.glob("*.safetensors"):
        with open(f, "rb") as fh:
            header = fh.read(int.from_bytes(fh.read(8), "little"))
        own = own or b'embed_tokens.weight"' in header
    return DrafterFootprint(param_count(cfg, own) * dtype_bytes, cfg.num_hidden_layers * cfg.cache_width * dtype_bytes)
