"""A model drafter's memory, for the plan (``kimitui plan``) and the engine's KV-cache sizing alike:
its own weights and its KV bytes per token, from its config.json (and safetensors header) alone.

- ``eagle3``: one decoder layer (MHA or MLA), ``fc``, its LM head (``footprint.py``).
- ``dspark``: its dense MLA layers (5 in the published K3 drafters) with their paged latent caches
  (``kv_lora_rank + qk_rope_head_dim`` values per token and layer), the context projection, the
  Markov and confidence heads; the target's LM head (and embedding, unless it ships one) is shared
  and not counted (``dspark/model.py``).

Both live on the first GPU, where the drafter runs; each KV block of the target then also holds the
drafter's KV for the same tokens.
"""

from __future__ import annotations

from dataclasses import replace

from kimitui.engine.spec_decode.dspark.model import dspark_footprint
from kimitui.engine.spec_decode.footprint import _DTYPE_BYTES, DrafterFootprint, drafter_footprint, read_drafter_config


def _checkpoint_dtype_bytes(model_dir) -> int:
    """Bytes per value of the drafter as stored (``torch_dtype`` / ``dtype`` in its config; bf16 if
    neither): what the plan counts when the engine's dtype is not given."""
    _, c = read_drafter_config(model_dir)
    return _DTYPE_BYTES.get(str(c.get("torch_dtype") or c.get("dtype") or "bfloat16"), 2)


def drafter_memory(speculative, target_config, dtype_bytes: int | None = None) -> DrafterFootprint | None:
    """The drafter's weights and KV per token for a SpeculativeConfig (None: no model drafter);
    ``dtype_bytes``: the engine's compute dtype, else the checkpoint's."""
    if speculative is None or speculative.method not in ("eagle3", "dspark"):
        return None
    if speculative.method == "dspark":
        size = dtype_bytes or _checkpoint_dtype_bytes(speculative.model)
        return replace(dspark_footprint(speculative.model, target_config, size), method="dspark")
    fp = drafter_footprint(speculative.model, target_config.hidden_size, target_config.vocab_size, dtype_bytes)
    return replace(fp, method="eagle3")
