"""`kimitui serve --model demo-k3 --speculative-config` with vLLM's DSpark recipe JSON pasted unchanged
(plus the drafter path), over tiny drafters in the published layouts of lightseekorg/kimi-k3-dspark
and Inferact/Kimi-K3.1-Pro-DSpark-preview written for the demo K3 checkpoint: the server starts,
answers, and its /metrics count verified drafts."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

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
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kimitui.cli",
            "serve",
            "--model",
            "demo-k3",
            "--port",
            "0",
            "--max-model-len",
            "256",
            "--kv-cache-tokens",
            "2048",
            "--served-model-name",
            "demo",
            "--speculative-config",
            recipe,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        lines, url = [], None
        deadline = time.monotonic() + 300
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if m := re.search(r"model demo at (http://127\.0\.0\.1:\d+)/v1", line):
                url = m.group(1)
        assert url, "".join(lines)
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
        metrics = httpx.get(url + "/metrics", timeout=30).text
        drafts = re.search(r"^kimitui:spec_decode_num_draft_tokens\S* (\d+(?:\.\d+)?)$", metrics, re.M)
        assert drafts and float(drafts.group(1)) > 0, metrics
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
