"""n > 1 and best_of (engine/sampling/fanout.py): choices, seeds, a prompt computed once.

The demo checkpoint (K2-shaped), the toy hybrid model (KDA-like state, tests/helpers/toy_hybrid.py)
and, marked slow, the demo-k3 checkpoint (real KDA + MLA layers) run here: the children are forked
from the leader's prefill step (the partial last block and the KDA state copied), and each child's
tokens and log-probs equal the single-sample request with its seed.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

import kimitui.engine.engine as engine_module
from kimitui.engine import LLM
from kimitui.engine.args import EngineArgs
from kimitui.engine.engine import LLMEngine
from kimitui.engine.sampling_params import SamplingParams
from tests.helpers.checkpoints import BASE
from tests.helpers.engine_run import run_to_finish as _run
from tests.helpers.toy_hybrid import ToyHybrid

BS = 16


@pytest.fixture(scope="module")
def demo_llm():
    # float32: choices are compared with single requests to 1e-4, and a bf16 step's rows go through
    # oneDNN from 6 rows on, whose bits depend on the batch
    return LLM(max_model_len=512, max_num_seqs=8, dtype="float32")


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 300) for _ in range(n)]


def _computed_prompt(engine: LLMEngine) -> int:
    return engine.stats().computed_prompt_tokens


def test_n_returns_n_choices_reproducible_with_a_seed_and_the_prompt_computed_once(demo_llm):
    eng = demo_llm.engine
    prompt = _prompt(100)  # 6 full blocks + 4 tokens
    params = SamplingParams(temperature=1.0, max_tokens=5, n=4, seed=7, ignore_eos=True)
    before, hits_before = _computed_prompt(eng), eng.stats().prefix_cache_hits
    [out] = demo_llm.generate({"prompt_token_ids": prompt}, params)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 5 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds, different samples
    # the prompt ran once, to the token (the children were forked, the partial block copied),
    # and was looked up in the prefix cache once (a cold miss)
    assert _computed_prompt(eng) - before == len(prompt)
    assert eng.stats().prefix_cache_hits - hits_before == 0
    # same seed, same choices (the prompt is cached now: sampling does not depend on it)
    [again] = demo_llm.generate({"prompt_token_ids": prompt}, params)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    # child i samples with seed + i: child 2 is the n=1 request seeded with 9
    [single] = demo_llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=1.0, max_tokens=5, seed=9, ignore_eos=True)
    )
    assert single.outputs[0].token_ids == out.outputs[2].token_ids


def test_best_of_returns_the_n_highest_cumulative_logprobs(demo_llm):
    prompt = _prompt(40, seed=1)
    [every] = demo_llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, n=4, seed=3, logprobs=0, ignore_eos=True)
    )
    [best] = demo_llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, n=2, best_of=4, seed=3, ignore_eos=True)
    )
    ranked = sorted(every.outputs, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked]
    assert [c.index for c in best.outputs] == [0, 1]
    assert all(c.logprobs is None for c in best.outputs)  # not asked for: ranking only
    assert best.outputs[0].cumulative_logprob >= best.outputs[1].cumulative_logprob


def _assert_same(a, b, tol=1e-4):
    assert a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < tol for t in x), (x, y)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_choice_equals_the_single_request_with_its_seed(demo_llm, temperature):
    prompt = _prompt(37, seed=5)  # 2 full blocks + 5 tokens
    kw = dict(temperature=temperature, max_tokens=6, logprobs=2, ignore_eos=True)
    [out] = demo_llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=4, seed=20, **kw))
    singles = demo_llm.generate(
        [{"prompt_token_ids": prompt}] * 4, [SamplingParams(seed=20 + i, **kw) for i in range(4)]
    )
    for c, s in zip(out.outputs, singles, strict=True):
        _assert_same(c, s.outputs[0])
    if temperature == 0.0:
        assert len({tuple(c.token_ids) for c in out.outputs}) == 1


def test_a_fork_in_a_graphed_decode_step(monkeypatch):
    """A warm prompt of 2 full blocks + 1 token: the leader's first sample is a one-row decode, run
    through the decode graphs' static buffers (direct calls on a CPU); the fork's block copy
    happens there."""
    monkeypatch.setattr(LLMEngine, "_decode_graphs", lambda self: True)
    llm = LLM(max_model_len=256, max_num_seqs=4, dtype="float32")
    graphs = llm.engine.runner.graphs
    runs = []
    real_run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda ids, *a: runs.append(ids.shape[0]) or real_run(ids, *a))
    prompt = {"prompt_token_ids": _prompt(33, seed=8)}
    kw = dict(temperature=1.0, max_tokens=4, logprobs=1, ignore_eos=True)
    llm.generate(prompt, SamplingParams(max_tokens=1))  # caches the 2 full blocks
    before, runs[:] = _computed_prompt(llm.engine), []
    [out] = llm.generate(prompt, SamplingParams(n=4, seed=40, **kw))
    assert _computed_prompt(llm.engine) - before == 1 and runs[0] == 1  # the leader's last token, graphed
    singles = llm.generate([prompt] * 4, [SamplingParams(seed=40 + i, **kw) for i in range(4)])
    for c, s in zip(out.outputs, singles, strict=True):
        _assert_same(c, s.outputs[0])


def _blocks_and_slots(eng: LLMEngine):
    bm = eng.block_manager
    slots = bm.state_slots
    if slots is not None:
        slots.check_consistent()
    return bm.num_free_blocks, sum(b.ref_count for b in bm.blocks), slots.num_free_seq_slots if slots else None


def test_abort_of_a_fanned_out_request_frees_every_child(demo_llm):
    eng = demo_llm.engine
    start = _blocks_and_slots(eng)
    eng.add_request("fan", {"prompt_token_ids": _prompt(50, 2)}, SamplingParams(max_tokens=50, n=3, ignore_eos=True))
    eng.step()
    assert eng.request_ids() == ["fan"]
    assert eng.abort_request("fan")
    assert not eng.has_unfinished_requests() and eng.request_ids() == []
    assert eng.block_manager.usage == 0.0 and _blocks_and_slots(eng) == start
    # mid-decode: forked children running beside their leader
    eng.add_request("fan2", {"prompt_token_ids": _prompt(50, 3)}, SamplingParams(max_tokens=50, n=3, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.scheduler.num_running == 3
    assert eng.abort_request("fan2")
    assert not eng.has_unfinished_requests() and _blocks_and_slots(eng) == start


def test_sampling_params_check_n_and_best_of():
    with pytest.raises(ValueError, match="n must be >= 1"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="best_of must be >= n"):
        SamplingParams(n=3, best_of=2)


@pytest.fixture
def hybrid_engine(monkeypatch, tmp_path):
    from transformers import DeepseekV3Config

    DeepseekV3Config(**{**BASE, "max_position_embeddings": 2048}).save_pretrained(str(tmp_path))
    monkeypatch.setattr("kimitui.engine.runner.worker.load_model", lambda *a, **k: (ToyHybrid(), None))

    def make(**kw) -> LLMEngine:
        return LLMEngine(
            EngineArgs(
                **{
                    **dict(
                        model=str(tmp_path),
                        device="cpu",
                        dtype="float32",
                        max_model_len=1024,
                        max_num_seqs=4,
                        kv_cache_tokens=4096,
                    ),
                    **kw,
                }
            )
        )

    return make


def test_hybrid_children_fork_the_prompt_state_with_cold_results(hybrid_engine):
    prompt = _prompt(600, seed=3)
    params = SamplingParams(temperature=0.8, max_tokens=5, n=3, seed=11, logprobs=2, ignore_eos=True)
    warm = hybrid_engine()
    start = _blocks_and_slots(warm)
    out = _run(warm, "r", prompt, params)
    assert warm.stats().computed_prompt_tokens == len(prompt)
    assert warm.stats().prefix_cache_hits == 0 and warm.stats().prefix_cache_queries == len(prompt)
    assert _blocks_and_slots(warm) == start
    # each child equals its seed's single-sample run on a cold engine (no cache at all)
    cold = hybrid_engine(enable_prefix_caching=False)
    for i, c in enumerate(out.outputs):
        ref = _run(
            cold,
            f"c{i}",
            prompt,
            SamplingParams(temperature=0.8, max_tokens=5, seed=11 + i, logprobs=2, ignore_eos=True),
        ).outputs[0]
        _assert_same(c, ref, 1e-5)
    # without prefix caching the samples are forked all the same
    before = cold.stats().computed_prompt_tokens
    again = _run(cold, "r", prompt, params)
    assert cold.stats().computed_prompt_tokens - before == len(prompt)
    for a, b in zip(again.outputs, out.outputs, strict=True):
        _assert_same(a, b, 1e-5)


def test_hybrid_children_that_cannot_fork_fall_back_with_cold_results(hybrid_engine):
    """max_num_seqs=4 leaves room for the leader and 3 forks: the other 2 children are queued after
    the leader's prefill step and recompute the prompt's tail from its last full block's snapshot."""
    prompt = _prompt(300, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=4, n=6, logprobs=1, ignore_eos=True)
    eng = hybrid_engine()
    start = _blocks_and_slots(eng)
    out = _run(eng, "r", prompt, params)
    tail = len(prompt) - (len(prompt) - 1) // BS * BS
    assert eng.stats().computed_prompt_tokens == len(prompt) + 2 * tail
    assert _blocks_and_slots(eng) == start
    ref = _run(hybrid_engine(enable_prefix_caching=False), "c", prompt, replace(params, n=1)).outputs[0]
    for c in out.outputs:
        _assert_same(c, ref, 1e-5)


def test_hybrid_forked_children_preempted_for_lack_of_blocks_recompute_with_cold_results(hybrid_engine):
    """A cache of 1024 tokens for 4 samples of 300 + 200 tokens, the prompt shared: the latest
    admitted are preempted and come back the ordinary way (prefix hit, snapshot, recompute); every
    block and slot returns."""
    prompt = _prompt(300, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=200, n=4, logprobs=1, ignore_eos=True)
    eng = hybrid_engine(kv_cache_tokens=1024)
    start = _blocks_and_slots(eng)
    out = _run(eng, "r", prompt, params)
    assert eng.scheduler.num_preemptions > 0
    assert _blocks_and_slots(eng) == start
    ref = _run(hybrid_engine(enable_prefix_caching=False), "c", prompt, replace(params, n=1)).outputs[0]
    for c in out.outputs:
        _assert_same(c, ref, 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_demo_k3_choices_equal_cold_single_requests_and_the_prompt_is_computed_once(temperature):
    """Acceptance on demo-k3 (KDA + MLA layers): n=4 on a cold cache computes the prompt once, and
    each choice equals a cold engine's single-sample request with its seed."""
    args = dict(model="demo-k3", device="cpu", max_model_len=256, kv_cache_tokens=2048, max_num_seqs=4)
    prompt = _prompt(45, seed=6)  # 2 full blocks + 13 tokens
    kw = dict(temperature=temperature, max_tokens=5, logprobs=2, ignore_eos=True)
    eng = LLMEngine(EngineArgs(**args))
    start = _blocks_and_slots(eng)
    out = _run(eng, "r", prompt, SamplingParams(n=4, seed=30, **kw))
    assert eng.stats().computed_prompt_tokens == len(prompt)
    assert _blocks_and_slots(eng) == start
    cold = LLMEngine(EngineArgs(**args, enable_prefix_caching=False))
    for i, c in enumerate(out.outputs):
        _assert_same(c, _run(cold, f"c{i}", prompt, SamplingParams(seed=30 + i, **kw)).outputs[0])


class _TokenHashProposer:
    """Drafts that depend on a sequence's own tokens only, so a child and the single request with
    its seed verify the same drafts (an n-gram proposer finds nothing to draft in random text)."""

    needs_hidden = False

    def propose(self, seqs, max_drafts, hidden=None):
        return [[(sum(seq.token_ids[-3:]) * 31 + j) % 250 + 5 for j in range(k)] for seq, k in zip(seqs, max_drafts)]

    def finish(self, seq_id):
        pass


def test_forks_keep_speculative_decoding_penalties_and_stop_strings():
    """Each child verifies drafts, applies its penalties to its own output and stops at its own
    stop string, exactly as the single request with its seed does on the same engine."""
    from tests.engine.spec_decode.scripted import ScriptedProposer

    # back-off off: its probes are rationed over the batch, so draft lengths (and with them the random
    # draws) would depend on which sequences share a step, which differs between forks and singles
    llm = LLM(
        max_model_len=256,
        max_num_seqs=8,
        dtype="float32",
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "backoff": False},
    )
    llm.engine.proposer = _TokenHashProposer()
    prompt = {"prompt_token_ids": _prompt(20, seed=9)}
    kw = dict(temperature=0.8, max_tokens=24, logprobs=1, repetition_penalty=1.3, frequency_penalty=0.5, stop=["e"])
    [out] = llm.generate(prompt, SamplingParams(n=4, seed=50, **kw))
    assert llm.engine.stats().computed_prompt_tokens == 20
    singles = llm.generate([prompt] * 4, [SamplingParams(seed=50 + i, **kw) for i in range(4)])
    for c, s in zip(out.outputs, singles, strict=True):
        _assert_same(c, s.outputs[0])
        assert (c.text, c.finish_reason, c.stop_reason) == (
            s.outputs[0].text,
            s.outputs[0].finish_reason,
            s.outputs[0].stop_reason,
        )
    assert llm.engine.stats().spec_decode.num_drafts > 0
    # greedy, with drafts of the right answer (some spoilt): accepted ones too
    greedy = dict(kw, temperature=0.0, stop=None, max_tokens=16)
    [ref] = llm.generate(prompt, SamplingParams(**greedy))
    llm.engine.proposer = ScriptedProposer({tuple(ref.prompt_token_ids): list(ref.outputs[0].token_ids)})
    before = llm.engine.stats().spec_decode.num_accepted_tokens
    [out] = llm.generate(prompt, SamplingParams(n=3, **greedy))
    for c in out.outputs:
        _assert_same(c, ref.outputs[0])
    assert llm.engine.stats().spec_decode.num_accepted_tokens > before
    assert _blocks_and_slots(llm.engine)[1] == 0


def test_each_fork_has_its_own_grammar(demo_llm):
    pytest.importorskip("llguidance")
    import json

    from kimitui.engine.structured import StructuredOutputs
    from tests.helpers.schema_check import schema_errors

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    kw = dict(temperature=1.0, max_tokens=120, structured_outputs=StructuredOutputs(json=schema))
    [out] = demo_llm.generate("Give me JSON", SamplingParams(n=3, seed=60, **kw))
    singles = demo_llm.generate(["Give me JSON"] * 3, [SamplingParams(seed=60 + i, **kw) for i in range(3)])
    for c, s in zip(out.outputs, singles, strict=True):
        assert c.token_ids == s.outputs[0].token_ids and c.finish_reason == "stop"
        assert not schema_errors(json.loads(c.text), schema), c.text
    assert len({c.text for c in out.outputs}) > 1
    assert not demo_llm.engine.runner.structured.requests
