"""DSpark (method ``dspark``) on a tiny Kimi K3 target: vLLM's recipe keys, tiny drafters in the two
published layouts (lightseekorg/kimi-k3-dspark, Inferact/Kimi-K3.1-Pro-DSpark-preview) load and draft
in process, greedy output is unchanged, bad checkpoints fail in one line, and the target's taps are
the states the reference K3 forward computes (both streams)."""

from __future__ import annotations

import json

import pytest
import torch

from kimitui.engine import LLM, SamplingParams
from kimitui.engine.spec_decode.config import SpeculativeConfig
from tests.helpers.k3_checkpoint import write_k3_checkpoint
from tests.helpers.spec.dspark_checkpoint import (
    LAYOUTS,
    dspark_config,
    dspark_tensors,
    write_dspark_checkpoint,
    write_tiny_dspark,
)

RECIPE = {
    "method": "dspark",
    "num_speculative_tokens": 7,
    "draft_sample_method": "probabilistic",
    "rejection_sample_method": "block",
}


def test_vllm_recipe_json_is_accepted_unchanged():
    c = SpeculativeConfig.parse(json.dumps({**RECIPE, "model": "/x"}))
    assert (c.method, c.num_speculative_tokens, c.draft_sample_method, c.rejection_sample_method) == (
        "dspark",
        7,
        "probabilistic",
        "block",
    )
    assert c.num_lookahead_slots == 7  # the block's latents go into the paged cache past the verified tokens
    with pytest.raises(ValueError, match="needs model"):
        SpeculativeConfig.parse(RECIPE)
    with pytest.raises(ValueError, match="draft_sample_method 'probabilistic'"):
        SpeculativeConfig.parse(
            {"method": "ngram", "num_speculative_tokens": 3, "draft_sample_method": "probabilistic"}
        )


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("k3")
    text = write_k3_checkpoint(path, seed=3, shards=1, quantized=False)
    return path, text


def _greedy(path, prompts, spec=None, n=12):
    kw = {"speculative_config": spec} if spec else {}
    with LLM(str(path), dtype="float32", max_model_len=128, max_num_seqs=4, **kw) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        )
        stats = llm.engine.stats().spec_decode
        if spec:  # the memory plan's count (config and header only) is the loaded drafter's
            from kimitui.engine.spec_decode.dspark.model import dspark_footprint

            d = llm.engine.proposer.drafter
            fp = dspark_footprint(spec["model"], llm.engine.config, 4)
            assert fp.weight_bytes == 4 * sum(p.numel() for p in d.parameters())
            assert fp.kv_bytes_per_token == d.cache_bytes_per_token(torch.float32)
    return [o.outputs[0].token_ids for o in outs], stats


PROMPTS = [[5, 9, 17, 33, 65, 129], [200, 3, 3, 7], [11] * 9]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_published_layouts_load_and_draft_greedy_unchanged(target, tmp_path, layout):
    path, _ = target
    drafter = write_tiny_dspark(tmp_path / "d", path, layout, seed=5)
    names = set(json.loads((drafter / "config.json").read_text()))
    assert {"target_layer_ids", "mask_token_id", "markov_rank", "enable_confidence_head"} <= names
    plain, _ = _greedy(path, PROMPTS)
    spec, stats = _greedy(path, PROMPTS, {**RECIPE, "model": str(drafter)})
    assert spec == plain
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts


def _bad(tmp_path, target, mutate_cfg=None, mutate_tensors=None):
    path, text = target
    c = dspark_config(json.loads((path / "config.json").read_text())["text_config"], "inferact")
    t = dspark_tensors(c, None)
    if mutate_cfg:
        mutate_cfg(c)
    if mutate_tensors:
        mutate_tensors(t)
    d = write_dspark_checkpoint(tmp_path / "bad", c, t)
    with pytest.raises(ValueError) as e:
        with LLM(
            str(path), dtype="float32", max_model_len=64, max_num_seqs=2, speculative_config={**RECIPE, "model": str(d)}
        ):
            pass
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_bad_checkpoints_fail_in_one_line(target, tmp_path):
    assert "architectures" in _bad(tmp_path, target, lambda c: c.update(architectures=["DFlashDraftModel"]))
    assert "target_layer_ids" in _bad(tmp_path, target, lambda c: c.update(target_layer_ids=[0, 9]))
    assert "target_num_hidden_layers" in _bad(tmp_path, target, lambda c: c.update(target_num_hidden_layers=93))
    assert "aux_hidden_stream" in _bad(tmp_path, target, lambda c: c.update(aux_hidden_stream="mixture"))
    assert "markov_head.markov_w2.weight" in _bad(
        tmp_path, target, mutate_tensors=lambda t: t.pop("markov_head.markov_w2.weight")
    )
    assert "lm_head.weight" in _bad(
        tmp_path, target, mutate_tensors=lambda t: t.update({"lm_head.weight": torch.zeros(256, 64)})
    )
    assert "layers.0.self_attn.q_b_proj.weight" in _bad(
        tmp_path, target, mutate_tensors=lambda t: t.update({"layers.0.self_attn.q_b_proj.weight": torch.zeros(3, 3)})
    )


@pytest.mark.parametrize("stream", ["prefix", "attn_res"])
def test_target_taps_are_the_reference_states(target, stream):
    """The engine's captured taps (capture id k = layer k - 1's output) against the naive float64 K3."""
    from tests.helpers.hybrid_driver import HybridDriver
    from tests.helpers.k3_reference import K3Reference
    from tests.helpers.spec.dspark_reference import target_taps

    path, text = target
    ref = K3Reference(json.loads((path / "config.json").read_text()), text)
    ids = [5, 9, 17, 33, 65, 129, 7, 8, 250, 3, 19]
    layers = [0, 2, 3, 4]  # layer outputs; 4 is the last layer (the output mix)
    want, _ = target_taps(ref, ids, layers, stream)
    drv = HybridDriver(path, max_seqs=2, max_len=64, dtype=torch.float32)
    drv.model.set_aux_hidden_layers([k + 1 for k in layers], stream)
    drv.prompt_logprobs([ids])
    got = drv.model.aux_hidden
    d = text["model.embed_tokens.weight"].shape[1]
    for j, w in enumerate(want):
        assert (got[:, j * d : (j + 1) * d].double() - w).abs().max().item() < 1e-3, (stream, layers[j])
    if stream == "attn_res":  # the two streams differ where blocks have been snapshotted
        prefix, _ = target_taps(ref, ids, layers, "prefix")
        assert (prefix[1] - want[1]).abs().max().item() > 1e-2
