"""Presence, frequency and repetition penalties: the formula against a written-out reference, the
sampler (penalised draw, raw log-probs), speculative verification (row j counts the drafts before
it: greedy identical with and without drafts, and the sampled distribution equal to the target's,
which a rule that forgets the drafts fails), and the server accepting the fields."""

from __future__ import annotations

import math

import pytest
import torch

from kimitui.engine import LLM, SamplingParams
from kimitui.engine.sampling.penalties import PenaltyBatch
from kimitui.engine.sampling.sampler import SamplingBatch, sample
from kimitui.engine.spec_decode.rejection import rejection_sample
from tests.engine.spec_decode.scripted import ScriptedProposer
from tests.helpers.checkpoints import write_hf_checkpoint


def reference_penalise(
    row: list[float], prompt: list[int], output: list[int], presence: float, frequency: float, repetition: float
) -> list[float]:
    """One row, token by token, as the OpenAI docs and vLLM describe the three penalties."""
    out = list(row)
    for t in range(len(out)):
        if t in prompt or t in output:
            out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
        c = output.count(t)
        out[t] -= frequency * c + (presence if c else 0.0)
    return out


def make_batch(n, temperature=1.0, max_logprobs=-1) -> SamplingBatch:
    return SamplingBatch(
        temperature=torch.full((n,), temperature),
        top_p=torch.ones(n),
        top_k=torch.zeros(n, dtype=torch.int64),
        generators=[None] * n,
        all_greedy=temperature == 0,
        use_top_k=False,
        use_top_p=False,
        max_logprobs=max_logprobs,
    )


def params(presence=0.0, frequency=0.0, repetition=1.0, **kw):
    return SamplingParams(presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition, **kw)


def test_apply_matches_the_reference_and_leaves_other_rows_alone():
    torch.manual_seed(0)
    V = 17
    logits = torch.randn(5, V) * 3
    ps = [params(0.7, 0.3, 1.4), params(), params(-0.5, 1.1, 0.8), params(0.0, 0.0, 2.0), params(1.0)]
    prompts = [[1, 2, 2, 5], [3], [16, 0], [4, 4, 4], []]
    outputs = [[5, 6, 6, 6, 40], [1], [], [9, 4, 9], [7, 7]]  # 40: outside the vocabulary, ignored
    pb = PenaltyBatch.build(list(range(5)), ps, prompts, outputs, V, torch.device("cpu"))
    got = pb.apply(logits)
    for r in range(5):
        want = reference_penalise(
            logits[r].tolist(),
            prompts[r],
            outputs[r],
            ps[r].presence_penalty,
            ps[r].frequency_penalty,
            ps[r].repetition_penalty,
        )
        assert torch.allclose(got[r], torch.tensor(want), atol=1e-5), r
    assert torch.equal(got[1], logits[1])  # no penalty: untouched
    assert PenaltyBatch.build([0], [params()], [[1]], [[2]], V, torch.device("cpu")) is None


def test_sampler_draws_from_penalised_logits_and_reports_raw_logprobs():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    batch = make_batch(1, temperature=0.0, max_logprobs=2)
    assert sample(logits, batch).token_ids.tolist() == [0]
    batch.penalties = PenaltyBatch.build([0], [params(frequency=0.5)], [[]], [[0]], 4, torch.device("cpu"))
    out = sample(logits, batch)
    assert out.token_ids.tolist() == [1]  # 3.0 - 0.5 < 2.9
    assert out.sampled_logprobs.item() == pytest.approx(logits.log_softmax(-1)[0, 1].item())


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
        ("frequency_penalty", -3, "frequency_penalty must be in [-2, 2]"),
        ("repetition_penalty", 0.0, "repetition_penalty must be in (0, 100]"),
    ],
)
def test_bad_values_name_the_field(field, value, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(")):
        SamplingParams(**{field: value})


# ---- speculative verification with penalties ---------------------------------------------------

V = 6
ROWS = [[1.0, 0.8, 0.6, 0.2, 0.0, -0.4], [0.9, 1.0, 0.5, 0.3, -0.2, 0.1], [0.2, 0.4, 0.6, 0.8, 1.0, 0.0]]
PROMPT, OUTPUT = [3], [2]
PEN = params(presence=1.0, frequency=1.5, repetition=1.3)
Q = [0.4, 0.3, 0.1, 0.1, 0.05, 0.05]
N = 20000


def _target(row, output) -> torch.Tensor:
    pen = reference_penalise(row, PROMPT, output, 1.0, 1.5, 1.3)
    return torch.tensor(pen, dtype=torch.float64).softmax(-1)


def pair_error(forget_drafts: bool) -> float:
    """TV distance (over sqrt(V^2 / n)) between the (first, second) output pairs of N verified
    sequences with two one-hot drafts each and the exact penalised target: p0(a) p1(b | a)."""
    with torch.random.fork_rng():
        torch.manual_seed(7)
        drafts = torch.multinomial(torch.tensor(Q), 2 * N, replacement=True).view(N, 2).tolist()
        logits = torch.tensor(ROWS).repeat(N, 1)
        rows, outputs = [], []
        for d in drafts:
            for j in range(3):
                rows.append(len(rows))
                outputs.append(OUTPUT + ([] if forget_drafts else d[:j]))
        batch = make_batch(N)
        batch.penalties = PenaltyBatch.build(
            rows, [PEN] * len(rows), [PROMPT] * len(rows), outputs, V, torch.device("cpu")
        )
        out = rejection_sample(logits, [2] * N, drafts, batch)
    two = out[(out >= 0).sum(1) >= 2]
    counts = torch.bincount(two[:, 0] * V + two[:, 1], minlength=V * V).double()
    first = counts.view(V, V).sum(1) / counts.sum()  # the pair's own first-token marginal
    want = torch.stack([first[a] * _target(ROWS[1], OUTPUT + [a]) for a in range(V)]).flatten()
    n = counts.sum().item()
    # the first token on its own follows the penalised target of row 0
    firsts = torch.bincount(out[:, 0], minlength=V).double()
    tv0 = 0.5 * (firsts / N - _target(ROWS[0], OUTPUT)).abs().sum().item() / math.sqrt(V / N)
    return max(tv0, 0.5 * (counts / n - want).abs().sum().item() / math.sqrt(V * V / n))


def test_verified_sampling_follows_the_penalised_target():
    assert pair_error(forget_drafts=False) < 1.0


def test_the_check_catches_rows_that_forget_the_drafts():
    assert pair_error(forget_drafts=True) > 2.0


@pytest.fixture(scope="module")
def k2_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("k2pen")
    write_hf_checkpoint(path, seed=3)
    return path


def test_greedy_with_penalties_is_identical_with_and_without_drafts(k2_path):
    prompts = [[5, 9, 9, 30, 7, 9, 12], [40, 41, 40, 41, 40], [100, 3, 3]]
    pen = dict(presence_penalty=0.4, frequency_penalty=0.6, repetition_penalty=1.3)

    def run(speculate, **p):
        llm = LLM(
            str(k2_path),
            max_model_len=128,
            max_num_seqs=4,
            speculative_config={"method": "ngram", "num_speculative_tokens": 4} if speculate else None,
        )
        sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, **p)
        if speculate:
            llm.engine.proposer = ScriptedProposer({tuple(q): ref for q, ref in zip(prompts, answers)})
        outs = [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": q} for q in prompts], sp)]
        return llm, outs

    answers = [[]] * len(prompts)
    _, plain = run(False)
    _, ref = run(False, **pen)
    assert ref != plain  # the penalties change the greedy answer, so the comparison below means something
    answers = ref
    llm, spec = run(True, **pen)
    assert spec == ref
    stats = llm.engine.stats().spec_decode
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
