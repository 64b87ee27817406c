"""Benchmark clients: the in-process engine and any OpenAI-compatible /v1/completions server.

Both time a request exactly as `vllm bench serve` does (endpoint_request_func.py): the clock
starts after the concurrency slot is taken, TTFT is the first message carrying `choices`,
each later `choices` message adds one ITL gap (per chunk, not per token), latency ends at
the last `choices` message (the usage-only chunk and `[DONE]` do not extend it), and the
output token count comes from the final usage chunk. Clients never raise: failures come back
as `success=False` with `error` set.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kimitui.bench.workload import SampleRequest
from kimitui.client.http import request_headers, server_root
from kimitui.client.http_pool import HTTPPool, plain_http_target

# vLLM's AIOHTTP_TIMEOUT: long prompts on slow hardware may legitimately take hours.
_REQUEST_TIMEOUT_S = 6 * 60 * 60


@dataclass(frozen=True)
class RequestFuncOutput:
    """Result of one request, with vLLM's field names and units (seconds)."""

    success: bool = False
    generated_text: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    error: str = ""
    # multi-turn sessions: the reply's token ids (the next turn's prompt repeats them) and the
    # prompt tokens served from the prefix cache (None when the target did not say)
    output_token_ids: tuple[int, ...] = ()
    cached_tokens: int | None = None


class InProcessClient:
    """Drive an `engine.AsyncLLM` directly with token-id prompts. `text_prompts=True` asks the
    workload for vLLM's decode/re-encode round trip, so the ids sent are exactly what a server
    would get from the same text (and in-process and HTTP runs see one workload)."""

    backend = "kimitui"
    needs_text = False

    def __init__(
        self,
        engine: Any,
        model: str = "kimitui",
        temperature: float | None = None,
        ignore_eos: bool = True,
        sampling_params_cls: Any = None,
        text_prompts: bool = False,
    ):
        self.needs_text = text_prompts
        self.engine = engine
        self.model = model
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        self._sampling_params_cls = sampling_params_cls

    def _params(self, max_tokens: int) -> Any:
        cls = self._sampling_params_cls
        if cls is None:
            from kimitui.engine import SamplingParams as cls  # lazy: `bench --base-url` needs no torch

        kwargs: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": self.ignore_eos}
        if self.temperature is not None:
            kwargs["temperature"] = self.temperature
        return cls(**kwargs)

    async def __call__(self, request: SampleRequest, request_id: str) -> RequestFuncOutput:
        text, itl, n_tokens = "", [], 0
        st = time.perf_counter()
        last = st
        ttft = 0.0
        out = None
        try:
            params = self._params(request.expected_output_len)
            prompt = {"prompt_token_ids": list(request.prompt_token_ids)}
            async for out in self.engine.generate(prompt, params, request_id):
                completion = out.outputs[0]
                # One yield may carry several tokens; like one SSE chunk it adds one gap.
                if len(completion.token_ids) > n_tokens:
                    now = time.perf_counter()
                    if n_tokens == 0:
                        ttft = now - st
                    else:
                        itl.append(now - last)
                    last = now
                    n_tokens = len(completion.token_ids)
                    text = completion.text
        except asyncio.CancelledError:
            await asyncio.shield(self._abort(request_id))
            raise
        except Exception as e:  # noqa: BLE001 - a benchmark records failures, it does not stop
            await self._abort(request_id)
            return RequestFuncOutput(
                False, text, request.prompt_len, n_tokens, ttft, itl, last - st, st, f"{type(e).__name__}: {e}"
            )
        if n_tokens == 0:
            return RequestFuncOutput(
                False, "", request.prompt_len, 0, 0.0, [], 0.0, st, "the engine finished without producing a token"
            )
        cached = out.metrics.num_cached_tokens if out.metrics is not None else None
        return RequestFuncOutput(
            True,
            text,
            request.prompt_len,
            n_tokens,
            ttft,
            itl,
            last - st,
            st,
            output_token_ids=tuple(out.outputs[0].token_ids),
            cached_tokens=cached,
        )

    async def _abort(self, request_id: str) -> None:
        try:
            await self.engine.abort(request_id)
        except Exception:  # noqa: BLE001 - the request may already be gone
            pass

    async def aclose(self) -> None:
        pass


class OpenAICompletionsClient:
    """Streaming POST `{base_url}/v1/completions`, timed like vLLM's `openai` backend."""

    backend = "openai"
    needs_text = True

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        temperature: float | None = None,
        ignore_eos: bool = True,
        http_client: str = "auto",
    ):
        """``http_client``: "auto" (kimitui's kept-alive pool, ``kimitui/client/http_pool.py``, for a
        plain ``http://`` server without a proxy; aiohttp otherwise) or "aiohttp" (always, as `vllm bench
        serve`)."""
        if http_client not in ("auto", "aiohttp"):
            raise ValueError(f"http_client must be 'auto' or 'aiohttp', got {http_client!r}")
        self.base_url = server_root(base_url)
        self.model = model
        self.api_key = api_key
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        self.return_token_ids = False  # multi-turn: ask for the reply's ids (vLLM's return_token_ids)
        self._http = None  # an aiohttp session, made on the first request (inside the running loop)
        # The client's own time is in every TTFT it measures: aiohttp's is about 1.0 ms of a streamed
        # request here, the pool's about 0.1 ms (benchmarks/server/client_cost.py times both).
        self._pool = HTTPPool(self.base_url) if http_client == "auto" and plain_http_target(self.base_url) else None
        self._prefix = urlsplit(self.base_url).path
        self.http_client = "kimitui" if self._pool is not None else "aiohttp"

    def _session(self):
        # aiohttp, as `vllm bench serve`, for https:// and proxied targets. No pool limit: the
        # benchmark's semaphore is the only concurrency cap. aiohttp sets TCP_NODELAY on each
        # connection it makes.
        if self._http is None:
            import aiohttp

            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=_REQUEST_TIMEOUT_S, connect=30.0),
                connector=aiohttp.TCPConnector(limit=0),
                trust_env=True,
            )
        return self._http

    @asynccontextmanager
    async def _exchange(self, method: str, path: str, headers: dict[str, str], body: bytes | None = None):
        """``(status, reason, body pieces)`` of one request to ``base_url + path``, through the pool
        or aiohttp; leaving the block before the body's end closes the connection."""
        if self._pool is not None:
            resp = await self._pool.request(method, self._prefix + path, headers, body or b"", _REQUEST_TIMEOUT_S)
            try:
                yield resp.status, resp.reason, resp.chunks()
            finally:
                resp.close()
            return
        async with self._session().request(method, self.base_url + path, data=body, headers=headers) as resp:
            yield resp.status, resp.reason, resp.content.iter_any()

    def payload(self, request: SampleRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": request.prompt if request.prompt is not None else request.prompt_token_ids,
            "repetition_penalty": 1.0,
            "max_tokens": request.expected_output_len,
            "logprobs": None,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.return_token_ids:
            body["return_token_ids"] = True
        # Like vLLM we send no temperature unless asked: the server's default applies.
        if self.temperature is not None:
            body["temperature"] = self.temperature
        return body

    async def __call__(self, request: SampleRequest, request_id: str) -> RequestFuncOutput:
        prompt_len = request.prompt_len
        text, itl, chunks, usage_tokens = "", [], 0, None
        ids: list[int] = []
        cached = None
        ttft = 0.0
        st = time.perf_counter()
        last = st
        try:
            payload = json.dumps(self.payload(request)).encode()
            headers = request_headers(self.api_key, request_id)
            async with self._exchange("POST", "/v1/completions", headers, payload) as (status, reason, body):
                if status != 200:
                    error = b"".join([piece async for piece in body]).decode("utf-8", "replace")[:500]
                    return RequestFuncOutput(
                        False,
                        "",
                        prompt_len,
                        0,
                        0.0,
                        [],
                        0.0,
                        st,
                        f"HTTP {status} {reason}: {error}",
                    )
                done = False
                async for line in _lines(body):
                    line = line.strip()
                    # Blank lines separate SSE events; ':' lines are keep-alive comments. After [DONE]
                    # the body is read to its end (the next bytes), so the connection can be reused.
                    if done or not line or line.startswith(":") or not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        done = True
                        continue
                    msg = json.loads(data)
                    if choices := msg.get("choices"):
                        now = time.perf_counter()
                        if chunks == 0:
                            ttft = now - st
                        else:
                            itl.append(now - last)
                        last = now
                        chunks += 1
                        text += choices[0].get("text") or ""
                        ids += choices[0].get("token_ids") or []
                    elif usage := msg.get("usage"):
                        usage_tokens = usage.get("completion_tokens")
                        if usage.get("prompt_tokens") is not None:
                            prompt_len = usage["prompt_tokens"]
                        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        except asyncio.CancelledError:
            raise  # leaving the stream context closes the connection: the server aborts
        except Exception as e:  # noqa: BLE001 - a benchmark records failures, it does not stop
            return RequestFuncOutput(
                False, text, prompt_len, chunks, ttft, itl, last - st, st, f"{type(e).__name__}: {e}"
            )
        if chunks == 0:
            return RequestFuncOutput(
                False, "", prompt_len, 0, 0.0, [], 0.0, st, "Never received a valid chunk to calculate TTFT."
            )
        # Without usage, count chunks (one token per chunk for servers that stream each).
        output_tokens = usage_tokens if usage_tokens else chunks
        return RequestFuncOutput(
            True,
            text,
            prompt_len,
            output_tokens,
            ttft,
            itl,
            last - st,
            st,
            output_token_ids=tuple(ids),
            cached_tokens=cached,
        )

    async def metrics_text(self) -> str | None:
        """The target's Prometheus exposition (``GET /metrics``), or None where it has none."""
        try:
            async with self._exchange("GET", "/metrics", request_headers(self.api_key)) as (status, _, body):
                text = b"".join([piece async for piece in body]).decode("utf-8", "replace")
                return text if status == 200 else None
        except Exception:  # noqa: BLE001 - a server without /metrics is not a failed benchmark
            return None

    async def aclose(self) -> None:
        if self._pool is not None:
            self._pool.close()
        if self._http is not None:
            await self._http.close()
            self._http = None


async def target_metrics(client: Any) -> str | None:
    """The Prometheus text of the server a benchmark client talks to (its ``metrics_text()``), or None
    for a client without one (in process) or a server without ``/metrics``."""
    metrics_text = getattr(client, "metrics_text", None)
    return await metrics_text() if metrics_text is not None else None


async def _lines(pieces: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The decoded lines of a streamed body, whatever their length (aiohttp's own line iterator stops
    at 64 KiB, less than one SSE event of a long reply's token ids can take)."""
    pending = b""
    async for data in pieces:
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.decode("utf-8", "replace")
    if pending:
        yield pending.decode("utf-8", "replace")


async def fetch_models(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> list[str]:
    """Model ids served at `{base_url}/v1/models` (the first is what vLLM benchmarks when
    --model is not given). Raises RuntimeError with the URL on failure."""
    import httpx

    url = f"{server_root(base_url)}/v1/models"
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as http:
            resp = await http.get(url, headers=request_headers(api_key))
            resp.raise_for_status()
            ids = [m["id"] for m in resp.json().get("data", [])]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        raise RuntimeError(f"could not list models at {url}: {type(e).__name__}: {e}") from e
    if not ids:
        raise RuntimeError(f"no models are served at {url}")
    return ids
