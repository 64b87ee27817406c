"""Sampled EAGLE-3 drafts (``draft_sample_method: probabilistic``): each draft of a sampled request is
drawn from the MLA drafter's own distribution q at the request's temperature, and q reaches the
rejection rule (accept with min(1, p / q), else draw from norm(max(0, p - q))). The output must be
distributed exactly as the target's: with the trained tiny pair (tests/fixtures/eagle3_mla_pair),
one prompt, 3 tokens at temperature 1, the joint of (token 1, token 2) (token 2 is the first
verified position) against the exact joint from Hugging Face's model, by a chi-square statistic as
tests/engine/spec_decode/test_rejection.py's check reads its errors. The same check run with the
rule that ignores q (accept with p(x)) must fail, so the test can."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kimitui.engine import LLM, SamplingParams
from kimitui.engine.spec_decode import rejection

PAIR = Path(__file__).resolve().parents[2] / "fixtures" / "eagle3_mla_pair"
PROMPT = [17, 91, 5, 203, 44, 150, 77, 12]
N = 1500


@pytest.fixture(scope="module")
def exact_joint():
    from transformers import DeepseekV3ForCausalLM

    hf = DeepseekV3ForCausalLM.from_pretrained(str(PAIR / "target"), dtype=torch.float32,
                                               attn_implementation="eager").eval()
    with torch.no_grad():
        p1 = hf(torch.tensor([PROMPT])).logits[0, -1].softmax(-1)  # [V]
        V = p1.shape[0]
        rows = torch.cat([torch.tensor(PROMPT).repeat(V, 1), torch.arange(V)[:, None]], 1)
        p2 = torch.cat([hf(rows[a:a + 64]).logits[:, -1].softmax(-1) for a in range(0, V, 64)])  # [V, V]
    return (p1[:, None] * p2).double()


def _samples(method: str) -> tuple[torch.Tensor, float]:
    spec = {"method": "eagle3", "model": str(PAIR / "eagle3-mla"), "num_speculative_tokens": 3, "backoff": False,
            "draft_sample_method": method}
    llm = LLM(str(PAIR / "target"), dtype="float32", max_model_len=64, max_num_seqs=64, speculative_config=spec,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": PROMPT} for _ in range(N)], params)
    st = llm.engine.stats().spec_decode
    llm.engine.shutdown()
    toks = torch.tensor([list(o.outputs[0].token_ids)[:2] for o in outs])
    return toks, st.acceptance_rate


def chi_square_z(toks: torch.Tensor, joint: torch.Tensor) -> float:
    """(X2 - dof) / sqrt(2 dof) over the cells expected 5+ times (the rest pooled into one)."""
    V = joint.shape[0]
    counts = torch.bincount(toks[:, 0] * V + toks[:, 1], minlength=V * V).double()
    expected = joint.flatten() * toks.shape[0]
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    x2 = ((obs - exp) ** 2 / exp.clamp(min=1e-9)).sum().item()
    dof = obs.numel() - 1
    return (x2 - dof) / math.sqrt(2 * dof)


def test_sampled_drafts_keep_the_target_distribution(exact_joint, monkeypatch):
    toks, acceptance = _samples("probabilistic")
    z = chi_square_z(toks, exact_joint)
    print(f"\nprobabilistic drafts: acceptance {acceptance:.3f}, chi-square z {z:.2f}")
    assert acceptance > 0.3  # drafts are really verified (and the q rule really used)
    assert z < 4.0
    # the rule that ignores q (as if drafts were one-hot) is caught by the same check
    monkeypatch.setattr(rejection, "_accept_prob", lambda p_draft, q_draft: p_draft)
    monkeypatch.setattr(rejection, "_residual", lambda p_rows, q_rows, drafts: p_rows.scatter(1, drafts[:, None], 0.0))
    bad, _ = _samples("probabilistic")
    z_bad = chi_square_z(bad, exact_joint)
    print(f"q ignored: chi-square z {z_bad:.2f}")
    assert z_bad > 6.0
