"""Exact parameter counts and bytes of every weight of a DeepSeek-V3 / Kimi K2.x checkpoint,
for the whole model and per tensor-parallel rank.

Works from a ``ModelConfig`` alone (no tensors, no torch) so ``kimitui plan`` can size a model
before it is downloaded. Names are Hugging Face module names without the ``language_model.``
prefix, the form ``QuantConfig.applies_to`` expects.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.config import ModelConfig

# Bytes of one element of an unquantised tensor.
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_TORCH_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}

PARTS = ("embedding", "lm_head", "final_norm", "attention", "dense_mlp", "router",
         "shared_experts", "routed_experts")


def compute_dtype(config: ModelConfig) -> str:
    """'bf16', 'fp16' or 'fp32': the dtype of unquantised weights, activations and the KV cache."""
    return _TORCH_DTYPE.get(config.torch_dtype.removeprefix("torch."), "bf16")


@dataclass(frozen=True)
class Weight:
    """One checkpoint tensor family: a Linear's weight (+ scales) or a 1-D norm / bias."""

    name: str                 # HF module name, e.g. "model.layers.3.self_attn.q_b_proj"
    part: str                 # one of PARTS
    shape: tuple[int, ...]    # [out, in] for linears, [n] for norms and biases
    fmt: str                  # "bf16" / "fp16" / "fp32" (plain) or "fp8" / "int4" / "mxfp4"
    block: tuple[int, int] = (128, 128)   # FP8 scale block [out, in]
    group: int = 32                       # INT4 / MXFP4 group along the input dim

    @property
    def params(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.slice_bytes()

    def slice_bytes(self, rows: int | None = None, cols: int | None = None) -> int:
        """Bytes of a [rows, cols] shard stored in this weight's format (scales included)."""
        if len(self.shape) == 1:
            return (self.shape[0] if rows is None else rows) * DTYPE_BYTES.get(self.fmt, 2)
        n = self.shape[0] if rows is None else rows
        k = self.shape[1] if cols is None else cols
        if self.fmt in DTYPE_BYTES:
            return n * k * DTYPE_BYTES[self.fmt]
        if self.fmt == "fp8":
            # e4m3 payload + fp32 weight_scale_inv [ceil(n/128), ceil(k/128)]
            bn, bk = self.block
            return n * k + 4 * math.ceil(n / bn) * math.ceil(k / bk)
        if self.fmt == "int4":
            # int32 words of 8 nibbles along the input dim + bf16 scale per group
            return 4 * n * math.ceil(k / 8) + 2 * n * math.ceil(k / self.group)
        if self.fmt == "mxfp4":
            # two e2m1 per byte + one e8m0 exponent byte per group
            return n * math.ceil(k / 2) + n * math.ceil(k / self.group)
        raise ValueError(f"unknown weight format {self.fmt!r}")


@dataclass(frozen=True)
class PartSize:
    """Parameters and bytes of a group of weights."""

    params: int = 0
    nbytes: int = 0

    def __add__(self, other: "PartSize") -> "PartSize":
        return PartSize(self.params + other.params, self.nbytes + other.nbytes)

    def __mul__(self, k: int) -> "PartSize":
        return PartSize(self.params * k, self.nbytes * k)


@dataclass(frozen=True)
class ModelSize:
    """Sizes of every part of the text model; ``parts`` sums over all layers."""

    parts: dict[str, PartSize]
    routed_expert: PartSize        # one expert (gate + up + down) of one MoE layer
    num_moe_layers: int
    n_routed_experts: int

    @property
    def total(self) -> PartSize:
        out = PartSize()
        for p in self.parts.values():
            out = out + p
        return out

    @property
    def non_expert(self) -> PartSize:
        return self.total + PartSize(-self.parts["routed_experts"].params, -self.parts["routed_experts"].nbytes)


def weight_format(config: ModelConfig, module_name: str) -> str:
    """Storage format of the Linear ``module_name`` (same rule as ``engine.layers.linear.linear_format``).

    The router (``mlp.gate``) is never quantised: it is not an ``nn.Linear`` in the HF model, so
    compressed-tensors' "Linear" target skips it, and FP8 checkpoints keep it in bf16. FP8
    checkpoints also keep ``lm_head`` in bf16 although their config has no ignore list.
    """
    q = config.quantization
    plain = compute_dtype(config)
    if q is None or module_name.endswith("mlp.gate") or not q.applies_to(module_name):
        return plain
    if q.method == "fp8" and module_name == "lm_head":
        return plain
    return q.method


def _linear(config: ModelConfig, name: str, part: str, out: int, inp: int) -> Weight:
    q = config.quantization
    return Weight(name, part, (out, inp), weight_format(config, name),
                  block=q.weight_block_size if q else (128, 128), group=q.group_size if q else 32)


def _norm(config: ModelConfig, name: str, part: str, n: int) -> Weight:
    return Weight(name, part, (n,), compute_dtype(config))


def _mlp(config: ModelConfig, prefix: str, part: str, inter: int) -> list[Weight]:
    h = config.hidden_size
    return [_linear(config, f"{prefix}.gate_proj", part, inter, h),
            _linear(config, f"{prefix}.up_proj", part, inter, h),
            _linear(config, f"{prefix}.down_proj", part, h, inter)]


def layer_weights(config: ModelConfig, layer: int) -> list[Weight]:
    """Every weight of decoder layer ``layer`` except the routed experts (see ``routed_expert_weights``)."""
    c, h, heads = config, config.hidden_size, config.num_attention_heads
    p = f"model.layers.{layer}"
    a = f"{p}.self_attn"
    out = [_norm(c, f"{p}.input_layernorm", "attention", h),
           _norm(c, f"{p}.post_attention_layernorm", "attention", h)]
    if c.q_lora_rank:
        out += [_linear(c, f"{a}.q_a_proj", "attention", c.q_lora_rank, h),
                _norm(c, f"{a}.q_a_layernorm", "attention", c.q_lora_rank),
                _linear(c, f"{a}.q_b_proj", "attention", heads * c.qk_head_dim, c.q_lora_rank)]
    else:
        out.append(_linear(c, f"{a}.q_proj", "attention", heads * c.qk_head_dim, h))
    out += [_linear(c, f"{a}.kv_a_proj_with_mqa", "attention", c.kv_lora_rank + c.qk_rope_head_dim, h),
            _norm(c, f"{a}.kv_a_layernorm", "attention", c.kv_lora_rank),
            _linear(c, f"{a}.kv_b_proj", "attention", heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
            _linear(c, f"{a}.o_proj", "attention", h, heads * c.v_head_dim)]
    if not c.is_moe_layer(layer):
        return out + _mlp(c, f"{p}.mlp", "dense_mlp", c.intermediate_size)
    out += [_linear(c, f"{p}.mlp.gate", "router", c.n_routed_experts, h),
            Weight(f"{p}.mlp.gate.e_score_correction_bias", "router", (c.n_routed_experts,), "fp32")]
    if c.n_shared_experts:
        out += _mlp(c, f"{p}.mlp.shared_experts", "shared_experts", c.moe_intermediate_size * c.n_shared_experts)
    return out


def routed_expert_weights(config: ModelConfig, layer: int, expert: int = 0) -> list[Weight]:
    """gate/up/down of one routed expert; every expert of a layer has the same shapes and format."""
    return _mlp(config, f"model.layers.{layer}.mlp.experts.{expert}", "routed_experts",
                config.moe_intermediate_size)


def top_weights(config: ModelConfig) -> list[Weight]:
    """Embedding, final norm and lm_head (untied unless ``tie_word_embeddings``)."""
    c = config
    out = [Weight("model.embed_tokens", "embedding", (c.vocab_size, c.hidden_size), compute_dtype(c)),
           _norm(c, "model.norm", "final_norm", c.hidden_size)]
    if not c.tie_word_embeddings:
        out.append(_linear(c, "lm_head", "lm_head", c.vocab_size, c.hidden_size))
    return out


def moe_layers(config: ModelConfig) -> list[int]:
    """Indices of the MoE decoder layers (the MTP layer, which loaders skip, is not counted)."""
    return [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]


def expert_size(config: ModelConfig, layer: int) -> PartSize:
    """Parameters and bytes of one routed expert of ``layer``."""
    ws = routed_expert_weights(config, layer)
    return PartSize(sum(w.params for w in ws), sum(w.nbytes for w in ws))


def count_params(config: ModelConfig) -> ModelSize:
    """Exact parameter counts and bytes per part of the text model in its checkpoint format.

    Parameters are logical weights (an INT4 [2048, 7168] matrix counts 14,680,064), not counting
    quantisation scales; bytes include the scales. Rotary ``inv_freq`` buffers and the MTP layer
    (``num_nextn_predict_layers``) are left out: loaders skip them.
    """
    parts = {name: PartSize() for name in PARTS}
    for w in top_weights(config):
        parts[w.part] = parts[w.part] + PartSize(w.params, w.nbytes)
    for i in range(config.num_hidden_layers):
        for w in layer_weights(config, i):
            parts[w.part] = parts[w.part] + PartSize(w.params, w.nbytes)
    layers = moe_layers(config)
    one = expert_size(config, layers[0]) if layers else PartSize()
    for i in layers:
        parts["routed_experts"] = parts["routed_experts"] + expert_size(config, i) * config.n_routed_experts
    return ModelSize(parts=parts, routed_expert=one, num_moe_layers=len(layers),
                     n_routed_experts=config.n_routed_experts)


# -- per tensor-parallel rank ---------------------------------------------------------------------

def split_evenly(total: int, parts: int, unit: int = 1) -> tuple[int, ...]:
    """Split ``total`` into ``parts`` shares in multiples of ``unit``, the first shares larger.

    64 heads on 6 GPUs -> (11, 11, 11, 11, 10, 10). A ``total`` that is not a multiple of ``unit``
    makes the last non-empty share short.
    """
    base, extra = divmod(math.ceil(total / unit), parts)
    sizes = [(base + (i < extra)) * unit for i in range(parts)]
    over = sum(sizes) - total
    for i in reversed(range(parts)):
        cut = min(over, sizes[i])
        sizes[i] -= cut
        over -= cut
    return tuple(sizes)


# Which dim of each Linear is split across ranks (everything else is replicated: q_a_proj and
# kv_a_proj_with_mqa produce the shared latent, the router must see all experts on every rank).
_HEAD_ROWS = {"q_b_proj", "q_proj", "kv_b_proj"}
_HEAD_COLS = {"o_proj"}
_FFN_ROWS = {"gate_proj", "up_proj"}
_FFN_COLS = {"down_proj"}
_VOCAB_ROWS = {"embed_tokens", "lm_head"}


def _unit(w: Weight, dim: int) -> int:
    # Shards must not cut an FP8 scale block or an INT4/MXFP4 group (groups run along the input dim).
    if w.fmt == "fp8":
        return w.block[dim]
    if w.fmt in ("int4", "mxfp4") and dim == 1:
        return w.group
    return 1


def non_expert_bytes_per_device(config: ModelConfig, num_devices: int) -> tuple[int, ...]:
    """Bytes of every weight except the routed experts on each tensor-parallel rank."""
    n, heads = num_devices, config.num_attention_heads
    head_split = split_evenly(heads, n)
    vocab_split = split_evenly(config.vocab_size, n)
    out = [0] * n
    weights = top_weights(config)
    for i in range(config.num_hidden_layers):
        weights += layer_weights(config, i)
    for w in weights:
        leaf = w.name.rsplit(".", 1)[-1]
        if len(w.shape) == 1:
            shards = [w.nbytes] * n
        elif leaf in _VOCAB_ROWS:
            shards = [w.slice_bytes(rows=r) for r in vocab_split]
        elif leaf in _HEAD_ROWS:
            shards = [w.slice_bytes(rows=h * (w.shape[0] // heads)) for h in head_split]
        elif leaf in _HEAD_COLS:
            shards = [w.slice_bytes(cols=h * (w.shape[1] // heads)) for h in head_split]
        elif leaf in _FFN_ROWS:
            shards = [w.slice_bytes(rows=r) for r in split_evenly(w.shape[0], n, _unit(w, 0))]
        elif leaf in _FFN_COLS:
            shards = [w.slice_bytes(cols=c) for c in split_evenly(w.shape[1], n, _unit(w, 1))]
        else:
            shards = [w.nbytes] * n
        out = [a + b for a, b in zip(out, shards)]
    return tuple(out)


def kv_bytes_per_token(config: ModelConfig) -> int:
    """MLA latent cache per token over all layers: (kv_lora_rank + qk_rope_head_dim) x layers x dtype."""
    return config.kv_cache_dim * config.num_hidden_layers * DTYPE_BYTES[compute_dtype(config)]
