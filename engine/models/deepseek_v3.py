"""DeepSeek-V3 architecture: Kimi K2, K2 Thinking, K2.5 and K2.6 text models.

Module and parameter names follow Hugging Face's checkpoint names (``model.layers.3.self_attn
.q_a_proj.weight``) so loading is a copy by name; routed experts are the one exception, stacked
per layer (see ``RoutedExperts``). The declarations the engine builds from (checkpoint name
mapping, cache specs, planner classes) are described in ``engine.registry``.
"""

from __future__ import annotations

import torch
from torch import nn

from kimitui.engine.config import ModelConfig
from kimitui.engine.kv_cache.pool import CacheSpec, MLACacheSpec
from kimitui.engine.layers.attn_metadata import AttentionMetadata
from kimitui.engine.layers.embedding import LMHead, VocabEmbedding
from kimitui.engine.layers.mla import MLAttention
from kimitui.engine.layers.mlp import MLP
from kimitui.engine.layers.moe import MoE
from kimitui.engine.layers.norm import RMSNorm
from kimitui.engine.layers.rope import YarnRotaryEmbedding
from kimitui.engine.models.common import derive_weights, prepare_experts, routing_stats, skip_reason
from kimitui.engine.parallel.state import SINGLE, ParallelState
from kimitui.engine.registry import WeightTarget
from kimitui.kernels.backend import Backend


class DecoderLayer(nn.Module):
    param_class = "attention"  # the two norms; self_attn and mlp declare their own

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        rope: YarnRotaryEmbedding,
        par: ParallelState,
        placement_row: list[int] | None,
        dtype: torch.dtype,
    ):
        super().__init__()
        prefix = f"model.layers.{layer_idx}"
        self.par = par
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = MLAttention(config, f"{prefix}.self_attn", rope, par, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if config.is_moe_layer(layer_idx):
            self.mlp = MoE(config, f"{prefix}.mlp", par, placement_row, dtype)
        else:
            self.mlp = MLP(
                config.hidden_size, config.intermediate_size, config.quantization, f"{prefix}.mlp", par, dtype
            )
        # Each residual half in one call where the backend offers it (``Backend.fuse_decoder_layer``,
        # asked once after loading); None: every step runs op by op.
        self.fused = None

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        cache: torch.Tensor,
        last: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """vLLM's residual form: the hidden state is ``x + residual`` (``x`` alone when ``residual`` is
        None, as after the embedding) and the layer returns ``(out, residual')`` whose sum is its
        output, leaving the last addition to the next norm (each norm adds the residual in its own
        launch: a layer never launches a residual add). ``x`` must be a fresh tensor the layer may
        overwrite. ``last``: the final layer, which returns only ``meta.out_rows`` when those are set."""
        fused = self.fused
        if fused is not None and fused.attention_fusable(x, meta):
            # the backend's whole-half calls take and return the hidden state itself
            x = x if residual is None else x.add_(residual)
            x = fused.attention(x, meta, cache)  # x + self_attn(input_layernorm(x))
            if fused.ffn_fusable(x):
                return fused.ffn(x), None  # x + mlp(post_attention_layernorm(x))
            packed = fused.packed_ffn
            if packed is not None and packed.fusable(x):
                return packed(x)  # (mlp(post_attention_layernorm(x)), x), as below, the same calls
            h = self.post_attention_layernorm(x)
            if isinstance(self.mlp, MoE):  # the router computes in fp32: give it h's exact fp32 copy, as
                # add_forward_fp32 does below (a bf16 h sent the CPU's router to its PyTorch path)
                return self.par.all_reduce(self.mlp(h, h.float())), x
        else:
            if residual is None:
                h, residual = self.input_layernorm(x), x
            else:  # the previous layer's output added to its residual and normed, in one launch
                h, residual = self.input_layernorm.add_forward(x, residual)
            a = self.self_attn(h, meta, cache, last)
            if last and meta.out_rows is not None:
                residual = residual.index_select(0, meta.out_rows)
            if fused is not None and fused.ffn_fusable(a):
                return fused.ffn(a.add_(residual)), None
            # residual + a and its norm in one backend call (one launch on a device); the sum goes into
            # a, the attention's fresh output: on a CPU each new prefill-sized tensor costs more in page
            # faults than the addition itself.
            if isinstance(self.mlp, MoE):  # the router's fp32 input from the norm's launch, not a cast
                h, x, h32 = self.post_attention_layernorm.add_forward_fp32(a, residual)
                return self.par.all_reduce(self.mlp(h, h32)), x
            h, x = self.post_attention_layernorm.add_forward(a, residual)
        # one all-reduce for routed experts, shared experts and dense MLP shards together; the residual
        # add is the next norm's
        return self.par.all_reduce(self.mlp(h)), x


class DeepseekV3Model(nn.Module):
    param_class = "final_norm"  # the final norm; embedding and layers declare their own

    def __init__(
        self,
        config: ModelConfig,
        max_position: int,
        par: ParallelState,
        expert_placement: list[list[int]] | None,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, par, dtype)
        rope = YarnRotaryEmbedding(config.qk_rope_head_dim, config.rope_theta, config.rope_scaling, max_position)
        rows = expert_placement or [None] * config.num_hidden_layers
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, rope, par, rows[i] or None, dtype) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # EAGLE-3 drafters read the hidden states of a few layers (see set_aux_hidden_layers); None
        # keeps the plain loop below, so a model without a drafter pays nothing.
        self.aux_layers: tuple[int, ...] | None = None
        self.aux_hidden: torch.Tensor | None = None
        # the backend's loop over every layer's fused halves (Backend.run_fused_layers), or None
        self.run_fused = None

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches: list[torch.Tensor]):
        x, residual = self.embed_tokens(input_ids), None
        if self.aux_layers is not None:
            return self._forward_capturing(x, meta, kv_caches)
        if self.run_fused is not None:  # a decode step whose every layer is the backend's two blocks
            h = self.run_fused([layer.fused for layer in self.layers], x, meta, kv_caches)
            if h is not None:
                return self.norm(h)
        last = len(self.layers) - 1
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            x, residual = layer(x, residual, meta, cache, last=i == last)
        return self.norm(x) if residual is None else self.norm.add_forward(x, residual)[0]

    def _forward_capturing(self, x: torch.Tensor, meta: AttentionMetadata, kv_caches: list[torch.Tensor]):
        """``forward`` that also leaves ``aux_hidden`` [T, len(aux_layers) * D]: for each aux id k, in
        ascending order, the hidden state entering layer k (the embedding for k = 0, the final
        pre-norm hidden for k = L), for every row of the step. Id k is what vLLM's
        ``aux_hidden_state_layers`` and EAGLE-3 training (``hidden_states[k]`` of Hugging Face's
        ``output_hidden_states``) mean by it. When the last layer's output is an aux state, that
        layer computes every row and the rows to keep (``meta.out_rows``) are taken after it."""
        ids, n_layers, d = self.aux_layers, len(self.layers), x.shape[-1]
        aux = x.new_empty(x.shape[0], len(ids) * d)
        cols = {k: aux[:, j * d : (j + 1) * d] for j, k in enumerate(ids)}
        residual = None
        take_after = n_layers in cols and meta.out_rows is not None

        def capture(k: int) -> None:
            # a fresh sum (or copy): the next layer may overwrite x, and the fused CPU path hands
            # over the whole hidden state with residual None
            if residual is None:
                cols[k].copy_(x)
            else:
                torch.add(x, residual, out=cols[k])

        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            if i in cols:
                capture(i)
            x, residual = layer(x, residual, meta, cache, last=i == n_layers - 1 and not take_after)
        if n_layers in cols:
            capture(n_layers)
        if take_after:
            x = x.index_select(0, meta.out_rows)
            residual = None if residual is None else residual.index_select(0, meta.out_rows)
        self.aux_hidden = aux
        return self.norm(x) if residual is None else self.norm.add_forward(x, residual)[0]


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        max_position: int | None = None,
        par: ParallelState = SINGLE,
        expert_placement: list[list[int]] | None = None,
    ):
        """``dtype``: of the dense weights (see engine.registry for the others).
        ``expert_placement[layer][expert]``: the rank that computes the expert on its device, or -1
        for host RAM (computed by the CPU); None spreads experts evenly over the ranks."""
        super().__init__()
        self.config = config
        self.par = par
        self.model = DeepseekV3Model(
            config, max_position or config.max_position_embeddings, par, expert_placement, dtype
        )
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, config.quantization, par, dtype)
        if config.tie_word_embeddings:  # one parameter, so neither the loader nor the planner sees two
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches: list[torch.Tensor]):
        """Hidden states [T, D] for a flattened batch (see AttentionMetadata for the row layout), or
        [K, D] for the rows ``meta.out_rows`` when that is set."""
        return self.model(input_ids, meta, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [N, V] fp32

    def set_aux_hidden_layers(self, layer_ids) -> None:
        """Keep, after each forward, the hidden states EAGLE-3 drafters read in ``aux_hidden``: for
        each id k (0..num_hidden_layers) the hidden state entering layer k, i.e. the previous layer's
        output plus its residual (see ``DeepseekV3Model._forward_capturing``). Ids are taken in
        ascending order, as vLLM concatenates them. None (or empty) turns capturing off."""
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
        self.model.aux_layers = tuple(ids)
        self.model.aux_hidden = None

    @property
    def aux_hidden(self) -> torch.Tensor | None:
        """The last forward's aux hidden states [T, n_aux * hidden] (None when capturing is off)."""
        return self.model.aux_hidden

    def post_load(self, ops: Backend) -> None:
        """Once the weights are in and every module has its backend (``ops``, the model's): derived
        weights, the experts' layout, each decoder layer's fused halves where the backend has them."""
        derive_weights(self.model.layers)
        # the experts' layout first: a fused FFN over packed experts reads their CPU tiles
        prepare_experts(self.model.layers, self.model.norm.weight.dtype)
        for layer in self.model.layers:
            layer.fused = ops.fuse_decoder_layer(layer)
        if any(layer.fused is not None for layer in self.model.layers):
            self.model.run_fused = ops.run_fused_layers

    # -- declarations (see engine.registry) ------------------------------------------------
    def cache_specs(self, dtype: torch.dtype) -> list[CacheSpec]:
        """Every layer is MLA: a paged latent of kv_lora_rank + qk_rope_head_dim values per token."""
        return [MLACacheSpec(dim=self.config.kv_cache_dim, dtype=dtype)] * self.config.num_hidden_layers

    def checkpoint_target(self, name: str) -> WeightTarget | str:
        """Where checkpoint tensor ``name`` goes (Hugging Face names: the module path is the name
        up to its last dot), or why it is skipped."""
        if name.endswith("rotary_emb.inv_freq"):
            return "rotary inv_freq"
        skip = skip_reason(name, self.config.num_hidden_layers)
        if skip is not None:
            return skip
        parts = name.split(".")
        if parts[3:5] == ["mlp", "experts"]:
            experts = ".".join(parts[:5])
            if parts[5].isdigit():  # experts.E.{gate,up,down}_proj.<suffix>: one expert's tensor
                return WeightTarget(experts, ".".join(parts[6:]), int(parts[5]))
            return WeightTarget(experts, ".".join(parts[5:]))  # all experts in one tensor
        module, _, leaf = name.rpartition(".")
        return WeightTarget(module, leaf)

    def routing_stats(self) -> dict[int, list[int]]:
        return routing_stats(self.model.layers)
