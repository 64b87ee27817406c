"""Sampled EAGLE-3 drafts (``draft_sample_method: probabilistic``): each draft of a sampled request is
drawn from the MLA drafter's own distribution q at the request's temperature, and q reaches the
rejection rule (accept with min(1, p / q), else draw from norm(max(0, p - q))). With the trained tiny
pair (tests/fixtures/eagle3_mla_pair), one prompt, 3 tokens at temperature 0.5, the joint of
(token 1, token 2) (token 2 is the first verified position) is checked against the exact joint
from Hugging Face's model by a chi-square statistic over bins of equal expected mass, and the q
rows the rule received are checked to be the drafts' distributions. (That the rule itself catches
a wrong q handling is test_rejection.py's chi-square check; here the tiny drafter is so much sharper
than the flat target that a rule ignoring q shifts the output too little to see in 1500 samples.)"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kimitui.engine import LLM, SamplingParams
from kimitui.engine.spec_decode import rejection

PAIR = Path(__file__).resolve().parents[3] / "fixtures" / "eagle3_mla_pair"
PROMPT = [17, 91, 5, 203, 44, 150, 77, 12]
N = 1500
TEMP = 0.5


@pytest.fixture(scope="module")
def exact_joint():
    from transformers import DeepseekV3ForCausalLM

    hf = DeepseekV3ForCausalLM.from_pretrained(
        str(PAIR / "target"), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        p1 = (hf(torch.tensor([PROMPT])).logits[0, -1] / TEMP).softmax(-1)  # [V]
        V = p1.shape[0]
        rows = torch.cat([torch.tensor(PROMPT).repeat(V, 1), torch.arange(V)[:, None]], 1)
        p2 = torch.cat([(hf(rows[a : a + 64]).logits[:, -1] / TEMP).softmax(-1) for a in range(0, V, 64)])  # [V, V]
    return (p1[:, None] * p2).double()


def _samples(method: str) -> tuple[torch.Tensor, float]:
    spec = {
        "method": "eagle3",
        "model": str(PAIR / "eagle3-mla"),
        "num_speculative_tokens": 3,
        "backoff": False,
        "draft_sample_method": method,
    }
    llm = LLM(
        str(PAIR / "target"),
        dtype="float32",
        max_model_len=64,
        max_num_seqs=64,
        speculative_config=spec,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=TEMP, max_tokens=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": PROMPT} for _ in range(N)], params)
    st = llm.engine.stats().spec_decode
    llm.engine.shutdown()
    toks = torch.tensor([list(o.outputs[0].token_ids)[:2] for o in outs])
    return toks, st.acceptance_rate


def chi_square_z(toks: torch.Tensor, joint: torch.Tensor, bins: int = 25) -> float:
    """(X2 - dof) / sqrt(2 dof) over ``bins`` cells of equal expected mass: the (token 1, token 2)
    cells sorted by their exact probability and cut into bins (the target is too flat for cells
    of their own to be expected 5+ times)."""
    V = joint.shape[0]
    flat = joint.flatten()
    order = flat.argsort(descending=True)
    before = flat[order].cumsum(0) - flat[order]
    bin_of = torch.empty(V * V, dtype=torch.int64)
    bin_of[order] = (before * bins).floor().long().clamp(max=bins - 1)
    obs = torch.bincount(bin_of[toks[:, 0] * V + toks[:, 1]], minlength=bins).double()
    exp = torch.zeros(bins, dtype=torch.float64).index_add_(0, bin_of, flat) * toks.shape[0]
    keep = exp > 0
    x2 = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum().item()
    dof = int(keep.sum()) - 1
    return (x2 - dof) / math.sqrt(2 * dof)


def test_sampled_drafts_keep_the_target_distribution(exact_joint, monkeypatch):
    seen = []
    real = rejection.rejection_sample

    def spy(logits, num_drafts, draft_token_ids, batch, draft_probs=None, method="standard"):
        if sum(num_drafts):
            seen.append((draft_probs, [t for d in draft_token_ids for t in d]))
        return real(logits, num_drafts, draft_token_ids, batch, draft_probs, method)

    monkeypatch.setattr(rejection, "rejection_sample", spy)
    from kimitui.engine.spec_decode import verify

    monkeypatch.setattr(verify, "rejection_sample", spy)
    toks, acceptance = _samples("probabilistic")
    z = chi_square_z(toks, exact_joint)
    print(f"\nprobabilistic drafts: acceptance {acceptance:.3f}, chi-square z {z:.2f}")
    assert acceptance > 0.02  # drafts are verified, some accepted (the drafter, trained on argmax labels,
    # is far sharper than the flat target at this temperature: q and p differ a lot)
    assert z < 4.0
    # q reached the rule: a distribution per draft (not one-hot), under which each draft is possible
    assert seen and all(q is not None for q, _ in seen)
    q, drafts = seen[0]
    torch.testing.assert_close(q.sum(-1), torch.ones(q.shape[0]), atol=1e-4, rtol=0)
    assert (q[torch.arange(len(drafts)), torch.tensor(drafts)] > 0).all() and (q.max(-1).values < 1).any()
