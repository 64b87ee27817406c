"""Serving for the side-by-side benchmarks: a free port, waiting for a server's ``/v1/models``, and
``kimitui bench --base-url`` run against it (vLLM's random dataset and metrics)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 900) -> None:
    import urllib.request

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except Exception:
            time.sleep(2)
    raise SystemExit(f"server at {url} not ready after {timeout:.0f} s; see {log}")


def bench_client(
    url: str, tokenizer: Path, concurrency: int, num_prompts: int, input_len: int, output_len: int, out: Path, log: Path
) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "kimitui.cli",
        "bench",
        "--base-url",
        url,
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(concurrency),
        "--ignore-eos",
        "--temperature",
        "0",
        "--num-warmups",
        str(concurrency),
        "--save-result",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
    ]
    with open(log, "w") as f:
        p = subprocess.run(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=str(ROOT),
            env=dict(os.environ, HF_HUB_OFFLINE="1"),
            timeout=3600,
        )
    if p.returncode or not out.is_file():
        tail = "".join(log.read_text().splitlines(keepends=True)[-20:])
        raise SystemExit(f"kimitui bench exited {p.returncode}; last lines of {log}:\n{tail}")
    return json.loads(out.read_text())
