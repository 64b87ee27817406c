"""The built-in K3 demo checkpoint (``--model demo-k3``): a small random-weight Kimi K3-shaped model.

Written on first use into the XDG cache dir, the same bytes every time, in the layout of the real
Kimi K3 checkpoint: a ``kimi_k3`` wrapper config.json whose ``text_config`` is a ``kimi_linear``
model (KDA and NoPE gated-MLA layers, latent MoE, SiTU, attention residuals) with the
compressed-tensors MXFP4 ``quantization_config`` inside it; every text tensor under
``language_model.``, routed experts as MXFP4 ``weight_packed`` / ``weight_scale`` bytes; and K3's
tokenizer files (``tiktoken.model`` + ``tokenizer_config.json`` with K3's special tokens at their
real ids 163584+, no chat template: K3's chat format, XTML, is rendered in code). Weights are
random: its output is noise.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kimitui.engine.demo.bpe_train import demo_corpus, train_ranks, write_kimi_tokenizer_files
from kimitui.engine.demo.common import (
    NUM_BASE_TOKENS,
    SEED,
    ensure_checkpoint,
    mla_low_rank_shapes,
    swiglu_shapes,
    write_shards,
)
from kimitui.engine.paths import cache_root

DEMO_K3_VERSION = 1
K3_SPECIAL_BASE = 163584  # K3's special block starts here whatever the size of tiktoken.model
VOCAB_SIZE = 163840  # covers the special block, as the real K3's does
# K3's named special tokens (reference: the K3 tokenizer_config.json). The four media token names
# are K2's (K3 only documents their ids 163602-163605); every other id is <|reserved_token_N|>.
K3_SPECIAL_TOKENS: dict[int, str] = {
    163584: "[BOS]",
    163585: "[EOS]",
    163586: "<|end_of_msg|>",
    163587: "<|open|>",
    163588: "<|close|>",
    163589: "<|sep|>",
    163590: "[start_header_id]",
    163591: "[end_header_id]",
    163593: "[EOT]",
    163602: "<|media_begin|>",
    163603: "<|media_content|>",
    163604: "<|media_end|>",
    163605: "<|media_pad|>",
    163649: "<osagent_mode>",
    163838: "[UNK]",
    163839: "[PAD]",
}
# XTML's brackets are ordinary (non-special) added tokens in K3: they decode as text.
K3_TEXT_TOKENS = ("<|open|>", "<|close|>", "<|sep|>")

# K3's text_config key set (reference: Kimi K3 config.json), dimensions shrunk to run on a laptop.
# Layers 1-3 (1-indexed) are KDA, layer 4 is MLA; layer 0 is dense, the others latent MoE.
TEXT_CONFIG = {
    "model_type": "kimi_linear",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": VOCAB_SIZE,
    "hidden_act": "situ",
    "activation_situ_beta": 4.0,
    "activation_situ_linear_beta": 25.0,
    "rms_norm_eps": 1e-05,
    "q_lora_rank": 64,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "attn_res_block_size": 2,
    "routed_expert_hidden_size": 64,
    "latent_moe_use_norm": True,
    "max_position_embeddings": 32768,
    "num_nextn_predict_layers": 0,
    "num_experts": 16,
    "num_experts_per_token": 4,
    "num_shared_experts": 1,
    "moe_intermediate_size": 64,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_expert_group": 1,
    "topk_group": 1,
    "moe_renormalize": True,
    "routed_scaling_factor": 1.0,
    "moe_router_activation_func": "sigmoid",
    "use_grouped_topk": True,
    "topk_method": "noaux_tc",
    "tie_word_embeddings": False,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
    "linear_attn_config": {
        "num_heads": 4,
        "head_dim": 32,
        "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
        "kda_layers": [1, 2, 3],
        "full_attn_layers": [4],
    },
    "quantization_config": {
        "config_groups": {
            "group_0": {
                "format": "mxfp4-pack-quantized",
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": None,
                    "block_structure": None,
                    "dynamic": False,
                    "group_size": 32,
                    "num_bits": 4,
                    "observer": "minmax",
                    "observer_kwargs": {},
                    "scale_dtype": "torch.uint8",
                    "strategy": "group",
                    "symmetric": True,
                    "type": "float",
                    "zp_dtype": None,
                },
            }
        },
        "format": "mxfp4-pack-quantized",
        "global_compression_ratio": None,
        "ignore": [
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
            "re:.*lm_head.*",
            "re:.*vision_tower.*",
            "re:.*mm_projector.*",
        ],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    },
    "kimitui_demo": True,
}
DEMO_K3_CONFIG = {
    "architectures": ["KimiK3ForConditionalGeneration"],
    "model_type": "kimi_k3",
    "_name_or_path": "kimitui-demo-k3",
    "kimitui_demo": True,
    "kimitui_demo_note": "random weights: output is noise. Built into kimitui to show every K3 part working.",
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
    "media_placeholder_token_id": 163605,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    "text_config": TEXT_CONFIG,
    "vision_config": {"model_type": "kimi_k3_vision"},
}
MXFP4_GROUP = 32
# E8M0 scale byte of the demo's experts: 2^(120-127) = 1/128, so |w| <= 6/128 like a 0.02-std init.
_SCALE_BYTE = 120


def demo_k3_dir() -> Path:
    return cache_root() / f"demo-k3-v{DEMO_K3_VERSION}"


def ensure_demo_k3_checkpoint(path: str | Path | None = None) -> Path:
    """The K3 demo checkpoint directory, written first if it is not there yet."""
    return ensure_checkpoint(Path(path) if path is not None else demo_k3_dir(), write_demo_k3_checkpoint)


def write_demo_k3_checkpoint(path: str | Path) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_shards(path, _random_weights(TEXT_CONFIG))
    (path / "config.json").write_text(json.dumps(DEMO_K3_CONFIG, indent=2) + "\n")
    (path / "generation_config.json").write_text(
        json.dumps({"max_length": TEXT_CONFIG["max_position_embeddings"], "eos_token_id": 163586}, indent=2) + "\n"
    )
    write_k3_tokenizer_files(path, k3_ranks(train_ranks(demo_corpus(), NUM_BASE_TOKENS)))


def k3_ranks(trained: dict[bytes, int]) -> dict[bytes, int]:
    """``trained`` filled up to K3's 163,584 ranks, so the specials sit at their real ids.

    A tokenizer cannot leave ids unused, and random weights sample all 163,840 ids, so the filler
    tokens are readable pairs of trained words ("word·other"). No encoding ever yields one: the
    split pattern always cuts before the "·", and BPE only builds a token by merging two tokens,
    which no split of a filler is (checked below).
    """
    words = [
        t
        for t in sorted(trained, key=trained.get)
        if t.decode("utf-8", "ignore").isalpha() and len(t.decode("utf-8", "ignore").encode()) == len(t)
    ]
    ranks = dict(trained)
    n = len(words)
    for k in range(n * n):
        if len(ranks) == K3_SPECIAL_BASE:
            break
        # A fixed stride through all pairs (coprime to n*n), so neighbouring ids read differently.
        pair = (k * 7919) % (n * n)
        token = words[pair // n] + "·".encode() + words[pair % n]
        if token in ranks or any(token[:i] in ranks and token[i:] in ranks for i in range(1, len(token))):
            continue
        ranks[token] = len(ranks)
    if len(ranks) != K3_SPECIAL_BASE:
        raise ValueError(f"could not fill the demo vocabulary: {len(ranks)} of {K3_SPECIAL_BASE} ranks")
    return ranks


def write_k3_tokenizer_files(directory: str | Path, ranks: dict[bytes, int], model_max_length: int = 1048576) -> None:
    """``tiktoken.model`` and a K3-shaped ``tokenizer_config.json`` (specials at 163584..163839)."""
    d = Path(directory)
    write_kimi_tokenizer_files(d, ranks, model_max_length=model_max_length)  # tiktoken.model (+ K2 config)
    decoder = {
        str(i): {
            "content": K3_SPECIAL_TOKENS.get(i, f"<|reserved_token_{i}|>"),
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": K3_SPECIAL_TOKENS.get(i) not in K3_TEXT_TOKENS,
        }
        for i in range(K3_SPECIAL_BASE, VOCAB_SIZE)
    }
    config = {
        "added_tokens_decoder": decoder,
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "TikTokenTokenizer",
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _random_weights(c: dict) -> dict[str, torch.Tensor]:
    """Checkpoint-named tensors (bf16, F32 where K3 stores F32, U8 for MXFP4), one seeded generator."""
    gen = torch.Generator().manual_seed(SEED + 3)
    d, std, lin = c["hidden_size"], 0.02, c["linear_attn_config"]
    h, v = c["num_attention_heads"], c["v_head_dim"]
    kh, kd = lin["num_heads"], lin["head_dim"]
    p = kh * kd  # KDA projection width
    latent, inter = c["routed_expert_hidden_size"], c["moe_intermediate_size"]
    out: dict[str, torch.Tensor] = {}

    def normal(name: str, *shape: int, scale: float = std, dtype=torch.bfloat16) -> None:
        out[f"language_model.{name}"] = (torch.randn(*shape, generator=gen) * scale).to(dtype)

    def ones(name: str, n: int, dtype=torch.bfloat16) -> None:
        out[f"language_model.{name}"] = torch.ones(n, dtype=dtype)

    def mxfp4(name: str, rows: int, cols: int) -> None:
        # [rows, cols/2] bytes, even column in the low nibble; [rows, cols/32] E8M0 scales.
        out[f"language_model.{name}.weight_packed"] = torch.randint(
            0, 256, (rows, cols // 2), generator=gen, dtype=torch.uint8
        )
        out[f"language_model.{name}.weight_scale"] = torch.full(
            (rows, cols // MXFP4_GROUP), _SCALE_BYTE, dtype=torch.uint8
        )

    normal("model.embed_tokens.weight", c["vocab_size"], d, scale=1.0)
    for i in range(c["num_hidden_layers"]):
        lp = f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            ones(f"{lp}.{norm}.weight", d)
        normal(f"{lp}.self_attention_res_proj.weight", 1, d)
        normal(f"{lp}.mlp_res_proj.weight", 1, d)
        a = f"{lp}.self_attn"
        if i + 1 in lin["kda_layers"]:
            for proj in ("q_proj", "k_proj", "v_proj", "g_proj"):
                normal(f"{a}.{proj}.weight", p, d)
            for conv in ("q_conv1d", "k_conv1d", "v_conv1d"):
                normal(f"{a}.{conv}.weight", p, 1, lin["short_conv_kernel_size"], scale=0.5, dtype=torch.float32)
            normal(f"{a}.f_a_proj.weight", kd, d)
            normal(f"{a}.f_b_proj.weight", p, kd)
            normal(f"{a}.b_proj.weight", kh, d)
            # [head_dim] like K3's [128]: the first num_heads entries are the heads' log(A), the rest 0.
            a_log = torch.zeros(kd, dtype=torch.float32)
            a_log[:kh] = torch.empty(kh).uniform_(1, 16, generator=gen).log()
            out[f"language_model.{a}.A_log"] = a_log
            out[f"language_model.{a}.dt_bias"] = torch.zeros(p, dtype=torch.float32)
            ones(f"{a}.o_norm.weight", kd, dtype=torch.float32)
            normal(f"{a}.o_proj.weight", d, p)
        else:
            for name, shape in mla_low_rank_shapes(c):
                (ones if len(shape) == 1 else normal)(f"{a}.{name}.weight", *shape)
            normal(f"{a}.g_proj.weight", h * v, d)
            normal(f"{a}.o_proj.weight", d, h * v)
        if i < c["first_k_dense_replace"]:
            for proj, shape in swiglu_shapes(c["intermediate_size"], d):
                normal(f"{lp}.mlp.{proj}.weight", *shape)
            continue
        m = f"{lp}.block_sparse_moe"
        normal(f"{m}.gate.weight", c["num_experts"], d)
        out[f"language_model.{m}.gate.e_score_correction_bias"] = torch.zeros(c["num_experts"], dtype=torch.float32)
        normal(f"{m}.routed_expert_down_proj.weight", latent, d)
        ones(f"{m}.routed_expert_norm.weight", latent)
        normal(f"{m}.routed_expert_up_proj.weight", d, latent)
        for e in range(c["num_experts"]):
            mxfp4(f"{m}.experts.{e}.w1", inter, latent)
            mxfp4(f"{m}.experts.{e}.w3", inter, latent)
            mxfp4(f"{m}.experts.{e}.w2", latent, inter)
        for proj, shape in swiglu_shapes(inter * c["num_shared_experts"], d):
            normal(f"{m}.shared_experts.{proj}.weight", *shape)
    ones("model.norm.weight", d)
    ones("model.output_attn_res_norm.weight", d)
    normal("model.output_attn_res_proj.weight", 1, d)
    normal("lm_head.weight", c["vocab_size"], d)
    return out
