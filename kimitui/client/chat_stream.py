"""One streamed chat reply from an OpenAI-compatible server (``POST /v1/chat/completions``).

Thinking arrives as ``reasoning_content`` (kimitui, vLLM's reasoning parsers, DeepSeek's API) or
``reasoning`` (newer vLLM) deltas, or inline as ``<think>`` text; both end up in the reply's
reasoning. TTFT and TPOT are measured here, as ``vllm bench serve`` measures them: TTFT at the
first delta carrying text, TPOT = (last - first) / (tokens - 1), tokens from the final usage
chunk when the server sends one, else one per delta.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable

from kimitui.client.think_split import ThinkSplitter


@dataclass
class StreamResult:
    finish_reason: str | None = None
    num_tokens: int = 0
    ttft: float | None = None
    tpot: float | None = None


def error_line(status: int, reason: str, body: bytes | str) -> str:
    """An HTTP error as one line: the server's own message when it sent OpenAI's error JSON."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    message = None
    try:
        data = json.loads(text)
        err = data.get("error", data) if isinstance(data, dict) else None
        if isinstance(err, dict):
            message = err.get("message") or err.get("detail")
        elif isinstance(err, str):
            message = err
        if message is None and isinstance(data, dict):
            message = data.get("detail") or data.get("message")
    except ValueError:
        pass
    message = " ".join(str(message if message is not None else text).split())[:300]
    return f"HTTP {status} {reason}: {message}" if message else f"HTTP {status} {reason}"


def connection_error_line(url: str, exc: BaseException) -> str:
    import httpx

    if isinstance(exc, httpx.ConnectError):
        return f"cannot reach the server at {url}: {exc}"
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
        return f"the server closed the connection mid-reply ({type(exc).__name__}: {exc})"
    if isinstance(exc, httpx.TimeoutException):
        return f"the server at {url} did not answer in time ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}"


async def stream_chat(
    http: Any, url: str, body: dict, headers: dict, state: Any, on_tokens: Callable[[float, int], None] | None = None
) -> StreamResult:
    """Stream into ``state`` (a ReplyState: ``reasoning``, ``content``, ``num_tokens``); raises
    RuntimeError with a one-line reason on an HTTP error, httpx errors on a broken connection."""
    splitter = ThinkSplitter()
    result = StreamResult()
    start = time.perf_counter()
    first = last = None
    deltas = 0
    usage_tokens = None
    async with http.stream("POST", url, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            raise RuntimeError(error_line(resp.status_code, resp.reason_phrase, await resp.aread()))
        async for line in resp.aiter_lines():
            line = line.strip()
            if not line.startswith("data:"):
                continue  # blank separators, ": keep-alive" comments, "event:" lines
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            msg = json.loads(data)
            if isinstance(msg, dict) and "error" in msg:  # an error raised after the stream began
                err = msg["error"]
                raise RuntimeError(
                    f"server error mid-reply: {err.get('message', err) if isinstance(err, dict) else err}"
                )
            if usage := msg.get("usage"):
                usage_tokens = usage.get("completion_tokens", usage_tokens)
            for choice in msg.get("choices") or ():
                delta = choice.get("delta") or {}
                thought = delta.get("reasoning_content") or delta.get("reasoning") or ""
                text = delta.get("content") or ""
                if thought or text:
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    deltas += 1
                    splitter.reasoning += thought
                    splitter.feed(text)
                    state.reasoning, state.content = splitter.reasoning, splitter.content
                    state.num_tokens = deltas
                    if on_tokens is not None:
                        on_tokens(time.monotonic(), 1)
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
    splitter.finish()
    state.reasoning, state.content = splitter.reasoning, splitter.content
    result.num_tokens = usage_tokens if usage_tokens else deltas
    state.num_tokens = result.num_tokens
    if first is not None:
        result.ttft = first - start
        if result.num_tokens > 1 and last > first:
            result.tpot = (last - first) / (result.num_tokens - 1)
    return result
