"""Limits that keep one client from holding the server: the API key on every route that does work,
a deadline for sending a request, a Host allow-list; `kimitui serve`'s start-up checks."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from kimitui.engine import AsyncLLM, EngineArgs
from kimitui.server import BackgroundServer, create_app

MODEL = "kimitui-demo"
KEY = "sk-limits"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    os.environ.setdefault("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg"))
    llm = AsyncLLM(engine_args=EngineArgs(max_model_len=128, max_num_seqs=2, kv_cache_tokens=1024))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def served(llm):
    srv = BackgroundServer(port=0).start(
        create_app(
            llm, MODEL, api_key=KEY, request_read_timeout=0.5, allowed_hosts=frozenset({"127.0.0.1", "localhost"})
        )
    )
    yield srv
    srv.stop()


@pytest.mark.parametrize(
    "method, path, body",
    [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
        ("POST", "/tokenize", {"prompt": "x" * 1000}),
        ("POST", "/detokenize", {"tokens": [5]}),
        ("GET", "/tokenizer_info", None),
    ],
)
def test_every_working_route_needs_the_key(served, method, path, body):
    r = httpx.request(method, served.url + path, json=body, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.request(method, served.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200, r.text


def test_health_and_metrics_stay_open(served):
    assert httpx.get(served.url + "/health").status_code == 200
    assert httpx.get(served.url + "/metrics").status_code == 200


def _raw(port: int, data: bytes, wait_s: float) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        s.settimeout(wait_s)
        chunks = []
        try:
            while chunk := s.recv(65536):
                chunks.append(chunk)
        except TimeoutError:
            chunks.append(b"<still open>")
        return b"".join(chunks)


def test_half_sent_head_gets_408_and_the_connection_closes(served):
    t0 = time.monotonic()
    reply = _raw(served.port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty", wait_s=10)
    assert reply.startswith(b"HTTP/1.1 408") and b"request head not received" in reply, reply
    assert time.monotonic() - t0 < 5


def test_idle_connection_without_a_request_is_closed(served):
    reply = _raw(served.port, b"", wait_s=10)
    assert reply.startswith(b"HTTP/1.1 408"), reply


def test_half_sent_body_gets_408(served):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + KEY.encode() + b'\r\nContent-Length: 100\r\n\r\n{"prompt": '
    )
    reply = _raw(served.port, head, wait_s=10)
    assert reply.startswith(b"HTTP/1.1 408") and b"request body not received within 0.5 s" in reply, reply


def test_a_slow_but_steady_keep_alive_client_is_served(served):
    with httpx.Client(base_url=served.url, timeout=30) as http:
        for _ in range(3):
            assert http.get("/health").status_code == 200
            time.sleep(0.3)  # idle between requests: uvicorn's keep-alive timeout, not ours


def test_host_allow_list(served):
    r = httpx.get(served.url + "/health", headers={"Host": "evil.example"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "Host" and "evil.example" in r.text
    assert httpx.get(f"http://localhost:{served.port}/health").status_code == 200
    assert httpx.get(served.url + "/health", headers={"Host": f"127.0.0.1:{served.port}"}).status_code == 200


def _serve_cli(*argv: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KIMITUI_API_KEY"}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "kimitui.cli", "serve", *argv], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--port", "70000"], "port must be in 0..65535, got 70000"),
        (["--port", "http"], "not a port number"),
        (["--api-key", "clé"], "--api-key (or $KIMITUI_API_KEY) must be printable ASCII"),
        (["--shutdown-timeout", "-1"], "--shutdown-timeout must be >= 0"),
        (["--allowed-hosts", "a b"], "--allowed-hosts"),
    ],
)
def test_bad_serve_flags_are_one_line(argv, words):
    r = _serve_cli(*argv)
    assert r.returncode == 2, r.stdout + r.stderr
    assert words in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len([line for line in r.stderr.splitlines() if "error" in line]) == 1, r.stderr


def test_non_ascii_key_from_the_environment_is_refused():
    r = _serve_cli(env_extra={"KIMITUI_API_KEY": "ключ"})
    assert r.returncode == 2 and "printable ASCII" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_big_prompt_list_does_not_hold_up_another_client(llm):
    import threading

    srv = BackgroundServer(port=0).start(create_app(llm, MODEL))  # max_num_seqs 2: one prompt of a list at a time
    try:
        big: dict = {}

        def send_list():
            big["start"] = time.monotonic()
            big["r"] = httpx.post(
                srv.url + "/v1/completions",
                timeout=300,
                json={"prompt": [[5, 6, i] for i in range(32)], "max_tokens": 48, "ignore_eos": True},
            )
            big["done"] = time.monotonic()

        t = threading.Thread(target=send_list)
        t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [7, 8], "max_tokens": 2}, timeout=300)
        single = time.monotonic() - t0
        t.join(300)
        assert r.status_code == 200
        # Queued behind the 32 prompts sent before it, the single request would wait for nearly all
        # of them; admitted in pieces, the list leaves it a slot.
        total = big["done"] - big["start"]
        assert single < total / 4, (single, total)
        choices = big["r"].json()["choices"]
        assert [c["index"] for c in choices] == list(range(32))
        assert big["r"].json()["usage"]["completion_tokens"] == 32 * 48
    finally:
        srv.stop()
