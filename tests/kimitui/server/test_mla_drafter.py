"""`kimitui serve --speculative-config` with a vLLM recipe's JSON pasted unchanged, over an MLA
EAGLE-3 (and EAGLE-3.1) drafter in the published layout of lightseekorg/kimi-k2.6-eagle3-mla written
for the demo K2 checkpoint: the server starts, answers, and its /metrics count verified drafts."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from tests.helpers.http_server import num_draft_tokens, serve_cli
from tests.helpers.spec.eagle3_mla_checkpoint import write_mla_checkpoint


@pytest.mark.parametrize("v31", [False, True], ids=["eagle3-mla", "eagle3.1-mla"])
def test_serve_with_vllm_recipe_json_and_mla_drafter(tmp_path_factory, v31):
    xdg = os.environ.get("XDG_CACHE_HOME") or str(tmp_path_factory.getbasetemp() / "xdg")
    env = {**os.environ, "XDG_CACHE_HOME": xdg}
    os.environ.setdefault("XDG_CACHE_HOME", xdg)
    from kimitui.engine.demo import demo_checkpoint

    target = json.loads((demo_checkpoint() / "config.json").read_text())
    drafter = tmp_path_factory.mktemp("drafter")
    # EAGLE-3 in TorchSpec's export layout (layers.0.*, lightseekorg's files), 3.1 in the midlayer one
    write_mla_checkpoint(
        drafter,
        target,
        aux_layer_ids=(1, 2, 3),
        v31=v31,
        seed=1,
        drop=("lm_head.weight",) if v31 else (),
        layout="midlayer" if v31 else "torchspec",
    )
    recipe = (
        '{"model": "%s", "method": "eagle3", "num_speculative_tokens": 3, "max_model_len": 8192, '
        '"draft_tensor_parallel_size": 1}' % drafter
    )
    args = ["--max-model-len", "256", "--kv-cache-tokens", "2048", "--speculative-config", recipe]
    with serve_cli(args, env) as url:
        r = httpx.post(
            url + "/v1/completions",
            json={
                "model": "demo",
                "prompt": "hello hello hello",
                "max_tokens": 12,
                "temperature": 0,
                "ignore_eos": True,
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 12
        drafts, metrics = num_draft_tokens(url)
        assert drafts > 0, metrics
