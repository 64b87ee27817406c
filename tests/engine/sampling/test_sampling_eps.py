"""A temperature below SAMPLING_EPS is greedy (as vLLM): 1e-40 used to overflow the scaled logits
to inf, turn the softmax into NaN and draw token id 0 at every step."""

from __future__ import annotations

import pytest
import torch

from kimitui.engine import SamplingParams
from kimitui.engine.sampling.sampler import SamplingBatch, sample
from kimitui.engine.sampling_params import SAMPLING_EPS


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324, SAMPLING_EPS / 2])
def test_tiny_temperature_is_greedy(temperature):
    p = SamplingParams(temperature=temperature, max_tokens=1)
    assert p.greedy and p.temperature == 0.0


def test_temperatures_from_the_threshold_up_still_sample():
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy
    assert SamplingParams(temperature=0.7).temperature == 0.7


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -1e-40])
def test_non_finite_or_negative_temperature_is_refused(bad):
    with pytest.raises(ValueError, match="temperature must be"):
        SamplingParams(temperature=bad)


def test_sampler_draws_the_argmax_at_a_tiny_temperature():
    torch.manual_seed(0)
    logits = torch.randn(4, 300) * 3
    logits[:, 0] = -50.0  # token 0, which the NaN softmax used to pick, is the least likely
    params = [SamplingParams(temperature=1e-40, seed=i) for i in range(3)] + [SamplingParams(temperature=1.0)]
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    out = sample(logits, SamplingBatch.build(params, gens, torch.device("cpu")))
    assert out.token_ids[:3].tolist() == logits[:3].argmax(-1).tolist()
    # The float32 arithmetic that went wrong: what the unguarded temperature would have done.
    assert torch.isnan((logits[0] / torch.tensor(1e-40, dtype=torch.float32)).softmax(-1)).any()
