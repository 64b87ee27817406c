"""EAGLE-3 end to end on a K2-shaped target: a drafter checkpoint written in the published layout
loads through ``speculative_config``, greedy output is token for token the same as without
speculation (mixed batches, chunked prefill), acceptance is counted, and every draft the proposer
makes equals a dense float64 re-computation of the drafter over the sequence's whole history (so
the drafter's paged KV stays right across steps, accepted drafts and overwritten guesses)."""

from __future__ import annotations

import random

import pytest
import torch

from kimitui.engine import LLM, SamplingParams
from kimitui.engine.spec_decode.eagle3.proposer import Eagle3Proposer
from tests.helpers.checkpoints import BASE, write_hf_checkpoint
from tests.helpers.spec.eagle3_checkpoint import write_eagle3_checkpoint
from tests.helpers.spec.eagle3_reference import hf_aux_states, reference

K = 3


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    target = tmp_path_factory.mktemp("k2")
    hf = write_hf_checkpoint(target, seed=3)
    drafter = tmp_path_factory.mktemp("eagle3")
    # no eagle_config ids: the default (2, L // 2, L - 3) = (2, 1, 0) of the 3-layer target
    config, w = write_eagle3_checkpoint(drafter, BASE, layout="model", draft_vocab_size=200, seed=4)
    return target, hf, drafter, config, w


def _prompts(n, lens, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(lens[i % len(lens)])] for i in range(n)]


def _llm(target, drafter=None, **kw):
    spec = None if drafter is None else {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": K}
    return LLM(str(target), max_model_len=256, max_num_seqs=4, max_num_batched_tokens=48, speculative_config=spec, **kw)


def _greedy(llm, prompts, n):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_greedy_output_is_unchanged_and_acceptance_counted(ckpts):
    target, _, drafter, _, _ = ckpts
    prompts = _prompts(5, [7, 40, 90, 13])  # prefills of 90 tokens take two chunks of the 48-token budget
    ref = _greedy(_llm(target), prompts, 14)
    llm = _llm(target, drafter)
    assert isinstance(llm.engine.proposer, Eagle3Proposer)
    assert llm.engine.model.model.aux_layers == (0, 1, 2)
    assert _greedy(llm, prompts, 14) == ref
    stats = llm.engine.stats().spec_decode
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    print(
        f"\neagle3, random drafter: {stats.num_drafts} drafts, {stats.num_draft_tokens} draft tokens, "
        f"acceptance {stats.acceptance_rate:.3f}, mean acceptance length {stats.acceptance_length:.3f}, "
        f"per position {stats.per_position_rates()}"
    )
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    assert not llm.engine.proposer._last, "per-sequence drafter state leaked"


class Recording:
    """Wraps the engine's Eagle3Proposer: records each of its drafts with the sequence's tokens, and
    hands the engine a scripted draft instead (the known answer with one wrong token at a random
    place), so verification accepts 0..K drafts and the drafter sees multi-row verified spans."""

    needs_hidden = True

    def __init__(self, inner: Eagle3Proposer, answers: dict[tuple[int, ...], list[int]], seed: int = 0):
        self.inner, self.answers, self.rng = inner, answers, random.Random(seed)
        self.records: list[tuple[list[int], list[int]]] = []

    def propose(self, seqs, max_drafts, hidden=None):
        drafts = self.inner.propose(seqs, max_drafts, hidden)
        out = []
        for seq, d in zip(seqs, drafts):
            if d:
                self.records.append((list(seq.token_ids), list(d)))
            ans = self.answers[tuple(seq.prompt_token_ids)][seq.num_output_tokens :][: len(d)]
            if ans and self.rng.random() < 0.7:
                j = self.rng.randrange(len(ans) + 1)
                ans = ans[:j] + [(ans[j] + 1) % 300] + ans[j + 1 :] if j < len(ans) else ans
            out.append(ans)
        return out

    def finish(self, seq_id):
        self.inner.finish(seq_id)


def test_every_draft_matches_a_dense_recomputation(ckpts):
    target, hf, drafter, config, w = ckpts
    prompts = _prompts(3, [11, 60, 25], seed=1)
    ref = _greedy(_llm(target), prompts, 12)
    llm = _llm(target, drafter)
    rec = Recording(llm.engine.proposer, {tuple(p): r for p, r in zip(prompts, ref)})
    llm.engine.proposer = rec
    assert _greedy(llm, prompts, 12) == ref
    stats = llm.engine.stats().spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # acceptances and rejections both seen
    assert len(rec.records) > 10
    fc, emb = w["fc.weight"].double(), hf.model.embed_tokens.weight.detach()
    d2t_ids = torch.arange(200) + w["d2t"]
    rng = random.Random(2)
    for tokens, drafts in rng.sample(rec.records, 8):
        p = len(tokens) - 1  # rows 0..p-1 are verified; row p-1 takes the token just sampled
        aux = hf_aux_states(hf, tokens[:p], (0, 1, 2)).double()
        hidden = [aux[i] @ fc.T for i in range(p)]
        inputs = tokens[1:]
        want = []
        for _ in drafts:
            pre, normed = reference(config, w, emb, inputs, hidden)
            want.append(int(d2t_ids[(normed[-1] @ w["lm_head.weight"].double().T).argmax()]))
            inputs, hidden = inputs + [want[-1]], hidden + [pre[-1]]
        assert drafts == want, f"drafts after {p + 1} tokens"


@pytest.mark.slow
def test_tensor_parallel_two_ranks(ckpts):
    # the drafter runs on rank 0 with a whole copy of the target's (vocabulary-split) embedding
    target, _, drafter, _, _ = ckpts
    prompts = _prompts(3, [9, 30, 14], seed=2)
    ref = _greedy(_llm(target), prompts, 10)
    with _llm(target, drafter, tensor_parallel_size=2) as llm:
        assert _greedy(llm, prompts, 10) == ref
        assert llm.engine.stats().spec_decode.num_drafts > 0


def test_forked_samples_carry_the_drafters_kv_and_stay_exact(ckpts):
    """n = 3 greedy: the samples forked from the first (engine/scheduler/scheduler.py) get the drafter's KV of
    the prompt's partial last block with the target's, and their output equals the single request's."""
    target, _, drafter, _, _ = ckpts
    [prompt] = _prompts(1, [40], seed=5)  # 2 full blocks + 8 tokens, one prefill step
    [ref] = _greedy(_llm(target), [prompt], 12)
    llm = _llm(target, drafter)
    eng = llm.engine
    eng.add_request(
        "r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=3)
    )
    eng.step()
    lead, *kids = (eng.scheduler.get(f"r#{i}") for i in range(3))
    cache, bs = eng.proposer.cache, eng.args.block_size
    for k in kids:
        assert k.block_table[:2] == lead.block_table[:2] and k.block_table[2] != lead.block_table[2]
        assert torch.equal(cache[k.block_table[2], : 40 - 2 * bs], cache[lead.block_table[2], : 40 - 2 * bs])
    final = None
    while eng.has_unfinished_requests():
        final = next((o for o in eng.step() if o.finished), final)
    assert [list(c.token_ids) for c in final.outputs] == [ref] * 3
    assert eng.stats().computed_prompt_tokens == 40
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
