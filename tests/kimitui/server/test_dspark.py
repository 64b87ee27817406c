"""`kimitui serve --model demo-k3 --speculative-config` with vLLM's DSpark recipe JSON pasted unchanged
(plus the drafter path), over tiny drafters in the published layouts of lightseekorg/kimi-k3-dspark
and Inferact/Kimi-K3.1-Pro-DSpark-preview written for the demo K3 checkpoint: the server starts,
answers, and its /metrics count verified drafts."""

from __future__ import annotations

import os

import httpx
import pytest

from tests.helpers.http_server import num_draft_tokens, serve_cli
from tests.helpers.spec.dspark_checkpoint import write_tiny_dspark


@pytest.mark.parametrize("layout", ["lightseek", "inferact"])
def test_serve_with_vllm_dspark_recipe(tmp_path_factory, layout):
    xdg = os.environ.get("XDG_CACHE_HOME") or str(tmp_path_factory.getbasetemp() / "xdg")
    env = {**os.environ, "XDG_CACHE_HOME": xdg}
    os.environ.setdefault("XDG_CACHE_HOME", xdg)
    from kimitui.engine.demo.k3 import ensure_demo_k3_checkpoint

    target = ensure_demo_k3_checkpoint()
    drafter = write_tiny_dspark(tmp_path_factory.mktemp("drafter"), target, layout, seed=2, target_layer_ids=[0, 2, 3])
    recipe = (
        '{"method": "dspark", "model": "%s", "num_speculative_tokens": 7, '
        '"draft_sample_method": "probabilistic", "rejection_sample_method": "block"}' % drafter
    )
    args = ["--model", "demo-k3", "--max-model-len", "256", "--kv-cache-tokens", "2048", "--speculative-config", recipe]
    with serve_cli(args, env) as url:
        for temperature in (0, 1.0):
            r = httpx.post(
                url + "/v1/completions",
                json={
                    "model": "demo",
                    "prompt": "hello hello hello",
                    "max_tokens": 12,
                    "temperature": temperature,
                    "ignore_eos": True,
                },
                timeout=120,
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 12
        drafts, metrics = num_draft_tokens(url)
        assert drafts > 0, metrics
