"""The EAGLE-3 drafter is loaded before the KV cache is sized: when the cache takes the memory left
(``gpu_memory_gb`` here, the device's free memory on a GPU), the drafter's own weights are already
in memory and come off the budget, and each block also pays the drafter's latent KV."""

from __future__ import annotations

from pathlib import Path

from kimitui.engine import LLM
from kimitui.engine.engine import LLMEngine

PAIR = Path(__file__).resolve().parents[3] / "fixtures" / "eagle3_mla_pair"


def test_drafter_weights_are_loaded_and_counted_before_the_cache(monkeypatch):
    seen = {}
    real = LLMEngine._cache_shape

    def allocate(self):
        seen["drafter_bytes"] = self._drafter_weight_bytes()
        seen["budget"] = self._device_kv_budget()
        return real(self)

    monkeypatch.setattr(LLMEngine, "_cache_shape", allocate)
    spec = {"method": "eagle3", "model": str(PAIR / "eagle3-mla"), "num_speculative_tokens": 3}
    gb = 1.0
    llm = LLM(
        str(PAIR / "target"),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=2,
        gpu_memory_gb=gb,
        speculative_config=spec,
    )
    eng = llm.engine
    drafter = sum(p.numel() * p.element_size() for p in eng.proposer.drafter.parameters())
    assert seen["drafter_bytes"] == drafter > 0  # loaded (its own weights; embedding shared) at sizing time
    specs = eng.model.cache_specs(eng.dtype)
    from kimitui.engine.kv_cache.pool import bytes_per_block

    per_token = bytes_per_block(specs, 1) + eng.proposer.drafter.cache_bytes_per_token()
    left = seen["budget"] - drafter
    assert eng.cache_pool.num_blocks * eng.args.block_size * per_token <= left
    eng.shutdown()
