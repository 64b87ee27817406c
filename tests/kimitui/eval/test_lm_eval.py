"""lm-evaluation-harness against a live ``kimitui serve`` (real uvicorn, demo model): a
log-likelihood task and a generation task through ``local-completions`` with the tokenizer taken
from the server (``tokenizer_backend=remote``: vLLM's /tokenize, /detokenize, /tokenizer_info), and
the generation task through ``local-chat-completions``. The tasks are YAML files written here over
local JSONL data (``dataset_path: json``): nothing downloads. The demo's weights are random, so the
scores are noise; what is checked is that the harness completes and that the log-likelihoods it
got are the engine's own."""

from __future__ import annotations

import json
import os

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow  # about 2.5 minutes: the harness, its datasets and many small requests

from kimitui.engine import AsyncLLM, EngineArgs  # noqa: E402
from kimitui.server import BackgroundServer, create_app  # noqa: E402

MODEL = "kimitui-demo"
MC = [
    {"question": "Which is a colour?", "choices": ["red", "seven", "quickly"], "answer": 0},
    {"question": "Which is a number?", "choices": ["blue", "three"], "answer": 1},
]
GEN = [{"question": "What is two plus two?", "answer": "four"}, {"question": "Name a fruit.", "answer": "apple"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    os.environ.setdefault("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg"))
    llm = AsyncLLM(engine_args=EngineArgs(max_model_len=512, max_num_seqs=4, kv_cache_tokens=4096))
    server = BackgroundServer(port=0).start(create_app(llm, MODEL))
    yield llm, server.url
    server.stop()
    llm.shutdown()


@pytest.fixture
def tasks(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    for name, rows in (("mc", MC), ("gen", GEN)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "kimitui_mc.yaml").write_text(f"""task: kimitui_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    (tmp_path / "kimitui_gen.yaml").write_text(f"""task: kimitui_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
""")
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(tmp_path))


def _engine_loglikelihood(llm, context: str, continuation: str) -> float:
    """The continuation's log-probability as the engine scores it, split as lm-eval splits it."""
    import asyncio

    from kimitui.engine import SamplingParams

    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    tok = llm.tokenizer
    whole = tok.encode(context + continuation, allow_special=True)
    start = len(tok.encode(context, allow_special=True))

    async def run():
        async for out in llm.generate(
            {"prompt_token_ids": whole}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
        ):
            pass
        return out.prompt_logprobs

    lps = asyncio.run(run())
    return sum(lps[i][whole[i]] for i in range(start, len(whole)))


def test_local_completions_with_remote_tokenizer(served, tasks):
    llm, url = served
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model={MODEL},base_url={url}/v1/completions,tokenizer_backend=remote,num_concurrent=1,"
        "max_retries=1,tokenized_requests=True",
        tasks=["kimitui_mc", "kimitui_gen"],
        task_manager=tasks,
        log_samples=True,
        batch_size=1,
    )
    res = out["results"]
    assert 0.0 <= res["kimitui_mc"]["acc,none"] <= 1.0
    assert 0.0 <= res["kimitui_gen"]["exact_match,none"] <= 1.0
    samples = out["samples"]["kimitui_mc"]
    assert len(samples) == len(MC)
    for s in samples:  # each choice's log-likelihood is the engine's own
        for (context, continuation), resp in zip(s["arguments"], s["resps"]):
            got = resp[0][0] if isinstance(resp[0], (list, tuple)) else resp[0]
            assert got == pytest.approx(_engine_loglikelihood(llm, context, continuation), abs=1e-4)
    gens = out["samples"]["kimitui_gen"]
    assert len(gens) == len(GEN) and all(isinstance(g["resps"][0][0], str) for g in gens)


def test_local_chat_completions_generation(served, tasks):
    _llm, url = served
    out = lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args=f"model={MODEL},base_url={url}/v1/chat/completions,num_concurrent=1,max_retries=1",
        tasks=["kimitui_gen"],
        task_manager=tasks,
        apply_chat_template=True,
        log_samples=True,
        batch_size=1,
    )
    assert 0.0 <= out["results"]["kimitui_gen"]["exact_match,none"] <= 1.0
    assert len(out["samples"]["kimitui_gen"]) == len(GEN)
