"""`kimitui serve` as a user runs it: prints the URL, serves, exits 0 on Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx


def test_serve_prints_url_and_exits_cleanly_on_sigint(tmp_path_factory):
    env = {
        **os.environ,
        "XDG_CACHE_HOME": os.environ.get("XDG_CACHE_HOME") or str(tmp_path_factory.getbasetemp() / "xdg"),
        "KIMITUI_API_KEY": "k",
    }
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
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        lines, url = [], None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if m := re.search(r"model demo at (http://127\.0\.0\.1:\d+)/v1 \(API key required\)", line):
                url = m.group(1)
        assert url, "".join(lines)
        assert httpx.get(url + "/health").status_code == 200
        r = httpx.post(
            url + "/v1/completions",
            json={"model": "demo", "prompt": "hi", "max_tokens": 2},
            headers={"Authorization": "Bearer k"},
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, "".join(lines) + out
    assert "stopped" in out
