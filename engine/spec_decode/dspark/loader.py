"""Loading a DSpark drafter checkpoint (config.json and *.safetensors) for a Kimi K3 / Kimi Linear target.

The config is read and checked first (``architectures``, shapes, taps against the target), so a
drafter this engine cannot run fails in one line before a weight is read. Tensor names are the
published ones (vLLM's ``vllm/models/kimi_k3/nvidia/dspark_mla.py`` loader and the parameter roster
of Inferact/Kimi-K3-DSpark): ``context_proj``, ``context_norm``, ``fc_norm.<i>`` (when the config
says ``fc_norm``), ``layers.<l>.{input_layernorm, self_attn.{q_a_proj, q_a_layernorm, q_b_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}, post_attention_layernorm,
mlp.{gate,up,down}_proj}``, ``final_norm``, ``markov_head.markov_w{1,2}``,
``confidence_head.proj.{weight,bias}`` and, in some exports, ``embed_tokens`` (otherwise the
target's is shared); a ``model.`` prefix is accepted. The LM head is always the target's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from kimitui.engine.spec_decode.dspark.model import DSparkConfig, DSparkDrafter


def checkpoint_name(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


def read_config(path: str | Path, target_config) -> DSparkConfig:
    """The drafter's DSparkConfig, checked against the target (engine ModelConfig), from config.json alone."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"dspark drafter: no config.json in {path}")
    try:
        d = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"dspark drafter: {cfg_file} is not valid JSON ({e.msg})") from None
    if not isinstance(d, dict):
        raise ValueError(f"dspark drafter: {cfg_file} must hold a JSON object")
    return DSparkConfig.from_dict(
        d,
        target_config.num_hidden_layers,
        target_config.hidden_size,
        target_config.vocab_size,
        target_has_attn_res=bool(getattr(target_config, "attn_res_block_size", None)),
    )


def load_dspark(path: str | Path, target_config, device: torch.device | str, dtype: torch.dtype) -> DSparkDrafter:
    """Load a DSpark drafter checkpoint (any float dtype on disk) on ``device`` in ``dtype``."""
    path = Path(path)
    cfg = read_config(path, target_config)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"dspark drafter: no .safetensors files in {path}")
    names: dict[str, tuple[Path, str]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as r:
            for key in r.keys():
                name = checkpoint_name(key)
                if name in names:
                    raise ValueError(f"dspark drafter: {key!r} in {f.name} duplicates {names[name][1]!r}")
                names[name] = (f, key)
    if "lm_head.weight" in names:
        raise ValueError(
            f"dspark drafter: {names['lm_head.weight'][0].name} holds lm_head.weight; a DSpark drafter "
            f"shares the target's LM head"
        )
    drafter = DSparkDrafter(cfg, dtype, own_embedding="embed_tokens.weight" in names)
    drafter.to_empty(device=torch.device(device))  # storage only: each tensor is filled below
    params = dict(drafter.named_parameters())
    unknown = sorted(set(names) - set(params))
    if unknown:
        raise ValueError(f"dspark drafter: unexpected tensor {names[unknown[0]][1]!r} in {names[unknown[0]][0].name}")
    missing = sorted(set(params) - set(names))
    if missing:
        raise ValueError(f"dspark drafter: checkpoint lacks {missing[0]!r}")
    for name, (f, key) in names.items():
        with safe_open(str(f), framework="pt") as r:
            t = r.get_tensor(key)
        p = params[name]
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"dspark drafter: {key!r} in {f.name} has shape {list(t.shape)}, expected {list(p.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"dspark drafter: {key!r} in {f.name} must be floating point, got {t.dtype}")
        with torch.no_grad():
            p.copy_(t)
    return drafter
