"""Structured outputs through the engine on the random-weight demo model: every sample matches its
schema, greedy speculative decoding under a grammar gives the same ids as without it (drafts the
grammar refuses are rejected), and matcher state goes when a request finishes or is aborted."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance")

from kimitui.engine import LLM, SamplingParams  # noqa: E402
from kimitui.engine.structured import StructuredOutputs  # noqa: E402
from kimitui.engine.structured.grammar import GrammarError  # noqa: E402
from tests.engine.spec_decode.scripted import ScriptedProposer  # noqa: E402
from tests.helpers.schema_check import schema_errors  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Hello there", "Give me a person", "JSON please", "x"]


@pytest.fixture(scope="module")
def llm():
    return LLM("demo", max_model_len=512, max_num_seqs=16, kv_cache_tokens=8192)


def _params(seed, **kw):
    return SamplingParams(
        temperature=kw.pop("temperature", 1.0),
        seed=seed,
        max_tokens=kw.pop("max_tokens", 200),
        structured_outputs=StructuredOutputs(json=SCHEMA),
        **kw,
    )


@pytest.mark.parametrize("n", [6, pytest.param(48, marks=pytest.mark.slow)])
def test_every_sample_matches_the_schema(llm, n):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    params = [_params(seed) for seed in range(n)]
    # unconstrained requests batched beside the constrained ones are left alone
    prompts += PROMPTS[:2]
    params += [SamplingParams(temperature=1.0, seed=1, max_tokens=8, ignore_eos=True)] * 2
    outs = llm.generate(prompts, params)
    for o in outs[:n]:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        assert not schema_errors(json.loads(c.text), SCHEMA), c.text
    assert [len(o.outputs[0].token_ids) for o in outs[n:]] == [8, 8]
    assert not llm.engine.runner.structured.requests  # released at finish


def test_seeded_constrained_sampling_is_reproducible(llm):
    a = llm.generate(PROMPTS[:2], [_params(7)] * 2)
    b = llm.generate(PROMPTS[1::-1], [_params(7)] * 2)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b][::-1]


def test_bad_schema_fails_that_request_only(llm):
    bad = SamplingParams(structured_outputs=StructuredOutputs(json={"type": "nonsense"}))
    with pytest.raises(GrammarError, match="Invalid type"):
        llm.engine.add_request("bad", "hi", bad)
    assert "bad" not in llm.engine.runner.structured.requests and not llm.engine.has_unfinished_requests()


def test_abort_releases_the_matcher(llm):
    eng = llm.engine
    eng.add_request("gone", "Hello", _params(3, max_tokens=400))
    for _ in range(3):
        eng.step()
    assert "gone" in eng.runner.structured.requests
    assert eng.abort_request("gone")
    assert "gone" not in eng.runner.structured.requests


@pytest.mark.parametrize("n", [3, pytest.param(12, marks=pytest.mark.slow)])
def test_greedy_speculative_decoding_under_a_grammar_is_exact(n):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(n)]
    greedy = [_params(None, temperature=0.0) for _ in prompts]
    ref_llm = LLM("demo", max_model_len=512, max_num_seqs=8, kv_cache_tokens=8192)
    ref = ref_llm.generate(prompts, greedy)
    answers = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in ref}
    spec = LLM(
        "demo",
        max_model_len=512,
        max_num_seqs=8,
        kv_cache_tokens=8192,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )
    # right answers with deliberate mistakes: most mistakes are tokens the grammar refuses there
    spec.engine.proposer = ScriptedProposer(answers, error_rate=0.3)
    outs = spec.generate(prompts, greedy)
    for a, b in zip(ref, outs):
        assert list(b.outputs[0].token_ids) == list(a.outputs[0].token_ids)
        assert not schema_errors(json.loads(b.outputs[0].text), SCHEMA)
    stats = spec.engine.stats().spec_decode
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert not spec.engine.runner.structured.requests


OPEN_SCHEMA = {
    "type": "object",  # no additionalProperties: closed as vLLM's default does
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}}, "required": ["kind"]},
    },
    "required": ["name", "age", "pet"],
}


def test_schemas_that_leave_extra_keys_open_are_closed(llm):
    from kimitui.engine.structured.grammar import close_objects

    closed = close_objects(OPEN_SCHEMA)
    assert closed["additionalProperties"] is False and closed["properties"]["pet"]["additionalProperties"] is False
    assert close_objects({"properties": {}, "additionalProperties": True})["additionalProperties"] is True
    assert "additionalProperties" not in close_objects({"type": "object"})  # json_object stays any object
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=120, structured_outputs=StructuredOutputs(json=OPEN_SCHEMA))
        for s in range(6)
    ]
    for o in llm.generate([PROMPTS[s % len(PROMPTS)] for s in range(6)], params):
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        value = json.loads(c.text)
        assert set(value) == {"name", "age", "pet"} and set(value["pet"]) == {"kind"}, c.text
