"""What the demo writers share: the cache folder, the atomic write of a checkpoint, the MLA and
SwiGLU shapes both models draw, and the sharded safetensors writer."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

NUM_BASE_TOKENS = 4096
SEED = 20260727
SHARDS = 2


def ensure_checkpoint(target: Path, writer: Callable[[Path], None]) -> Path:
    """``target``, written first by ``writer`` if it is not there yet."""
    if (target / "model.safetensors.index.json").is_file() and (target / "tiktoken.model").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write into a sibling temp dir and rename: a crash or a second process never sees half a checkpoint.
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        writer(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache dir is the user's anyway
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "model.safetensors.index.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def mla_low_rank_shapes(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The low-rank MLA projections and norms K2's (DeepSeek-V3) and K3's MLA layers share, as
    (name, shape) in the order the demo writers draw them; a 1-D shape is a norm weight (ones)."""
    d, h = c["hidden_size"], c["num_attention_heads"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    q, kv = c["q_lora_rank"], c["kv_lora_rank"]
    return [
        ("q_a_proj", (q, d)),
        ("q_a_layernorm", (q,)),
        ("q_b_proj", (h * (nope + rope), q)),
        ("kv_a_proj_with_mqa", (kv + rope, d)),
        ("kv_a_layernorm", (kv,)),
        ("kv_b_proj", (h * (nope + v), kv)),
    ]


def swiglu_shapes(inter: int, d: int) -> list[tuple[str, tuple[int, int]]]:
    """A SwiGLU MLP's ``gate_proj``, ``up_proj`` [inter, d] and ``down_proj`` [d, inter], in draw order."""
    return [("gate_proj", (inter, d)), ("up_proj", (inter, d)), ("down_proj", (d, inter))]


def write_shards(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    names = list(tensors)  # insertion order: layer by layer, like Moonshot's shards
    per = -(-len(names) // SHARDS)
    weight_map = {}
    for i in range(SHARDS):
        fname = f"model-{i + 1}-of-{SHARDS}.safetensors"
        part = names[i * per : (i + 1) * per]
        save_file({n: tensors[n] for n in part}, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
