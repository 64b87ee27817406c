"""kimitui's OpenAI-compatible server in a thread of the test process, for clients under test."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


@contextmanager
def serving(llm, model_name: str) -> Iterator[int]:
    """Serve ``llm`` (an ``AsyncLLM``) as ``model_name`` on 127.0.0.1; yields the port. The socket is
    bound before the server starts (no free-port race); on exit the server stops and ``llm`` is shut
    down."""
    import uvicorn

    from kimitui.server.app import create_app

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # so asyncio sets TCP_NODELAY
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(llm, model_name), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        llm.shutdown()
        sock.close()


@contextmanager
def serve_cli(args: list[str], env: dict, model_name: str = "demo", start_timeout_s: float = 300) -> Iterator[str]:
    """``kimitui serve --port 0 --served-model-name NAME ARGS`` in a child process: yields its base URL once it
    listens, then stops it with SIGINT (killed if it is still there)."""
    cmd = [sys.executable, "-m", "kimitui.cli", "serve", "--port", "0", "--served-model-name", model_name, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines, url = [], None
        deadline = time.monotonic() + start_timeout_s
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if m := re.search(rf"model {re.escape(model_name)} at (http://127\.0\.0\.1:\d+)/v1", line):
                url = m.group(1)
        assert url, "".join(lines)
        yield url
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()


def num_draft_tokens(url: str) -> tuple[float, str]:
    """The server's verified draft tokens so far (``/metrics``), and the metrics text for a failure message."""
    metrics = httpx.get(url + "/metrics", timeout=30).text
    found = re.search(r"^kimitui:spec_decode_num_draft_tokens\S* (\d+(?:\.\d+)?)$", metrics, re.M)
    return (float(found.group(1)) if found else 0.0), metrics
