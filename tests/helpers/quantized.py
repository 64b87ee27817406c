"""Quantised variants of a transformers-written tiny checkpoint, and the HF model they equal."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from kimitui.kernels import reference as R
from tests.helpers.checkpoints import rewrite_checkpoint, state_dict_from

_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
K25_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]


def quantize_checkpoint(path: Path, method: str, hf_model, wrap_k25: bool = False) -> None:
    """Rewrite ``path`` in ``method`` ("fp8", "int4", "mxfp4") and set ``hf_model``'s weights to the
    dequantised values, so the two compute the same function."""
    sd = state_dict_from(path)
    config = json.loads((path / "config.json").read_text())
    out: dict[str, torch.Tensor] = {}
    dequant: dict[str, torch.Tensor] = {}
    for name, w in sd.items():
        is_expert = _EXPERT.search(name) is not None
        is_linear = w.dim() == 2 and name.endswith("_proj.weight") or name.endswith("kv_a_proj_with_mqa.weight")
        if method == "fp8" and is_linear:
            q, s = R.quantize_fp8_block(w, (16, 16))
            out[name], out[name.replace(".weight", ".weight_scale_inv")] = q, s
            dequant[name] = R.dequant_fp8_block(q, s, (16, 16))
        elif method == "int4" and is_expert:
            packed, scale = R.quantize_int4(w, 32)
            base = name[: -len(".weight")]
            out[f"{base}.weight_packed"], out[f"{base}.weight_scale"] = packed, scale
            out[f"{base}.weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int32)
            dequant[name] = R.dequant_int4(packed, scale, w.shape[1], 32)
        elif method == "mxfp4" and is_expert:
            packed, scale = R.quantize_mxfp4(w)
            base = name[: -len(".weight")]
            out[f"{base}.weight_packed"], out[f"{base}.weight_scale"] = packed, scale
            dequant[name] = R.dequant_mxfp4(packed, scale)
        else:
            out[name] = w
    config["quantization_config"] = _quant_config(method)
    if wrap_k25:
        out = {f"language_model.{k}": v for k, v in out.items()}
        out["vision_tower.patch_embed.proj.weight"] = torch.zeros(8, 3, 2, 2, dtype=torch.bfloat16)
        out["mm_projector.proj.0.weight"] = torch.zeros(8, 8, dtype=torch.bfloat16)
        text = dict(config, model_type="kimi_k2")
        config = {
            "architectures": ["KimiK25ForConditionalGeneration"],
            "model_type": "kimi_k25",
            "text_config": text,
            "vision_config": {"patch_size": 14},
            "quantization_config": text["quantization_config"],
            "bos_token_id": text.get("bos_token_id"),
            "eos_token_id": text.get("eos_token_id"),
            "tie_word_embeddings": False,
        }
    rewrite_checkpoint(path, out, config)
    _load_dequantised(hf_model, dequant)


def _quant_config(method: str) -> dict:
    if method == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    fmt = "pack-quantized" if method == "int4" else "mxfp4-pack-quantized"
    weights = {
        "num_bits": 4,
        "type": "int" if method == "int4" else "float",
        "symmetric": True,
        "strategy": "group",
        "group_size": 32,
        "dynamic": False,
        "observer": "minmax",
        "actorder": None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "input_activations": None,
                "output_activations": None,
                "weights": weights,
            }
        },
        "ignore": K25_IGNORE,
        "kv_cache_scheme": None,
    }


def _load_dequantised(hf_model, dequant: dict[str, torch.Tensor]) -> None:
    """Copy dequantised weights into the HF model (transformers 5.x fuses experts)."""
    params = dict(hf_model.named_parameters())
    with torch.no_grad():
        for name, w in dequant.items():
            m = _EXPERT.search(name)
            if m and name not in params:
                e, proj = int(m[1]), m[2]
                base = name[: m.start()] + ".mlp.experts"
                if proj == "down_proj":
                    params[f"{base}.down_proj"][e].copy_(w)
                else:
                    fused = params[f"{base}.gate_up_proj"][e]
                    half = fused.shape[0] // 2
                    (fused[:half] if proj == "gate_proj" else fused[half:]).copy_(w)
            else:
                params[name].copy_(w)
