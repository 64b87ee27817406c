"""`kimitui serve --speculative-config` with a vLLM recipe's JSON pasted unchanged, over an MLA
EAGLE-3 (and EAGLE-3.1) drafter in the published layout of lightseekorg/kimi-k2.6-eagle3-mla written
for the demo K2 checkpoint: the server starts, answers, and its /metrics count verified drafts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

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
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kimitui.cli",
            "serve",
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
        metrics = httpx.get(url + "/metrics", timeout=30).text
        drafts = re.search(r"^kimitui:spec_decode_num_draft_tokens\S* (\d+(?:\.\d+)?)$", metrics, re.M)
        assert drafts and float(drafts.group(1)) > 0, metrics
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
