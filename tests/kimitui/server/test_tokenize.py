"""vLLM's tokenizer endpoints and the completions features lm-evaluation-harness needs (echo +
logprobs, max_tokens 0 and 1, return_tokens_as_token_ids), against a real uvicorn on the demo model."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from kimitui.engine import AsyncLLM, EngineArgs, SamplingParams
from kimitui.server import BackgroundServer, create_app

MODEL = "kimitui-demo"
AUTH = {"Authorization": "Bearer secret"}  # the tokenizer routes do work: they need the key too


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    os.environ.setdefault("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg"))
    llm = AsyncLLM(engine_args=EngineArgs(max_model_len=256, max_num_seqs=4, kv_cache_tokens=2048))
    server = BackgroundServer(port=0).start(create_app(llm, MODEL, api_key="secret"))
    yield llm, server.url
    server.stop()
    llm.shutdown()


def test_tokenize_and_detokenize_round_trip(served):
    llm, url = served
    tok = llm.tokenizer
    r = httpx.post(f"{url}/tokenize", json={"prompt": "Hello there, world", "return_token_strs": True}, headers=AUTH)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("Hello there, world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    r = httpx.post(f"{url}/detokenize", json={"tokens": body["tokens"]}, headers=AUTH)
    assert r.json() == {"prompt": "Hello there, world"}
    # special-token text is the special token, as a Hugging Face tokenizer reads it
    eos_text = httpx.get(f"{url}/tokenizer_info", headers=AUTH).json()["eos_token"]
    ids = httpx.post(f"{url}/tokenize", json={"prompt": eos_text}, headers=AUTH).json()["tokens"]
    assert ids == [tok.eos_token_ids[0]]


def test_tokenize_chat_messages_renders_the_chat_format(served):
    llm, url = served
    from kimitui.engine.text.chat_format import chat_format_for

    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(f"{url}/tokenize", json={"messages": messages}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == list(chat_format_for(llm.tokenizer).encode(messages).ids)


def test_tokenizer_info_has_what_lm_eval_reads(served):
    llm, url = served
    info = httpx.get(f"{url}/tokenizer_info", headers=AUTH).json()
    assert info["tokenizer_class"] and "eos_token" in info and info["eos_token"]
    assert info["chat_template"] == llm.tokenizer.chat_template
    assert all(not isinstance(v, dict) or "__type" not in v for v in info.values())


@pytest.mark.parametrize(
    "body, param", [({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"), ({}, "prompt")]
)
def test_tokenize_needs_exactly_one_input(served, body, param):
    r = httpx.post(f"{served[1]}/tokenize", json=body, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_detokenize_rejects_ids_outside_the_vocabulary(served):
    r = httpx.post(f"{served[1]}/detokenize", json={"tokens": [1, 10**9]}, headers=AUTH)
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]


def _engine_prompt_logprobs(llm, ids):
    async def run():
        async for out in llm.generate(
            {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
        ):
            pass
        return out.prompt_logprobs

    return asyncio.run(run())


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_score_the_prompt(served, max_tokens):
    llm, url = served
    ids = llm.tokenizer.encode("The quick brown fox jumps")
    body = {
        "model": MODEL,
        "prompt": ids,
        "echo": True,
        "logprobs": 1,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_tokens_as_token_ids": True,
    }
    r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer secret"})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + max_tokens
    assert lp["tokens"][: len(ids)] == [f"token_id:{t}" for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = _engine_prompt_logprobs(llm, ids)
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(want[i][ids[i]], abs=1e-5)
        assert all(k.startswith("token_id:") for k in lp["top_logprobs"][i])
    assert r.json()["usage"]["completion_tokens"] == max_tokens
    if max_tokens == 0:
        assert choice["text"] == llm.tokenizer.decode(ids) and choice["finish_reason"] == "length"


def test_max_tokens_below_zero_is_refused(served):
    r = httpx.post(
        f"{served[1]}/v1/completions",
        json={"prompt": "x", "max_tokens": -1},
        headers={"Authorization": "Bearer secret"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
