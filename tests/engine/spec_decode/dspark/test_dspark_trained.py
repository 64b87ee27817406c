"""The trained tiny pair (tests/fixtures/dspark_tiny, made by benchmarks/spec/train_dspark.py): a
tiny Kimi K3 target and a DSpark drafter in lightseekorg/kimi-k3-dspark's layout trained on the
target's own greedy outputs.

- kimitui's acceptance equals (within 2 points) the acceptance that the independent implementation
  (tests/helpers/spec/dspark_reference.py over the naive float64 K3 forward) measures on the same files;
- the same weights with every tap shifted by one layer lose at least 10 points (the test can fail:
  the taps are wired);
- greedy output is the target's with and without drafting;
- sampled output follows the target's distribution (a chi-square homogeneity test against
  sampling without drafting; with a deliberately wrong acceptance rule it fails).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from kimitui.engine import LLM, SamplingParams

FIXTURE = Path(__file__).resolve().parents[3] / "fixtures" / "dspark_tiny"
K = 7
SPEC = {"method": "dspark", "num_speculative_tokens": K, "backoff": False}


def _prompts():
    from benchmarks.spec.train_dspark import EVAL_PROMPTS, prompts

    return prompts(*EVAL_PROMPTS)


def _max_tokens():
    from benchmarks.spec.train_dspark import MAX_TOKENS

    return MAX_TOKENS


def _engine_run(drafter: Path | None, prompts, params):
    kw = {"speculative_config": {**SPEC, "model": str(drafter)}} if drafter else {}
    with LLM(
        str(FIXTURE / "target"), dtype="float32", max_model_len=128, max_num_seqs=8, enable_prefix_caching=False, **kw
    ) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        stats = llm.engine.stats().spec_decode
    return [o.outputs[0].token_ids for o in outs], stats


def _shifted(tmp_path) -> Path:
    d = tmp_path / "shifted"
    shutil.copytree(FIXTURE / "drafter", d)
    c = json.loads((d / "config.json").read_text())
    c["target_layer_ids"] = [k + 1 for k in c["target_layer_ids"]]
    (d / "config.json").write_text(json.dumps(c))
    return d


def _reference(drafter_dir: Path, prompts):
    from safetensors.torch import load_file

    from tests.helpers.k3_reference import K3Reference
    from tests.helpers.spec.dspark_reference import RefDSpark, greedy_speculative

    target_cfg = json.loads((FIXTURE / "target" / "config.json").read_text())
    raw = {}
    for f in (FIXTURE / "target").glob("*.safetensors"):
        raw |= load_file(str(f))
    ref = K3Reference(
        target_cfg, {k[len("language_model.") :]: v for k, v in raw.items() if k.startswith("language_model.")}
    )
    c = json.loads((drafter_dir / "config.json").read_text())
    sd = {k: v.double() for k, v in load_file(str(drafter_dir / "model.safetensors")).items()}
    model = RefDSpark(
        c, ref.w("model.embed_tokens.weight"), ref.w("lm_head.weight"), own_embedding="embed_tokens.weight" in sd
    ).double()
    model.load_state_dict(sd, strict=True)
    drafted = accepted = 0
    outs = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny float64 ops: one thread is many times faster on a shared machine
    try:
        for p in prompts:
            out, d, a = greedy_speculative(ref, model, p, _max_tokens(), K)
            outs.append(out)
            drafted += d
            accepted += a
    finally:
        torch.set_num_threads(threads)
    return outs, accepted / drafted


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    prompts = _prompts()
    greedy = SamplingParams(temperature=0.0, max_tokens=_max_tokens(), ignore_eos=True)
    plain, _ = _engine_run(None, prompts, greedy)
    spec, stats = _engine_run(FIXTURE / "drafter", prompts, greedy)
    shifted, shifted_stats = _engine_run(_shifted(tmp_path_factory.mktemp("s")), prompts, greedy)
    return prompts, plain, spec, stats, shifted, shifted_stats


def test_greedy_output_identical_with_and_without_drafting(runs):
    _, plain, spec, stats, shifted, _ = runs
    assert spec == plain and shifted == plain
    assert stats.num_drafts > 0


def test_acceptance_equals_the_independent_implementation(runs):
    prompts, plain, _, stats, _, _ = runs
    ref_out, ref_rate = _reference(FIXTURE / "drafter", prompts)
    print(
        f"\nkimitui acceptance {stats.acceptance_rate:.3f} ({stats.num_accepted_tokens}/{stats.num_draft_tokens}), "
        f"reference {ref_rate:.3f}; per position {stats.per_position_rates()}"
    )
    assert ref_out == plain  # the reference target agrees with the engine token for token
    assert stats.acceptance_rate > 0.5  # trained: it predicts the target well
    assert abs(stats.acceptance_rate - ref_rate) <= 0.02


def test_shifting_the_taps_by_one_costs_acceptance(runs):
    *_, stats, _, shifted_stats = runs
    print(f"\nacceptance {stats.acceptance_rate:.3f}, taps shifted by one {shifted_stats.acceptance_rate:.3f}")
    assert stats.acceptance_rate - shifted_stats.acceptance_rate >= 0.10


def _chi2_homogeneity(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """Pearson's chi-square statistic of two count vectors (bins with fewer than 10 in total pooled)."""
    keep = (a + b) >= 10
    a2 = torch.cat((a[keep], a[~keep].sum()[None])).double()
    b2 = torch.cat((b[keep], b[~keep].sum()[None])).double()
    if a2[-1] + b2[-1] == 0:
        a2, b2 = a2[:-1], b2[:-1]
    n_a, n_b = a2.sum(), b2.sum()
    tot = a2 + b2
    e_a, e_b = tot * n_a / (n_a + n_b), tot * n_b / (n_a + n_b)
    stat = (((a2 - e_a) ** 2 / e_a) + ((b2 - e_b) ** 2 / e_b)).sum().item()
    return stat, len(tot) - 1


def _critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at 1 - 0.001 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _sampled_counts(drafter, n: int, seed0: int, method: str = "standard"):
    prompt = [5, 9, 17, 33, 65, 129]
    params = [SamplingParams(temperature=0.7, max_tokens=3, ignore_eos=True, seed=seed0 + i) for i in range(n)]
    spec = {**SPEC, "model": str(drafter), "draft_sample_method": "probabilistic", "rejection_sample_method": method}
    kw = {"speculative_config": spec} if drafter else {}
    with LLM(
        str(FIXTURE / "target"), dtype="float32", max_model_len=32, max_num_seqs=128, enable_prefix_caching=False, **kw
    ) as llm:
        outs = llm.generate([{"prompt_token_ids": prompt}] * n, params)
        stats = llm.engine.stats().spec_decode if drafter else None
    toks = torch.tensor([o.outputs[0].token_ids for o in outs])
    return [torch.bincount(toks[:, j], minlength=256) for j in range(3)], stats


def _accept_everything(probs, draft_probs, p_draft, q_draft, k_t, q_of_t, uniform):
    return k_t.clone(), torch.ones(k_t.shape[0], device=k_t.device)


def _sampled_error(monkeypatch=None, wrong=False, method="standard") -> float:
    if wrong:
        from kimitui.engine.spec_decode import rejection

        if method == "block":
            monkeypatch.setattr(rejection, "block_accept", _accept_everything)
        else:
            monkeypatch.setattr(rejection, "_accept_prob", lambda p, q: torch.ones_like(p))
    plain, _ = _sampled_counts(None, 384, 0)
    spec, stats = _sampled_counts(FIXTURE / "drafter", 384, 10_000, method)
    assert stats.num_accepted_tokens > 0
    return max(s / _critical(df) for s, df in (_chi2_homogeneity(a, b) for a, b in zip(plain[1:], spec[1:])))


# vLLM's DSpark recipe verifies with "block" (engine/spec_decode/block_verify.py); both rules are exact
@pytest.mark.slow  # 2 x 384 sampled requests: ~40 s of CPU (minutes on a loaded 2-core machine)
@pytest.mark.parametrize("method", ["standard", "block"])
def test_sampled_output_follows_the_target_distribution(method):
    assert _sampled_error(method=method) < 1.0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["standard", "block"])
def test_the_sampled_check_catches_a_wrong_rule(monkeypatch, method):
    assert _sampled_error(monkeypatch, wrong=True, method=method) > 1.0


def test_the_recipe_verifies_with_block_verification(monkeypatch):
    """vLLM's recipe JSON unchanged ("rejection_sample_method": "block") reaches block verification
    through LLM.generate: sampled requests with probabilistic drafts go through block_accept."""
    from kimitui.engine.spec_decode import rejection

    calls = []

    def spy(*args):
        calls.append(args[4].tolist())  # k_t: the drafts each sequence brought
        return _real_block_accept(*args)

    _real_block_accept = rejection.block_accept
    monkeypatch.setattr(rejection, "block_accept", spy)
    recipe = {
        "method": "dspark",
        "model": str(FIXTURE / "drafter"),
        "num_speculative_tokens": 7,
        "draft_sample_method": "probabilistic",
        "rejection_sample_method": "block",
    }
    params = [SamplingParams(temperature=0.7, max_tokens=6, ignore_eos=True, seed=i) for i in range(4)]
    with LLM(
        str(FIXTURE / "target"), dtype="float32", max_model_len=32, max_num_seqs=4, speculative_config=recipe
    ) as llm:
        outs = llm.generate([{"prompt_token_ids": [5, 9, 17, 33, 65, 129]}] * 4, params)
        stats = llm.engine.stats().spec_decode
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert calls and any(k > 0 for ks in calls for k in ks) and stats.num_drafts > 0
