"""What speculative decoding adds to the memory plan, from configs alone (no weights read).

- An EAGLE-3 drafter: its weights (``fc``, one decoder layer over ``2 * hidden`` inputs, ``norm``,
  ``lm_head`` over ``draft_vocab_size``, ``d2t``, and ``embed_tokens`` when it ships its own) and its
  KV cache (one layer, ``2 * num_key_value_heads * head_dim`` values per token, or an MLA drafter's
  ``kv_lora_rank + qk_rope_head_dim``), on the first GPU, where the drafter runs.
- A hybrid (KDA) target: a scratch state per sequence and draft position, for the rollback
  (``num_speculative_tokens`` more states per sequence).
- Verification rows: a decode verifying ``k`` drafts runs ``1 + k`` rows, so decode-sized
  activations are ``max_num_seqs * (1 + k)`` rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kimitui.engine.spec_decode.eagle3.mla import MLAShape
from kimitui.engine.spec_decode.eagle3.model import drafter_architecture

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class DrafterFootprint:
    weight_bytes: int
    kv_bytes_per_token: int
    method: str = ""  # eagle3 or dspark (engine.spec_decode.drafter_memory)


def read_drafter_config(model_dir: str | Path) -> tuple[Path, dict]:
    """(path, contents) of a drafter checkpoint's config.json; one-line errors for a missing or
    malformed file."""
    path = Path(model_dir) / "config.json"
    try:
        return path, json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"speculative_config.model: {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg})") from None


def drafter_footprint(
    model_dir: str | Path, target_hidden_size: int, target_vocab_size: int, dtype_bytes: int | None = None
) -> DrafterFootprint:
    """Bytes of an EAGLE-3 drafter checkpoint's weights and KV per token, from its config.json."""
    path, c = read_drafter_config(model_dir)
    try:
        h, inter = int(c["hidden_size"]), int(c["intermediate_size"])
        heads = int(c["num_attention_heads"])
    except KeyError as e:
        raise ValueError(f"{path}: missing {e.args[0]!r}") from None

    kv_heads = int(c.get("num_key_value_heads", heads))
    hd = int(c.get("head_dim", h // heads))
    vocab = int(c.get("draft_vocab_size") or target_vocab_size)
    t_hidden = int(c.get("target_hidden_size") or target_hidden_size)
    size = dtype_bytes or _DTYPE_BYTES.get(str(c.get("torch_dtype", "bfloat16")), 2)
    n_aux = len(
        (c.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        or c.get("eagle_aux_hidden_state_layer_ids")
        or (0, 0, 0)
    )
    params = n_aux * t_hidden * (h + (1 if c.get("fc_norm") else 0))  # fc (and EAGLE-3.1's fc_norm)
    if drafter_architecture(c) == "mla":  # q/kv LoRA attention over cat(embeds, hidden); a latent KV cache
        mla = MLAShape.from_dict(c)
        params += mla.param_count(h, heads)
        kv_per_token = mla.cache_width * size
    else:
        params += 2 * h * (heads + 2 * kv_heads) * hd + heads * hd * h  # q, k, v over cat(embeds, hidden); o
        kv_per_token = 2 * kv_heads * hd * size
    params += 3 * h * inter + 4 * h  # MLP; input / hidden / post-attention / final norms
    params += vocab * h  # lm_head (counted even when shared with the target: an upper bound)
    weight = params * size + vocab * 8  # d2t, int64
    return DrafterFootprint(weight, kv_per_token)
