"""``speculative_config``: vLLM's keys with vLLM's meaning; every unsupported value a one-line error
naming the key and what is supported (engine/spec_decode/config.py)."""

from __future__ import annotations

import pytest

from kimitui.engine.args import EngineArgs
from kimitui.engine.spec_decode.config import SpeculativeConfig

# vLLM recipes, pasted unchanged (the K2.6 EAGLE-3 recipe and a DSpark-style one with greedy drafting)
RECIPES = (
    '{"method": "eagle3", "model": "lightseekorg/kimi-k2.6-eagle3-mla", "num_speculative_tokens": 3, '
    '"draft_tensor_parallel_size": 1}',
    '{"method": "eagle3", "model": "/m/d", "num_speculative_tokens": 5, "draft_sample_method": "greedy", '
    '"rejection_sample_method": "standard", "disable_by_batch_size": 8, "enforce_eager": true, '
    '"eagle_aux_hidden_state_layer_ids": [1, 29, 57], "draft_kv_cache_dtype": "auto", '
    '"disable_padded_drafter_batch": false, "quantization": null, "max_model_len": 8192}',
)


@pytest.mark.parametrize("text", RECIPES)
def test_vllm_recipes_parse_with_vllm_meaning(text):
    c = SpeculativeConfig.parse(text)
    assert c.method == "eagle3" and c.model and c.backoff is True
    assert c.draft_sample_method == "greedy" and c.rejection_sample_method == "standard"


def test_values_land_where_they_mean_something():
    c = SpeculativeConfig.parse(RECIPES[1])
    assert c.disable_by_batch_size == 8 and c.max_model_len == 8192
    assert c.eagle_aux_hidden_state_layer_ids == (1, 29, 57)
    assert c.kv_cache_dtype == "auto"
    c = SpeculativeConfig.parse(
        {
            "method": "eagle3",
            "model": "d",
            "num_speculative_tokens": 2,
            "draft_kv_cache_dtype": "float32",
            "backoff": False,
            "eagle_aux_hidden_state_layer_convention": "output",
        }
    )
    assert c.kv_cache_dtype == "float32" and c.backoff is False
    assert c.eagle_aux_hidden_state_layer_convention == "output"
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3}).disable_by_batch_size is None


@pytest.mark.parametrize(
    "value, needle",
    [
        (
            {"method": "dflash", "num_speculative_tokens": 7},
            "method 'dflash' (vLLM's, not supported here): supported ngram, suffix, eagle3, dspark",
        ),
        ({"method": "medusa", "num_speculative_tokens": 3}, "method 'medusa'"),
        ({"method": "bogus", "num_speculative_tokens": 3}, "method 'bogus': supported ngram, suffix, eagle3"),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "draft_sample_method": "probabilistic"},
            "draft_sample_method 'probabilistic' needs a model drafter (eagle3 or dspark), not method 'ngram'",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic"},
            "rejection_sample_method 'synthetic' (vLLM's, not supported here): supported standard, block",
        ),
        ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}, "disable_by_batch_size must be"),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": True},
            "disable_by_batch_size must be",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "eagle_aux_hidden_state_layer_ids": [1]},
            "eagle_aux_hidden_state_layer_ids applies to method eagle3 only",
        ),
        (
            {"method": "eagle3", "model": "d", "num_speculative_tokens": 3, "eagle_aux_hidden_state_layer_ids": [1, 1]},
            "eagle_aux_hidden_state_layer_ids must be distinct",
        ),
        (
            {"method": "eagle3", "model": "d", "num_speculative_tokens": 3, "eagle_aux_hidden_state_layer_ids": "1,2"},
            "eagle_aux_hidden_state_layer_ids must be a non-empty list",
        ),
        (
            {
                "method": "eagle3",
                "model": "d",
                "num_speculative_tokens": 3,
                "eagle_aux_hidden_state_layer_convention": "middle",
            },
            "eagle_aux_hidden_state_layer_convention 'middle': supported input, output",
        ),
        (
            {"method": "eagle3", "model": "d", "num_speculative_tokens": 3, "draft_kv_cache_dtype": "fp8"},
            "draft_kv_cache_dtype 'fp8': supported auto, bfloat16, float16, float32",
        ),
        (
            {
                "method": "eagle3",
                "model": "d",
                "num_speculative_tokens": 3,
                "kv_cache_dtype": "float16",
                "draft_kv_cache_dtype": "float32",
            },
            "disagree",
        ),
        ({"method": "ngram", "num_speculative_tokens": 3, "quantization": "fp8"}, "quantization 'fp8': supported null"),
        ({"method": "ngram", "num_speculative_tokens": 3, "max_model_len": -1}, "max_model_len must be an integer"),
        ({"method": "ngram", "num_speculative_tokens": 3, "backoff": "no"}, "backoff must be true or false"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in 1..64"),
        ({"method": "ngram", "num_speculative_tokens": 3, "draft_sample": "greedy"}, "unknown key 'draft_sample'"),
    ],
)
def test_unsupported_values_are_one_line_errors_naming_the_key(value, needle):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.parse(value)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg, msg
    with pytest.raises(ValueError):  # EngineArgs checks at construction, not at load
        EngineArgs(model="x", speculative_config=value)
