"""Trained tiny pairs: a 6-layer K2 target and MLA EAGLE-3 / EAGLE-3.1 drafters trained on its own
greedy outputs (``python -m benchmarks.spec.train_eagle3``, committed under
tests/fixtures/eagle3_mla_pair, in TorchSpec's export layout of lightseekorg/kimi-k2.6-eagle3-mla).

- kimitui's greedy acceptance equals, within 2 points, what an independent implementation measures
  on the same files: the plain-PyTorch drafter written from TorchSpec's trainer
  (tests/helpers/spec/eagle3_mla_torchspec.py) over Hugging Face's DeepSeek-V3 target;
- the drafter predicts the target well on the target's own continuations it was trained on
  (acceptance above 60%; on fresh random prompts the tiny drafter reaches about 20%: it memorises);
- tapping the target one layer off (ids + 1) costs at least 10 points (the wiring matters: a test
  that fails when the taps are read at the wrong layer);
- greedy output with drafting is token for token the output without it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kimitui.engine import LLM, SamplingParams
from tests.helpers.spec.eagle3_mla_torchspec import MLADrafter, aux_ids, greedy_acceptance, hf_all_states

PAIR = Path(__file__).resolve().parents[3] / "fixtures" / "eagle3_mla_pair"
K, NEW, N_PROMPTS = 3, 32, 12


def _prompts(vocab: int) -> list[list[int]]:
    """The first training prompts: the drafter is trained on the target's own continuations of these
    (tiny drafters memorise their tiny target; on fresh prompts the trainer measures about 20%)."""
    from benchmarks.spec.train_eagle3 import prompts

    return prompts(128, 1, vocab)[:N_PROMPTS]


@pytest.fixture(scope="module")
def pair():
    from transformers import DeepseekV3ForCausalLM

    hf = DeepseekV3ForCausalLM.from_pretrained(
        str(PAIR / "target"), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    vocab = json.loads((PAIR / "target" / "config.json").read_text())["vocab_size"]
    prompts = _prompts(vocab)
    with torch.no_grad():
        conts = [
            hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    llm = LLM(str(PAIR / "target"), dtype="float32", max_model_len=128, max_num_seqs=N_PROMPTS)
    plain = _generate(llm, prompts)
    llm.engine.shutdown()
    return hf, prompts, conts, plain


def _generate(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _kimitui(prompts, drafter: str, taps=None):
    spec = {
        "method": "eagle3",
        "model": str(PAIR / drafter),
        "num_speculative_tokens": K,
        "backoff": False,
        "eagle_aux_hidden_state_layer_convention": "input",
    }
    if taps is not None:
        spec["eagle_aux_hidden_state_layer_ids"] = list(taps)
    llm = LLM(str(PAIR / "target"), dtype="float32", max_model_len=128, max_num_seqs=N_PROMPTS, speculative_config=spec)
    out = _generate(llm, prompts)
    st = llm.engine.stats().spec_decode
    llm.engine.shutdown()
    return out, st


def _reference(hf, prompts, conts, drafter: str, taps=None):
    d = MLADrafter.load(PAIR / drafter, hf.model.embed_tokens.weight.detach())
    taps = taps or aux_ids(d.config)
    drafted, accepted, _ = greedy_acceptance(
        d, lambda ids: torch.cat([hf_all_states(hf, ids)[k] for k in taps], -1), prompts, conts, K
    )
    return accepted / drafted


@pytest.mark.parametrize("drafter", ["eagle3-mla", "eagle3.1-mla"])
def test_trained_pair_acceptance_matches_the_independent_drafter(pair, drafter):
    hf, prompts, conts, plain = pair
    assert plain == conts, "kimitui's float32 greedy output differs from transformers' on the fixture target"
    taps = aux_ids(json.loads((PAIR / drafter / "config.json").read_text()))
    out, st = _kimitui(prompts, drafter)
    assert out == plain  # greedy output unchanged by drafting
    ours = st.acceptance_rate
    ref = _reference(hf, prompts, conts, drafter)
    shifted_out, shifted = _kimitui(prompts, drafter, [t + 1 for t in taps])
    assert shifted_out == plain
    print(
        f"\n{drafter}: kimitui acceptance {ours:.3f} (mean length {st.acceptance_length:.2f}, "
        f"{st.num_draft_tokens} draft tokens), TorchSpec-style reference {ref:.3f}; "
        f"taps {[t + 1 for t in taps]} (one off): {shifted.acceptance_rate:.3f}"
    )
    assert abs(ours - ref) <= 0.02
    assert ours >= 0.6, "the trained drafter should predict its target well"
    assert shifted.acceptance_rate <= ours - 0.10
