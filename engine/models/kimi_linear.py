"""Kimi Linear (``kimi_linear``, e.g. Kimi-Linear-48B-A3B) and Kimi K3 (``kimi_k3``, the same text
model inside a vision-language wrapper).

A hybrid stack: KDA (Kimi Delta Attention, linear attention with a fixed-size state per sequence)
and NoPE MLA layers, placed by the config's 1-indexed ``linear_attn_config.kda_layers`` /
``full_attn_layers`` lists; a dense first MLP, then MoE (latent MoE in K3). K3 adds SiTU at every
gated MLP, a sigmoid output gate on MLA, and attention residuals (``engine.layers.attn_res``).

Module and parameter names follow Hugging Face's checkpoint names; ``checkpoint_target`` maps the
checkpoint's MoE spellings (``block_sparse_moe.``, ``experts.E.w1/w2/w3``) onto them. The
declarations the engine builds from are described in ``engine.registry``.
References: transformers ``models/kimi_linear/modeling_kimi_linear.py``; Kimi Linear paper
arXiv:2510.26692; Kimi K3 tech report arXiv:2607.24653.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from kimitui.engine.config import ModelConfig
from kimitui.engine.kv_cache.pool import CacheSpec, MLACacheSpec
from kimitui.engine.kv_cache.state import KDAStateSpec
from kimitui.engine.layers.activation import GatedActivation
from kimitui.engine.layers.attn_metadata import AttentionMetadata
from kimitui.engine.layers.attn_res import AttnResProj, DepthBlocks
from kimitui.engine.layers.embedding import LMHead, VocabEmbedding
from kimitui.engine.layers.kda import KDAConfig, KimiDeltaAttention
from kimitui.engine.layers.latent_moe import KimiMoE
from kimitui.engine.layers.mla import MLAttention
from kimitui.engine.layers.mlp import MLP
from kimitui.engine.layers.norm import RMSNorm
from kimitui.engine.models.common import derive_weights, prepare_experts, routing_stats, skip_reason
from kimitui.engine.parallel.state import SINGLE, ParallelState
from kimitui.engine.registry import WeightTarget
from kimitui.kernels.backend import REFERENCE, Backend
from kimitui.kernels.reference import attn_res_mix

# checkpoint MoE spellings -> module names: K3 and transformers' save_pretrained write the MoE (and
# Kimi Linear's dense first layer) under block_sparse_moe., experts as w1 (gate), w3 (up), w2 (down)
_MOE = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.(.+)$")
_W_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def _kda_config(config: ModelConfig):
    la = config.linear_attn
    return KDAConfig.from_linear_attn_config(config.hidden_size, dict(la.raw), config.rms_norm_eps, config.quantization)


class KimiDecoderLayer(nn.Module):
    param_class = "attention"  # the norms and AttnRes mixes; self_attn and mlp declare their own
    ops: Backend = REFERENCE  # the model's backend (the AttnRes mixes), set when it is loaded

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        par: ParallelState,
        placement_row: list[int] | None,
        dtype: torch.dtype,
    ):
        super().__init__()
        c = config
        prefix = f"model.layers.{layer_idx}"
        self.layer_idx, self.par = layer_idx, par
        self.is_kda = c.is_kda_layer(layer_idx)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        if self.is_kda:
            self.self_attn = KimiDeltaAttention(_kda_config(c), f"{prefix}.self_attn", par, dtype)
        else:
            self.self_attn = MLAttention(c, f"{prefix}.self_attn", None, par, dtype)  # NoPE: no rotary at all
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        if c.is_moe_layer(layer_idx):
            self.mlp = KimiMoE(c, f"{prefix}.mlp", par, placement_row, dtype)
        else:
            self.mlp = MLP(
                c.hidden_size,
                c.intermediate_size,
                c.quantization,
                f"{prefix}.mlp",
                par,
                dtype,
                act=GatedActivation.from_config(c),
            )
        self.block_size = c.attn_res_block_size
        if self.block_size:
            self.self_attention_res_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
            self.self_attention_res_proj = AttnResProj(c.hidden_size, dtype)
            self.mlp_res_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
            self.mlp_res_proj = AttnResProj(c.hidden_size, dtype)

    def _attn(self, h: torch.Tensor, meta: AttentionMetadata, cache, last: bool) -> torch.Tensor:
        return self._attn_normed(self.input_layernorm(h), meta, cache, last)

    def _attn_normed(self, x: torch.Tensor, meta: AttentionMetadata, cache, last: bool) -> torch.Tensor:
        """Attention output of the normed input; in the last layer only ``meta.out_rows``' rows when
        those are set."""
        if self.is_kda:
            a = self.self_attn(x, meta, cache)  # every row: the state must see all of them
            return a.index_select(0, meta.out_rows) if last and meta.out_rows is not None else a
        return self.self_attn(x, meta, cache, last)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self._mlp_normed(self.post_attention_layernorm(h))

    def _mlp_normed(self, x: torch.Tensor) -> torch.Tensor:
        # one all-reduce for routed experts, shared experts and dense MLP shards together
        return self.par.all_reduce(self.mlp(x))

    def forward(self, h: torch.Tensor, meta: AttentionMetadata, cache, last: bool = False) -> torch.Tensor:
        a = self._attn(h, meta, cache, last)
        if last and meta.out_rows is not None:
            h = h.index_select(0, meta.out_rows)
        h = h + a
        return h + self._mlp(h)

    def forward_attn_res(
        self, prefix: torch.Tensor, blocks: DepthBlocks, meta: AttentionMetadata, cache, last: bool = False
    ) -> tuple[torch.Tensor, DepthBlocks]:
        """The AttnRes form (see ``engine.layers.attn_res``): ``prefix`` [T, D] is the running sum of
        the current block, ``blocks`` the per-token snapshots. -> (new prefix, new blocks).

        Each mix runs with the norm after it as one backend call (one launch on a device), the
        snapshot that begins a block written by the first, the running sum's add by the second."""
        ln, post = self.input_layernorm, self.post_attention_layernorm
        snapshot = self.layer_idx % self.block_size == 0
        x, _ = self.ops.attn_res_mix_norm(
            prefix,
            blocks.buf,
            blocks.n,
            self.self_attention_res_norm.weight,
            self.self_attention_res_norm.eps,
            self.self_attention_res_proj.weight,
            ln.weight,
            ln.eps,
            save=snapshot,
        )
        n = blocks.n + 1 if snapshot else blocks.n
        blocks = DepthBlocks(blocks.buf, n)
        a = self._attn_normed(x, meta, cache, last)
        if last and meta.out_rows is not None:
            prefix = prefix.index_select(0, meta.out_rows)
            blocks = blocks.select_rows(meta.out_rows)
        mix = (self.mlp_res_norm.weight, self.mlp_res_norm.eps, self.mlp_res_proj.weight, post.weight, post.eps)
        if snapshot:  # the block's sum restarts from this attention output
            x, prefix = self.ops.attn_res_mix_norm(a, blocks.buf, n, *mix)
        else:
            x, prefix = self.ops.attn_res_mix_norm(prefix, blocks.buf, n, *mix, delta=a)
        return prefix + self._mlp_normed(x), blocks


class KimiLinearModel(nn.Module):
    param_class = "final_norm"  # the final norm and mix; embedding and layers declare their own
    ops: Backend = REFERENCE  # the model's backend (the output mix), set when it is loaded

    def __init__(
        self, config: ModelConfig, par: ParallelState, expert_placement: list[list[int]] | None, dtype: torch.dtype
    ):
        super().__init__()
        c = config
        self.embed_tokens = VocabEmbedding(c.vocab_size, c.hidden_size, par, dtype)
        rows = expert_placement or [None] * c.num_hidden_layers
        self.layers = nn.ModuleList(
            KimiDecoderLayer(c, i, par, rows[i] or None, dtype) for i in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.attn_res = bool(c.attn_res_block_size)
        if self.attn_res:
            self.output_attn_res_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
            self.output_attn_res_proj = AttnResProj(c.hidden_size, dtype)
        # Block drafters (DSpark) read a few layers' hidden states (see set_aux_hidden_layers); None
        # keeps the plain loop, so a model without a drafter pays nothing.
        self.aux_layers: tuple[int, ...] | None = None
        self.aux_stream = "prefix"
        self.aux_hidden: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, caches: list) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if self.aux_layers is not None:
            return self._forward_capturing(h, meta, caches)
        last = len(self.layers) - 1
        if not self.attn_res:
            for i, (layer, cache) in enumerate(zip(self.layers, caches)):
                h = layer(h, meta, cache, last=i == last)
            return self.norm(h)
        blocks = DepthBlocks.for_model(len(self.layers), self.layers[0].block_size, h)
        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            h, blocks = layer.forward_attn_res(h, blocks, meta, cache, last=i == last)
        out, _ = self.ops.attn_res_mix_norm(
            h,
            blocks.buf,
            blocks.n,
            self.output_attn_res_norm.weight,
            self.output_attn_res_norm.eps,
            self.output_attn_res_proj.weight,
            self.norm.weight,
            self.norm.eps,
        )
        return out

    def _forward_capturing(self, h: torch.Tensor, meta: AttentionMetadata, caches: list) -> torch.Tensor:
        """``forward`` that also leaves ``aux_hidden`` [T, len(aux_layers) * D]: for each capture id k
        (ascending), the hidden state entering layer k for every row of the step (k = 0: the embedding,
        k = L: after the last layer). With attention residuals it is, by ``aux_stream``, the running
        block sum (``prefix``) or the AttnRes mix layer k's attention reads, before its norm
        (``attn_res``; for k = L the model's output mix before the final norm). When k = L is captured
        the last layer computes every row and the rows to keep are taken after it."""
        ids, n_layers, d = self.aux_layers, len(self.layers), h.shape[-1]
        aux = h.new_empty(h.shape[0], len(ids) * d)
        cols = {k: aux[:, j * d : (j + 1) * d] for j, k in enumerate(ids)}
        take_after = n_layers in cols and meta.out_rows is not None
        blocks = DepthBlocks.for_model(n_layers, self.layers[0].block_size, h) if self.attn_res else None

        def capture(k: int) -> None:
            if blocks is not None and self.aux_stream == "attn_res" and blocks.n:
                if k < n_layers:
                    norm, proj = self.layers[k].self_attention_res_norm, self.layers[k].self_attention_res_proj
                else:
                    norm, proj = self.output_attn_res_norm, self.output_attn_res_proj
                cols[k].copy_(attn_res_mix(h, list(blocks.filled), norm.weight, norm.eps, proj.weight))
            else:
                cols[k].copy_(h)

        for i, (layer, cache) in enumerate(zip(self.layers, caches)):
            if i in cols:
                capture(i)
            last = i == n_layers - 1 and not take_after
            if blocks is None:
                h = layer(h, meta, cache, last=last)
            else:
                h, blocks = layer.forward_attn_res(h, blocks, meta, cache, last=last)
        if n_layers in cols:
            capture(n_layers)
        if take_after:
            h = h.index_select(0, meta.out_rows)
            blocks = blocks.select_rows(meta.out_rows) if blocks is not None else None
        self.aux_hidden = aux
        if blocks is None:
            return self.norm(h)
        out, _ = self.ops.attn_res_mix_norm(
            h,
            blocks.buf,
            blocks.n,
            self.output_attn_res_norm.weight,
            self.output_attn_res_norm.eps,
            self.output_attn_res_proj.weight,
            self.norm.weight,
            self.norm.eps,
        )
        return out


class KimiLinearForCausalLM(nn.Module):
    """Kimi Linear and Kimi K3 text model. ``forward(input_ids, meta, caches)``: ``caches[i]`` is
    layer i's paged MLA latent cache tensor or its ``KDAState`` (see ``cache_specs``)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        max_position: int | None = None,
        par: ParallelState = SINGLE,
        expert_placement: list[list[int]] | None = None,
    ):
        """``dtype``: of the dense weights (KDA's A_log, dt_bias, conv weights and the router stay fp32).
        ``max_position`` is unused: NoPE layers have no position tables."""
        super().__init__()
        self.config = config
        self.par = par
        self.model = KimiLinearModel(config, par, expert_placement, dtype)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, config.quantization, par, dtype)
        if config.tie_word_embeddings:  # one parameter, so neither the loader nor the planner sees two
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, caches: list) -> torch.Tensor:
        """Hidden states [T, D] (or [K, D] for ``meta.out_rows``) for a flattened batch."""
        return self.model(input_ids, meta, caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [N, V] fp32

    def set_aux_hidden_layers(self, layer_ids, stream: str = "prefix") -> None:
        """Keep, after each forward, the hidden states a block drafter reads in ``aux_hidden``: for each
        capture id k (0..num_hidden_layers) the state entering layer k (layer k - 1's output), from the
        AttnRes ``stream`` (``prefix`` or ``attn_res``, see ``KimiLinearModel._forward_capturing``). Ids
        are kept in ascending order. None (or empty) turns capturing off."""
        if not layer_ids:
            self.model.aux_layers = self.model.aux_hidden = None
            return
        n = self.config.num_hidden_layers
        ids = sorted(int(k) for k in layer_ids)
        if len(set(ids)) != len(ids) or not all(0 <= k <= n for k in ids):
            raise ValueError(
                f"aux hidden layer ids must be distinct and in 0..{n} (the target has {n} layers), "
                f"got {list(layer_ids)}"
            )
        if stream not in ("prefix", "attn_res"):
            raise ValueError(f"aux hidden stream {stream!r}: supported prefix, attn_res")
        if stream == "attn_res" and not self.model.attn_res:
            raise ValueError("aux hidden stream 'attn_res' needs a model with attention residuals")
        self.model.aux_layers, self.model.aux_stream, self.model.aux_hidden = tuple(ids), stream, None

    @property
    def aux_hidden(self) -> torch.Tensor | None:
        """The last forward's aux hidden states [T, n_aux * hidden] (None when capturing is off)."""
        return self.model.aux_hidden

    def post_load(self, ops: Backend) -> None:
        """Once the weights are in and every module has its backend: derived weights, the experts' layout."""
        derive_weights(self.model.layers)
        prepare_experts(self.model.layers, self.model.norm.weight.dtype)
        for layer in self.model.layers:  # attention and MoE in one call each where the backend has them
            layer.self_attn.fused = ops.fuse_attention(layer.self_attn)
            if isinstance(layer.mlp, KimiMoE):
                layer.mlp.fused = ops.fuse_latent_moe(layer.mlp)

    # -- declarations (see engine.registry) ------------------------------------------------
    def checkpoint_target(self, name: str) -> WeightTarget | str:
        """Where checkpoint tensor ``name`` (prefix removed) goes, or why it is skipped. The MoE
        (and transformers' dense first layer) sits under block_sparse_moe., loaded into mlp.;
        experts.E.w1 / w3 / w2 are the gate / up / down of expert E."""
        skip = skip_reason(name, self.config.num_hidden_layers)
        if skip is not None:
            return skip
        name = _MOE.sub(r"\1mlp.", name)
        m = _EXPERT.match(name)
        if m:
            return WeightTarget(m[1], f"{_W_NAMES.get(m[3], m[3])}.{m[4]}", int(m[2]))
        module, _, leaf = name.rpartition(".")
        return WeightTarget(module, leaf)

    def cache_specs(self, dtype: torch.dtype) -> list[CacheSpec]:
        """Per layer: the paged MLA latent cache (``dtype``) or the KDA state (fp32) on this rank."""
        specs: list[CacheSpec] = []
        for layer in self.model.layers:
            if layer.is_kda:
                la = self.config.linear_attn
                h0, h1 = self.par.range(la.num_heads)
                specs.append(
                    KDAStateSpec(
                        num_heads=h1 - h0,
                        head_k_dim=la.head_dim,
                        head_v_dim=la.head_dim,
                        conv_kernel=la.short_conv_kernel_size,
                    )
                )
            else:
                specs.append(MLACacheSpec(dim=self.config.kv_cache_dim, dtype=dtype))
        return specs

    def routing_stats(self) -> dict[int, list[int]]:
        return routing_stats(self.model.layers)
