"""The DSpark drafter is loaded before the KV cache is sized, and sized with the plan's numbers: when
the cache takes the memory left (``gpu_memory_gb``; the device's free memory on a GPU), the
drafter's own weights are already in memory and come off the budget, and every block also pays the
drafter's latent KV (its MLA layers' paged caches on the same block ids), so the cache holds fewer
blocks than with a proposer that has no weights (ngram, same draft length)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimitui.engine import LLM
from kimitui.engine.engine import LLMEngine
from kimitui.engine.kv_cache.pool import bytes_of_state, bytes_per_block
from kimitui.engine.spec_decode.config import SpeculativeConfig
from kimitui.engine.spec_decode.drafter_memory import drafter_memory

FIXTURE = Path(__file__).resolve().parents[3] / "fixtures" / "dspark_tiny"
BUDGET = 3 << 20  # what the device has left for the cache after the target's weights and reserve
K = 7


def _sized(monkeypatch, spec: dict):
    seen = {}
    real = LLMEngine._cache_shape

    def sizing(self):
        seen["drafter_bytes"] = self._drafter_weight_bytes()  # what is in memory when the cache is sized
        return real(self)

    monkeypatch.setattr(LLMEngine, "_cache_shape", sizing)
    monkeypatch.setattr(LLMEngine, "_device_kv_budget", lambda self: BUDGET)
    llm = LLM(
        str(FIXTURE / "target"),
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=8,
        gpu_memory_gb=1.0,
        enable_prefix_caching=False,
        speculative_config=spec,
    )
    return llm, seen


def test_drafter_loaded_before_the_cache_and_the_cache_shrinks(monkeypatch):
    spec = {"method": "dspark", "model": str(FIXTURE / "drafter"), "num_speculative_tokens": K}
    llm, seen = _sized(monkeypatch, spec)
    eng = llm.engine
    try:
        fp = drafter_memory(SpeculativeConfig.parse(spec), eng.config, 4)  # what the plan counts, at fp32
        loaded = sum(p.numel() * p.element_size() for p in eng.proposer.drafter.parameters())
        assert seen["drafter_bytes"] == loaded == fp.weight_bytes > 0
        assert fp.kv_bytes_per_token == eng.proposer.drafter.cache_bytes_per_token(eng.dtype) > 0
        specs = eng.model.cache_specs(eng.dtype)
        per_token, bs = bytes_per_block(specs, 1), eng.args.block_size
        state = bytes_of_state(specs, eng.args.max_num_seqs * (1 + K))  # a slot and K scratch states per sequence
        blocks = eng.cache_pool.num_blocks
    finally:
        eng.shutdown()
    room = BUDGET - fp.weight_bytes - state
    assert room > 0
    # the blocks and the drafter's KV for their tokens fill what the weights left, to within a block
    used = blocks * bs * (per_token + fp.kv_bytes_per_token)
    assert used <= room < used + bs * (per_token + fp.kv_bytes_per_token)

    ngram, _ = _sized(monkeypatch, {"method": "ngram", "num_speculative_tokens": K})
    try:
        plain_blocks = ngram.engine.cache_pool.num_blocks
    finally:
        ngram.engine.shutdown()
    assert plain_blocks * bs * per_token <= BUDGET - state < (plain_blocks + 1) * bs * per_token
    assert blocks < plain_blocks
