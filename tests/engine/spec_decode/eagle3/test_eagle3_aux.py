"""The K2 target's aux hidden states (EAGLE-3's input) against Hugging Face's own layer outputs.

Id k is the hidden state entering layer k: the embedding for 0, layer k-1's output (plus residual)
otherwise, the final pre-norm hidden for k = L. The engine's rows come from a real generate: one
prefill step (only the last row's output wanted, so ``out_rows`` is set) and float32 decode steps
(the fused CPU layer path, which returns the whole hidden state with no residual)."""

from __future__ import annotations

import random

import pytest
import torch

from kimitui.engine import LLM, SamplingParams
from kimitui.kernels.cpu import few_rows as cpu_few_rows
from kimitui.kernels.settings import KernelSettings
from tests.helpers.checkpoints import write_hf_checkpoint
from tests.helpers.spec.eagle3_reference import hf_aux_states

LAYERS = 4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("k2aux")
    hf = write_hf_checkpoint(path, seed=3, num_hidden_layers=LAYERS)
    llm = LLM(str(path), dtype="float32", max_model_len=128, max_num_seqs=2, enable_prefix_caching=False)
    return hf, llm


def run_capturing(llm, ids, n):
    model = llm.engine.model
    seen, forward = [], model.forward

    def spy(*a, **kw):
        out = forward(*a, **kw)
        seen.append(model.aux_hidden.clone())
        return out

    model.forward = spy
    try:
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    finally:
        del model.forward
    return seen, list(out[0].outputs[0].token_ids)


@pytest.mark.parametrize("layer_ids", [(0, 2, LAYERS), (1, 3), (2, 1, 0)])
def test_aux_hidden_matches_hf_layer_outputs(target, layer_ids):
    hf, llm = target
    model = llm.engine.model
    model.set_aux_hidden_layers(layer_ids)
    try:
        rng = random.Random(1)
        prompt = [rng.randrange(320) for _ in range(23)]
        steps, gen = run_capturing(llm, prompt, 4)
    finally:
        model.set_aux_hidden_layers(None)
    want = hf_aux_states(hf, prompt + gen, layer_ids)  # [T, n*D], ascending ids
    if cpu_few_rows.available() and KernelSettings.from_env().cpu_kernels:
        assert all(layer.fused is not None for layer in model.model.layers)  # the decodes took the fused path
    rows = torch.cat(steps)  # one prefill step, then one row per decode step
    assert rows.shape == (len(prompt) + len(gen) - 1, len(layer_ids) * 64)
    torch.testing.assert_close(rows, want[: rows.shape[0]], atol=2e-4, rtol=2e-4)
    assert model.aux_hidden is None  # off again


def test_aux_capture_is_off_by_default_and_checks_ids(target):
    _, llm = target
    model = llm.engine.model
    llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2))
    assert model.model.aux_layers is None and model.aux_hidden is None
    with pytest.raises(ValueError, match="distinct and in 0..4"):
        model.set_aux_hidden_layers([1, 5])
    with pytest.raises(ValueError, match="distinct"):
        model.set_aux_hidden_layers([2, 2, 3])
