"""Model configuration read from a checkpoint's ``config.json``."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kimitui.engine.registry import model_family, supported_model_types


class ConfigError(ValueError):
    """A config.json that kimitui cannot use; the message names the file and field."""


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (DeepSeek-V3 / Kimi K2 use YaRN on interleaved rope pairs)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class QuantConfig:
    """How the checkpoint stores weights.

    method: "fp8" (block-scaled e4m3 + weight_scale_inv), "int4" (compressed-tensors
    pack-quantized, symmetric, offset-8 nibbles) or "mxfp4" (e2m1 + e8m0 per 32).
    ignore: module-name patterns left unquantised ("re:" prefix = regular expression).
    """

    method: str
    weight_block_size: tuple[int, int] = (128, 128)
    group_size: int = 32
    ignore: tuple[str, ...] = ()

    def applies_to(self, module_name: str) -> bool:
        """True when the Linear called ``module_name`` (HF name, no prefix) is quantised."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module_name):
                    return False
            elif module_name == pattern or module_name.endswith("." + pattern):
                return False
        return True


@dataclass(frozen=True)
class LinearAttnConfig:
    """``linear_attn_config`` of a Kimi Linear / K3 text config: the KDA layers' shape and which
    layers are KDA. ``kda_layers`` and ``full_attn_layers`` are 1-indexed, as in the checkpoint."""

    num_heads: int
    head_dim: int
    short_conv_kernel_size: int
    kda_layers: tuple[int, ...]
    full_attn_layers: tuple[int, ...]
    gate_lower_bound: float | None = None  # K3's bounded ("safe") forget gate; None: softplus form
    use_full_rank_gate: bool = False  # K3: output gate g_proj [P, D] instead of g_a_proj / g_b_proj
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class ModelConfig:
    """Every field the DeepSeek-V3 / Kimi K2.x maths needs, validated once."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    scoring_func: str
    topk_method: str
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    torch_dtype: str
    quantization: QuantConfig | None
    weight_prefix: str = ""  # the family's prefix on text-model tensors ("language_model." for kimi_k25)
    num_nextn_predict_layers: int = 0
    is_demo: bool = False
    # -- Kimi Linear / Kimi K3 (kimi_linear text config); the defaults are DeepSeek-V3's ------------
    layer_types: tuple[str, ...] = ()  # per layer "linear_attention" (KDA) or "full_attention" (MLA)
    linear_attn: LinearAttnConfig | None = None
    hidden_act: str = "silu"  # "silu" or "situ" at every gated MLP
    situ_beta: float = 1.0  # activation_situ_beta (absent: 1.0, as Moonshot's `beta or 1.0`)
    situ_linear_beta: float | None = None  # activation_situ_linear_beta (absent: up is left as is)
    mla_use_nope: bool = False  # no rotary embedding on the MLA layers
    mla_use_output_gate: bool = False  # sigmoid(g_proj(x)) gates the MLA output before o_proj
    mla_norm_eps: float | None = None  # q_a_layernorm / kv_a_layernorm eps; None: rms_norm_eps
    attn_res_block_size: int | None = None  # attention residuals: layers per snapshot block
    routed_expert_hidden_size: int | None = None  # latent MoE: experts run at this width
    latent_moe_use_norm: bool = False  # RMSNorm (routed_expert_norm) on the latent top-k sum
    vision_model_type: str | None = None  # kimi_k3's vision_config.model_type (its tensors are skipped)
    name: str = ""
    path: str = ""
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # -- derived quantities -------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values cached per token per MLA layer on the absorbed path."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_kda_layer(self, layer_idx: int) -> bool:
        """Whether 0-indexed ``layer_idx`` is a KDA (linear attention) layer."""
        return bool(self.layer_types) and self.layer_types[layer_idx] == "linear_attention"

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_get_mscale(rs.factor, rs.mscale_all_dim)
            scale *= m * m
        return scale

    # -- parsing --------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir)
        cfg_file = path / "config.json" if path.is_dir() else path
        if not cfg_file.is_file():
            raise ConfigError(f"{cfg_file}: config.json not found")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_file}: not valid JSON ({e.msg} at line {e.lineno})") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{cfg_file}: cannot read ({type(e).__name__}: {e})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{cfg_file}: must hold a JSON object of fields, got a {type(raw).__name__}")
        return cls.from_dict(raw, source=str(cfg_file), path=str(cfg_file.parent))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json", path: str = "") -> "ModelConfig":
        model_type = raw.get("model_type")
        family = model_family(model_type)
        if family is None:
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not supported "
                f"(supported: {', '.join(supported_model_types())})"
            )
        text = raw
        prefix = family.weight_prefix
        if family.text_config:
            text = raw.get(family.text_config)
            if not isinstance(text, dict):
                raise ConfigError(
                    f"{source}: field '{family.text_config}' is missing (needed for model_type {model_type})"
                )
            if family.text_model_type and text.get("model_type", family.text_model_type) != family.text_model_type:
                raise ConfigError(
                    f"{source}: field '{family.text_config}.model_type' is {text.get('model_type')!r}; "
                    f"expected {family.text_model_type!r}"
                )
            source = f"{source} {family.text_config}"
        # Hybrid KDA + MLA models (Kimi Linear, Kimi K3): a kimi_linear text config
        hybrid = (family.text_model_type or model_type) == "kimi_linear"
        r = _Reader(text, source, _KIMI_LINEAR_ALIASES if hybrid else {})
        extra = _parse_linear_model(raw, text, r) if hybrid else {}

        rope_theta, rope_scaling = _parse_rope(text, r)
        quant = _parse_quant(text.get("quantization_config") or raw.get("quantization_config"), source)
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        n_routed = r.int("n_routed_experts", 0)
        cfg = cls(
            model_type=model_type,
            vocab_size=r.int("vocab_size"),
            hidden_size=r.int("hidden_size"),
            intermediate_size=r.int("intermediate_size"),
            moe_intermediate_size=r.int("moe_intermediate_size", 0 if n_routed == 0 else None),
            num_hidden_layers=r.int("num_hidden_layers"),
            num_attention_heads=r.int("num_attention_heads"),
            q_lora_rank=r.optional_int("q_lora_rank"),
            kv_lora_rank=r.int("kv_lora_rank"),
            qk_nope_head_dim=r.int("qk_nope_head_dim"),
            qk_rope_head_dim=r.int("qk_rope_head_dim"),
            v_head_dim=r.int("v_head_dim"),
            n_routed_experts=n_routed,
            num_experts_per_tok=r.int("num_experts_per_tok", 0 if n_routed == 0 else None),
            n_shared_experts=r.int("n_shared_experts", 0),
            first_k_dense_replace=r.int("first_k_dense_replace", 0),
            moe_layer_freq=r.int("moe_layer_freq", 1),
            n_group=r.int("n_group", 1),
            topk_group=r.int("topk_group", 1),
            norm_topk_prob=bool(r.raw("norm_topk_prob", True)),
            routed_scaling_factor=r.float("routed_scaling_factor", 1.0),
            scoring_func=str(r.raw("scoring_func", "sigmoid")),
            topk_method=str(text.get("topk_method", "noaux_tc")),
            rms_norm_eps=r.float("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=r.int("max_position_embeddings"),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            bos_token_id=text.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_ids=eos_ids,
            pad_token_id=text.get("pad_token_id", raw.get("pad_token_id")),
            torch_dtype=str(
                text.get("torch_dtype") or text.get("dtype") or raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
            ),
            quantization=quant,
            weight_prefix=prefix,
            num_nextn_predict_layers=r.int("num_nextn_predict_layers", 0),
            is_demo=bool(raw.get("kimitui_demo", False)),
            name=str(raw.get("_name_or_path") or Path(path).name or model_type),
            path=path,
            raw=raw,
            **extra,
        )
        cfg._validate(source)
        return cfg

    def _validate(self, source: str) -> None:
        if self.scoring_func not in ("sigmoid", "softmax"):
            raise ConfigError(f"{source}: field 'scoring_func' is {self.scoring_func!r}; supported: sigmoid, softmax")
        if self.n_routed_experts:
            if self.num_experts_per_tok > self.n_routed_experts:
                raise ConfigError(
                    f"{source}: field 'num_experts_per_tok' ({self.num_experts_per_tok}) exceeds "
                    f"'n_routed_experts' ({self.n_routed_experts})"
                )
            if self.n_routed_experts % self.n_group:
                raise ConfigError(f"{source}: field 'n_group' ({self.n_group}) does not divide n_routed_experts")
            if not 1 <= self.topk_group <= self.n_group:
                raise ConfigError(f"{source}: field 'topk_group' ({self.topk_group}) must be in 1..n_group")
        if self.qk_rope_head_dim % 2 and not self.mla_use_nope:
            raise ConfigError(f"{source}: field 'qk_rope_head_dim' must be even, got {self.qk_rope_head_dim}")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


# Kimi Linear / K3 spell some DeepSeek-V3 keys differently (the K3 config and what transformers'
# KimiLinearConfig writes); the engine's field name first, then the spellings tried after it.
_KIMI_LINEAR_ALIASES = {
    "n_routed_experts": ("num_experts", "num_local_experts"),
    "num_experts_per_tok": ("num_experts_per_token",),
    "n_shared_experts": ("num_shared_experts",),
    "n_group": ("num_expert_group",),
    "norm_topk_prob": ("moe_renormalize",),
    "scoring_func": ("moe_router_activation_func",),
    "max_position_embeddings": ("model_max_length",),
}


class _Reader:
    """Typed access to config fields with errors that name the field."""

    _MISSING = object()

    def __init__(self, d: dict[str, Any], source: str, aliases: dict[str, tuple[str, ...]] | None = None):
        self.d, self.source = d, source
        self.aliases = aliases or {}

    def raw(self, key: str, default: Any = None) -> Any:
        """The value of ``key`` or of its first present alias, else ``default``."""
        for k in (key, *self.aliases.get(key, ())):
            if self.d.get(k) is not None:
                return self.d[k]
        return default

    def _get(self, key: str, default: Any) -> Any:
        # default None or _MISSING: the field is required
        v = self.raw(key)
        if v is None:
            if default is None or default is self._MISSING:
                raise ConfigError(f"{self.source}: required field '{key}' is missing")
            return default
        return v

    def int(self, key: str, default: Any = _MISSING) -> int:
        v = self._get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"{self.source}: field '{key}' must be a non-negative integer, got {v!r}")
        return v

    def optional_int(self, key: str) -> int | None:
        v = self.d.get(key)
        if v in (None, 0):
            return None
        return self.int(key)

    def float(self, key: str, default: Any = _MISSING) -> float:
        v = self._get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{self.source}: field '{key}' must be a number, got {v!r}")
        return float(v)


def _parse_rope(text: dict[str, Any], r: _Reader) -> tuple[float, RopeScaling | None]:
    # transformers 4.x writes rope_theta + rope_scaling; 5.x writes rope_parameters (theta inside).
    params = text.get("rope_parameters") or {}
    scaling = text.get("rope_scaling") or {}
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise ConfigError(f"{r.source}: field '{key}' must be an object (or null), got {value!r}")
    merged = {**params, **scaling}
    theta = text.get("rope_theta", merged.get("rope_theta", 10000.0))
    kind = merged.get("type") or merged.get("rope_type")
    if kind in (None, "default"):
        return float(theta), None
    if kind != "yarn":
        raise ConfigError(f"{r.source}: field 'rope_scaling.type' is {kind!r}; supported: yarn, default")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in merged:
            raise ConfigError(f"{r.source}: required field 'rope_scaling.{key}' is missing")
    return float(theta), RopeScaling(
        factor=float(merged["factor"]),
        original_max_position_embeddings=int(merged["original_max_position_embeddings"]),
        beta_fast=float(merged.get("beta_fast", 32.0)),
        beta_slow=float(merged.get("beta_slow", 1.0)),
        mscale=float(merged.get("mscale", 1.0)),
        mscale_all_dim=float(merged.get("mscale_all_dim", 0.0)),
    )


def _parse_quant(q: dict[str, Any] | None, source: str) -> QuantConfig | None:
    if not q:
        return None
    method = q.get("quant_method")
    if method == "fp8":
        block = q.get("weight_block_size") or [128, 128]
        return QuantConfig(
            method="fp8",
            weight_block_size=(int(block[0]), int(block[1])),
            ignore=tuple(q.get("ignored_layers") or q.get("ignore") or ()),
        )
    if method == "compressed-tensors":
        fmt = q.get("format")
        groups = q.get("config_groups") or {}
        weights = next(iter(groups.values()), {}).get("weights", {}) if groups else {}
        group_size = int(weights.get("group_size") or 32)
        ignore = tuple(q.get("ignore") or ())
        if fmt == "pack-quantized":
            if weights.get("num_bits", 4) != 4 or weights.get("type", "int") != "int":
                raise ConfigError(f"{source}: quantization_config: only 4-bit int pack-quantized is supported")
            if weights.get("symmetric") is False:
                raise ConfigError(f"{source}: quantization_config: asymmetric pack-quantized is not supported")
            return QuantConfig(method="int4", group_size=group_size, ignore=ignore)
        if fmt == "mxfp4-pack-quantized":
            return QuantConfig(method="mxfp4", group_size=group_size, ignore=ignore)
        raise ConfigError(
            f"{source}: quantization_config.format {fmt!r} is not supported "
            "(supported: pack-quantized, mxfp4-pack-quantized)"
        )
    raise ConfigError(
        f"{source}: quantization_config.quant_method {method!r} is not supported (supported: fp8, compressed-tensors)"
    )


# Moonshot's modeling code (and transformers' KimiLinearAttention) build q_a_layernorm and
# kv_a_layernorm without an eps argument, so their RMSNorm default 1e-6 applies, not rms_norm_eps
# (1e-5); SGLang and vLLM pass rms_norm_eps. We follow Moonshot's code, the model's reference.
_KIMI_MLA_NORM_EPS = 1e-6


def _parse_linear_model(raw: dict[str, Any], text: dict[str, Any], r: _Reader) -> dict[str, Any]:
    """The ModelConfig fields only Kimi Linear / Kimi K3 have, from the kimi_linear text config."""
    src = r.source
    lac = text.get("linear_attn_config")
    if not isinstance(lac, dict):
        raise ConfigError(f"{src}: field 'linear_attn_config' is missing (needed for kimi_linear)")
    la = _Reader(lac, f"{src} linear_attn_config")
    n = r.int("num_hidden_layers")
    kda = tuple(lac.get("kda_layers") or ())
    full = tuple(lac.get("full_attn_layers") or ())
    if kda or full:
        types: list[str | None] = [None] * n
        for key, ids, kind in (("kda_layers", kda, "linear_attention"), ("full_attn_layers", full, "full_attention")):
            for i in ids:
                if isinstance(i, bool) or not isinstance(i, int) or not 1 <= i <= n:
                    raise ConfigError(
                        f"{src}: field 'linear_attn_config.{key}' holds {i!r}; layers are 1-indexed, 1..{n}"
                    )
                if types[i - 1] is not None:
                    raise ConfigError(f"{src}: layer {i} (1-indexed) is in both kda_layers and full_attn_layers")
                types[i - 1] = kind
        if None in types:
            raise ConfigError(
                f"{src}: layer {types.index(None) + 1} (1-indexed) is in neither "
                "'linear_attn_config.kda_layers' nor 'full_attn_layers'"
            )
    elif isinstance(text.get("layer_types"), list) and len(text["layer_types"]) == n:
        types = list(text["layer_types"])  # an explicit per-layer list (transformers writes one too)
        if set(types) - {"linear_attention", "full_attention"}:
            raise ConfigError(
                f"{src}: field 'layer_types' holds {sorted(set(types))}; expected linear_attention / full_attention"
            )
    else:
        # Never guessed: transformers' fallback (MLA at every 4th 0-indexed layer) is not Kimi's layout.
        raise ConfigError(f"{src}: fields 'linear_attn_config.kda_layers' and 'full_attn_layers' are missing")
    bound = lac.get("gate_lower_bound")
    linear = LinearAttnConfig(
        num_heads=la.int("num_heads", text.get("linear_num_heads")),
        head_dim=la.int("head_dim", text.get("linear_head_dim")),
        short_conv_kernel_size=la.int("short_conv_kernel_size", text.get("linear_conv_kernel_dim", 4)),
        kda_layers=tuple(i for i in range(1, n + 1) if types[i - 1] == "linear_attention"),
        full_attn_layers=tuple(i for i in range(1, n + 1) if types[i - 1] == "full_attention"),
        gate_lower_bound=None if bound is None else la.float("gate_lower_bound"),
        use_full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
        raw=dict(lac),
    )
    act = str(text.get("hidden_act", "silu"))
    if act not in ("silu", "situ"):
        raise ConfigError(f"{src}: field 'hidden_act' is {act!r}; supported: silu, situ")
    if text.get("mla_use_nope", True) is not True:
        raise ConfigError(f"{src}: field 'mla_use_nope' is false; kimi_linear MLA layers are NoPE only")
    linear_beta = text.get("activation_situ_linear_beta")
    block = r.optional_int("attn_res_block_size")
    latent = r.optional_int("routed_expert_hidden_size")
    vision = raw.get("vision_config") if raw is not text else None
    return dict(
        layer_types=tuple(types),
        linear_attn=linear,
        hidden_act=act,
        situ_beta=float(text.get("activation_situ_beta") or 1.0),
        situ_linear_beta=None if linear_beta is None else r.float("activation_situ_linear_beta"),
        mla_use_nope=True,
        mla_use_output_gate=bool(text.get("mla_use_output_gate", False)),
        mla_norm_eps=_KIMI_MLA_NORM_EPS,
        attn_res_block_size=block,
        routed_expert_hidden_size=latent,
        latent_moe_use_norm=bool(text.get("latent_moe_use_norm", False)) and latent is not None,
        vision_model_type=(vision or {}).get("model_type") if isinstance(vision, dict) else None,
    )
