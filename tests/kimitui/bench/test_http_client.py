"""OpenAICompletionsClient against a real local HTTP server streaming OpenAI-format SSE."""

import asyncio
import json
import socket

import pytest

from kimitui.bench.clients import OpenAICompletionsClient, fetch_models
from kimitui.bench.workload import SampleRequest

GAP = 0.05
METRICS = (
    "# TYPE kimitui:prefix_cache_queries_total counter\n"
    'kimitui:prefix_cache_queries_total{model_name="m"} 120\n'
    "# TYPE kimitui:prefix_cache_hits_total counter\n"
    'kimitui:prefix_cache_hits_total{model_name="m"} 96\n'
    "# TYPE kimitui:spec_decode_num_drafts_total counter\n"
    'kimitui:spec_decode_num_drafts_total{model_name="m"} 10\n'
    "# TYPE kimitui:spec_decode_num_draft_tokens_total counter\n"
    'kimitui:spec_decode_num_draft_tokens_total{model_name="m"} 30\n'
    "# TYPE kimitui:spec_decode_num_accepted_tokens_total counter\n"
    'kimitui:spec_decode_num_accepted_tokens_total{model_name="m"} 12\n'
)
REQUEST = SampleRequest("w5 w6 w7", [5, 6, 7], 3, 4)


async def _handle(reader, writer, seen):
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    path = lines[0].split()[1]
    length = next((int(l.split(":")[1]) for l in lines if l.lower().startswith("content-length")), 0)
    body = json.loads(await reader.readexactly(length)) if length else {}
    seen.append((path, body))
    if path == "/metrics":
        data = METRICS.encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: "
            + str(len(data)).encode()
            + b"\r\nConnection: close\r\n\r\n"
            + data
        )
    elif path == "/v1/models":
        data = json.dumps({"object": "list", "data": [{"id": "kimi-demo", "object": "model"}]}).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(data)).encode()
            + b"\r\nConnection: close\r\n\r\n"
            + data
        )
    elif body.get("prompt") == "fail":
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\nConnection: close\r\n\r\nboom")
    else:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(GAP)
        writer.write(b": keep-alive\n\n")
        for text in ("Hel", "lo", " world"):
            chunk = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": text}]}
            writer.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await writer.drain()
            await asyncio.sleep(GAP)
        if body.get("prompt") != "no-usage":
            # Usage differs from the chunk count on purpose: the client must trust usage.
            usage = {"id": "c", "choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 7}}
            writer.write(f"data: {json.dumps(usage)}\n\n".encode())
            await writer.drain()
            await asyncio.sleep(2 * GAP)  # must not count towards latency
        writer.write(b"data: [DONE]\n\n")
    await writer.drain()
    writer.close()


async def _serve(seen):
    server = await asyncio.start_server(lambda r, w: _handle(r, w, seen), "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.fixture(params=["auto", "aiohttp"])
def http_client(request):
    """Each test with kimitui's connection pool (plain http://) and with aiohttp."""
    return request.param


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)


def test_streaming_timing_usage_and_payload(http_client):
    async def main():
        seen = []
        server, url = await _serve(seen)
        client = OpenAICompletionsClient(url, "kimi-demo", api_key="k", temperature=0.0, http_client=http_client)
        try:
            out = await client(REQUEST, "bench-0")
            no_usage = await client(SampleRequest("no-usage", [1], 1, 4), "bench-1")
        finally:
            await client.aclose()
            server.close()
        return seen, out, no_usage

    seen, out, no_usage = asyncio.run(main())
    assert out.success, out.error
    assert out.generated_text == "Hello world"
    assert out.output_tokens == 7 and out.prompt_len == 11
    assert GAP * 0.8 <= out.ttft < 1.0
    assert len(out.itl) == 2 and all(GAP * 0.8 <= g < 1.0 for g in out.itl)
    # Latency ends at the last choices chunk: the usage chunk's 2*GAP pause is excluded.
    assert out.latency == pytest.approx(out.ttft + sum(out.itl), abs=1e-6)
    assert no_usage.success and no_usage.output_tokens == 3 and no_usage.prompt_len == 1
    path, body = seen[0]
    assert path == "/v1/completions"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 4 and body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["model"] == "kimi-demo" and body["prompt"] == "w5 w6 w7"


def test_http_500_and_connection_refused_are_captured(http_client):
    async def main():
        seen = []
        server, url = await _serve(seen)
        client = OpenAICompletionsClient(url, "m", http_client=http_client)
        try:
            bad = await client(SampleRequest("fail", [1], 1, 2), "r")
        finally:
            await client.aclose()
            server.close()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dead = OpenAICompletionsClient(f"http://127.0.0.1:{port}", "m", http_client=http_client)
        try:
            refused = await dead(REQUEST, "r")
        finally:
            await dead.aclose()
        return bad, refused

    bad, refused = asyncio.run(main())
    assert not bad.success and "500" in bad.error and "boom" in bad.error
    assert not refused.success and "connect" in refused.error.lower()  # aiohttp: ClientConnectorError


def test_fetch_models():
    async def main():
        server, url = await _serve([])
        try:
            return await fetch_models(url + "/")
        finally:
            server.close()

    assert asyncio.run(main()) == ["kimi-demo"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RuntimeError, match="/v1/models"):
        asyncio.run(fetch_models(f"http://127.0.0.1:{port}"))


def test_server_counters_are_read_through_the_clients_session(http_client):
    """The multi-turn prefix-cache rate and the speculative-decoding counters come from the target's
    /metrics, fetched by the benchmark client itself."""
    from kimitui.bench.multi_turn import read_prefix_counters
    from kimitui.bench.spec_counters import read_spec_counters

    async def main():
        seen = []
        server, url = await _serve(seen)
        client = OpenAICompletionsClient(url, "m", http_client=http_client)
        try:
            return await read_prefix_counters(client), await read_spec_counters(client), seen
        finally:
            await client.aclose()
            server.close()

    prefix, spec, seen = asyncio.run(main())
    assert prefix == (120, 96)
    assert spec is not None and spec.num_drafts == 10 and spec.num_draft_tokens == 30
    assert spec.num_accepted_tokens == 12
    assert [p for p, _ in seen] == ["/metrics", "/metrics"]
