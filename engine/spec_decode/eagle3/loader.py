"""Loading an EAGLE-3 drafter checkpoint (config.json and *.safetensors) for a Kimi K2.x target.

The config is read and checked first (``architectures``, shapes, aux layer ids), so a drafter this
engine cannot run fails in one line before a weight is read. Tensor names are the published ones
(see eagle3.py), with or without a ``model.`` prefix, ``midlayer.`` for ``layers.0.``, and
TorchSpec's training name ``kv_a_proj`` for ``kv_a_proj_with_mqa``. ``embed_tokens`` and
``lm_head`` are the target's when the checkpoint has none.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kimitui.engine.spec_decode.eagle3.model import Eagle3Config, Eagle3Drafter, rope_parameters

_IGNORED = ("t2d", "mask_hidden")  # unused by greedy chain drafting (vLLM skips them too)
_ALIASES = {".self_attn.kv_a_proj.": ".self_attn.kv_a_proj_with_mqa."}


def checkpoint_name(name: str) -> str | None:
    """A checkpoint tensor's parameter name (``model.`` dropped, ``midlayer.`` = ``layers.0.``), or
    None for tensors the drafter does not use."""
    if name.startswith("model."):
        name = name[len("model.") :]
    if name.startswith("midlayer."):
        name = "layers.0." + name[len("midlayer.") :]
    for old, new in _ALIASES.items():
        name = name.replace(old, new)
    if name in _IGNORED or name.endswith("rotary_emb.inv_freq"):
        return None
    return name


def read_config(path: str | Path, target_config, aux_override=None, aux_convention: str | None = None) -> Eagle3Config:
    """The drafter's Eagle3Config, checked against the target, from ``path``/config.json alone."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"eagle3 drafter: no config.json in {path}")
    try:
        d = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"eagle3 drafter: {cfg_file} is not valid JSON ({e.msg})") from None
    return Eagle3Config.from_dict(
        d,
        target_config.num_hidden_layers,
        target_config.hidden_size,
        target_config.vocab_size,
        aux_override,
        aux_convention,
    )


def load_eagle3(
    path: str | Path,
    target_config,
    device: torch.device | str,
    dtype: torch.dtype,
    target_embedding: nn.Module | None = None,
    target_lm_head: nn.Module | None = None,
    aux_override=None,
    aux_convention: str | None = None,
) -> Eagle3Drafter:
    """Load an EAGLE-3 drafter checkpoint (any float dtype on disk) for a target with
    ``target_config`` (engine ``ModelConfig``), on ``device`` in ``dtype``."""
    path = Path(path)
    cfg = read_config(path, target_config, aux_override, aux_convention)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"eagle3 drafter: no .safetensors files in {path}")
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
    own_lm_head = "lm_head.weight" in names
    if not own_embedding and cfg.hidden_size != target_config.hidden_size:
        raise ValueError(
            f"eagle3 drafter: no embed_tokens in the checkpoint, and its hidden_size {cfg.hidden_size} "
            f"differs from the target's {target_config.hidden_size}, so it cannot share the target's"
        )
    if not own_lm_head and (cfg.hidden_size != target_config.hidden_size or cfg.draft_vocab_size != cfg.vocab_size):
        raise ValueError(
            "eagle3 drafter: no lm_head in the checkpoint, and it cannot share the target's (that needs "
            "the target's hidden_size and the full vocabulary)"
        )
    drafter = Eagle3Drafter(cfg, dtype, own_embedding, own_lm_head)
    drafter.to_empty(device=torch.device(device))  # storage only: each tensor is filled below
    drafter.inv_freq.copy_(rope_parameters(cfg)[0])
    params = dict(drafter.named_parameters())
    params["d2t"] = drafter.d2t
    unknown = sorted(set(names) - set(params))
    if unknown:
        raise ValueError(f"eagle3 drafter: unexpected tensor {names[unknown[0]][1]!r} in {names[unknown[0]][0].name}")
    if "d2t" not in names:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise ValueError(
                f"eagle3 drafter: draft_vocab_size {cfg.draft_vocab_size} < vocab_size "
                f"{cfg.vocab_size} needs a d2t tensor"
            )
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
                raise ValueError(
                    f"eagle3 drafter: d2t maps draft ids outside the target vocabulary 0..{cfg.vocab_size - 1}"
                )
        elif not t.is_floating_point():
            raise ValueError(f"eagle3 drafter: {key!r} must be floating point, got {t.dtype}")
        with torch.no_grad():
            p.copy_(t)
    if target_embedding is not None:
        drafter.share_embedding(target_embedding)
    if target_lm_head is not None:
        drafter.share_lm_head(target_lm_head)
    return drafter
