"""The ``Bridge`` (bridges/base.py) over an OpenAI-compatible server: kimitui serve, vLLM, SGLang.

Replies stream from ``/v1/chat/completions`` on a worker thread with its own event loop (so the
client's TTFT / TPOT are not stretched by the UI drawing), each over a fresh connection, so a
server that went away and came back is simply reached again by the next message. The throughput numbers come from the server's Prometheus
``/metrics``, scraped by one daemon thread every second (parsing a large vLLM exposition never
costs the UI a frame); ``stats()`` only hands out the latest result.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

from textual.app import App
from textual.message_pump import MessagePump

from kimitui.client.chat_stream import connection_error_line, error_line, stream_chat
from kimitui.client.http import request_headers, server_root
from kimitui.client.server_metrics import parse_server_metrics
from kimitui.client.server_stats import ClientTokenRate, ServerStatsTracker
from kimitui.tui.bridges.base import BenchSource
from kimitui.tui.bridges.local import ReplyState
from kimitui.tui.chat.generation import GenerationSettings
from kimitui.tui.chat.model_info import remote_info
from kimitui.tui.chat.session import Chat
from kimitui.tui.messages import EngineFailed, EngineReady, ReplyFinished

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 600.0  # a long prefill on a busy server may keep the first token this long
METRICS_PERIOD_S = 1.0


class RemoteBridge:
    def __init__(
        self,
        app: App,
        base_url: str,
        api_key: str | None = None,
        model: str | None = None,
        num_gpus: int | Callable[[], int] = 0,
        metrics_period_s: float = METRICS_PERIOD_S,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {base_url!r}")
        self.app = app
        self.root = server_root(base_url)
        self.api_key = api_key
        self.requested_model = model
        self.model: str | None = None
        self.server_kind = "OpenAI-compatible"
        self.max_model_len: int | None = None
        self._num_gpus = num_gpus
        self.metrics_period_s = metrics_period_s
        self.reply: ReplyState | None = None
        self._reply_worker = None
        self._reply_loop: asyncio.AbstractEventLoop | None = None
        self._reply_task: asyncio.Task | None = None
        self._stop_asked = False
        self._tracker = ServerStatsTracker()
        self._client_rate = ClientTokenRate()
        self._server_stats = None
        self._metrics_problem: str | None = "waiting for the first /metrics scrape"
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None

    @property
    def load_title(self) -> str:
        return f"Connecting to {self.root}"

    @property
    def ready(self) -> bool:
        return self.model is not None

    @property
    def generating(self) -> bool:
        return self.reply is not None and not self.reply.done

    @property
    def effort_supported(self) -> bool:
        return False  # a remote chat template's options are unknown; only thinking on/off is sent

    @property
    def num_gpus(self) -> int:
        return self._num_gpus() if callable(self._num_gpus) else self._num_gpus

    # -- connecting ------------------------------------------------------------------------
    def load(self, notify: MessagePump | None = None) -> None:
        self.app.run_worker(
            lambda: self._load(notify or self.app),
            thread=True,
            group="engine-load",
            exclusive=True,
            exit_on_error=False,
            name="connect",
        )

    def _load(self, notify: MessagePump) -> None:
        import httpx

        t0 = time.monotonic()
        url = f"{self.root}/v1/models"
        try:
            with httpx.Client(timeout=CONNECT_TIMEOUT_S) as http:
                resp = http.get(url, headers=request_headers(self.api_key))
                if resp.status_code != 200:
                    raise RuntimeError(error_line(resp.status_code, resp.reason_phrase, resp.content))
                models = [m for m in resp.json().get("data", []) if isinstance(m, dict) and "id" in m]
        except httpx.HTTPError as e:
            notify.post_message(EngineFailed(connection_error_line(self.root, e)))
            return
        except (RuntimeError, ValueError, AttributeError) as e:
            notify.post_message(EngineFailed(f"{url}: {e}"))
            return
        ids = [m["id"] for m in models]
        if not ids:
            notify.post_message(EngineFailed(f"no models are served at {url}"))
            return
        if self.requested_model is not None and self.requested_model not in ids:
            notify.post_message(
                EngineFailed(f"model {self.requested_model!r} is not served at {self.root}; it serves {', '.join(ids)}")
            )
            return
        chosen = models[ids.index(self.requested_model or ids[0])]
        self.max_model_len = chosen.get("max_model_len") if isinstance(chosen.get("max_model_len"), int) else None
        self._scrape_once()  # the first scrape names the server (vllm / sglang / kimitui)
        stats = self._server_stats
        self.server_kind = (stats.flavour if stats is not None else None) or chosen.get("owned_by") or self.server_kind
        self.model = chosen["id"]
        self._poller = threading.Thread(target=self._poll, name="kimitui-remote-metrics", daemon=True)
        self._poller.start()
        info = remote_info(self.model, self.root, self.server_kind, self.max_model_len, self.num_gpus)
        notify.post_message(EngineReady(info, time.monotonic() - t0))

    def shutdown(self) -> None:
        self._stop.set()
        if self._poller is not None and self._poller is not threading.current_thread():
            self._poller.join(timeout=1.0)  # a daemon: a scrape stuck on a slow server dies with us
        self.stop()  # a reply still streaming: its connection closes, the server aborts it

    # -- server metrics ----------------------------------------------------------------------
    def _poll(self) -> None:
        while not self._stop.wait(self.metrics_period_s):
            self._scrape_once()

    def _scrape_once(self) -> None:
        import httpx

        t = time.monotonic()
        try:
            with httpx.Client(timeout=CONNECT_TIMEOUT_S) as http:
                resp = http.get(f"{self.root}/metrics", headers=request_headers(self.api_key))
            if resp.status_code != 200:
                self._metrics_problem = f"no /metrics (HTTP {resp.status_code})"
                return
            snap = parse_server_metrics(resp.text)
        except httpx.HTTPError as e:
            self._metrics_problem = f"/metrics unreachable ({type(e).__name__})"
            return
        except ValueError as e:
            self._metrics_problem = f"/metrics unreadable ({e})"
            return
        if snap.flavour is None:
            self._metrics_problem = "/metrics has no vLLM, SGLang or kimitui metrics"
            return
        self._server_stats = self._tracker.add(t, snap)
        self._metrics_problem = None

    def stats(self):
        """The server's numbers from the latest scrape; this client's own when there are none."""
        if self._metrics_problem is None and self._server_stats is not None:
            return self._server_stats
        return self._client_rate.stats(time.monotonic(), self._metrics_problem or "no /metrics")

    # -- replies -----------------------------------------------------------------------------
    def request_body(self, chat: Chat, settings: GenerationSettings) -> dict[str, Any]:
        """The chat request. Earlier turns' reasoning is not sent: it is not part of OpenAI's
        message schema and chat templates drop it anyway."""
        messages = [{"role": m["role"], "content": m["content"]} for m in chat.messages(settings.system_prompt)]
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": settings.max_tokens,
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            # kimitui reads "thinking", Qwen-style templates (vLLM, SGLang) "enable_thinking"
            "chat_template_kwargs": {"thinking": settings.thinking, "enable_thinking": settings.thinking},
        }
        if settings.thinking:
            # Kimi K3's renderer's own argument (kimitui serve, and vLLM / SGLang pass it to the
            # template); other templates ignore an argument they do not read
            body["chat_template_kwargs"]["thinking_effort"] = settings.thinking_effort
        if settings.top_k:
            body["top_k"] = settings.top_k  # vLLM and SGLang take it beside OpenAI's fields
        return body

    def send(self, chat: Chat, settings: GenerationSettings, notify: MessagePump | None = None) -> ReplyState:
        if self.model is None:
            raise RuntimeError(f"not connected to {self.root} yet")
        body = self.request_body(chat, settings)
        state = ReplyState(chat.id)
        self.reply = state
        self._stop_asked = False
        self._reply_worker = self.app.run_worker(
            partial(self._stream_thread, state, body, notify or self.app),
            thread=True,
            group="reply",
            exit_on_error=False,
            name="reply",
        )
        return state

    def stop(self) -> bool:
        """Cancel the stream on its loop; closing the connection makes the server abort the request."""
        if not self.generating:
            return False
        self._stop_asked = True  # seen by the reply thread if its loop is not up yet
        loop, task = self._reply_loop, self._reply_task
        if loop is None or task is None:
            return True
        try:
            loop.call_soon_threadsafe(task.cancel)
        except RuntimeError:  # the loop just closed: the reply is over anyway
            return False
        return True

    def _stream_thread(self, state: ReplyState, body: dict, notify: MessagePump) -> None:
        """The reply's own event loop on a worker thread: chunks are read (and TTFT / TPOT timed) as
        they arrive, however busy the UI loop is drawing."""
        loop = asyncio.new_event_loop()
        try:
            self._reply_task = loop.create_task(self._stream(state, body, notify))
            self._reply_loop = loop
            if self._stop_asked:
                self._reply_task.cancel()
            loop.run_until_complete(self._reply_task)
        finally:
            self._reply_loop = None
            loop.close()

    async def _stream(self, state: ReplyState, body: dict, notify: MessagePump) -> None:
        import httpx

        finish, error, result = None, None, None
        try:
            timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
            async with httpx.AsyncClient(timeout=timeout) as http:
                result = await stream_chat(
                    http,
                    f"{self.root}/v1/chat/completions",
                    body,
                    request_headers(self.api_key),
                    state,
                    self._client_rate.add,
                )
            finish = result.finish_reason
        except asyncio.CancelledError:
            finish = "stopped"
        except RuntimeError as e:  # the server's own error, already one line
            finish, error = "error", str(e)
        except httpx.HTTPError as e:
            finish, error = "error", connection_error_line(self.root, e)
        except Exception as e:  # a reply that fails ends this reply only; the chat goes on
            log.exception("remote reply failed")
            finish, error = "error", f"{type(e).__name__}: {e}"
        state.done = True
        notify.post_message(
            ReplyFinished(
                state.chat_id,
                state.reasoning,
                state.content,
                state.num_tokens,
                result.ttft if result else None,
                result.tpot if result else None,
                finish,
                error,
            )
        )

    # -- benchmarks ----------------------------------------------------------------------------
    def bench_source(self) -> BenchSource:
        if self.model is None:
            return BenchSource(problem=f"Not connected to {self.root} yet.")
        model, root, api_key = self.model, self.root, self.api_key
        own = _checkpoint_tokenizer_dir(model)

        def make_client(config):
            from kimitui.bench.clients import OpenAICompletionsClient

            return OpenAICompletionsClient(
                root, model, api_key=api_key, temperature=config.temperature, ignore_eos=config.ignore_eos
            )

        def tokenizer():
            from kimitui.bench.targets import load_tokenizer
            from kimitui.engine.demo import demo_checkpoint

            return load_tokenizer(str(own or demo_checkpoint("demo-k3" if model == "demo-k3" else "demo")))

        note = "" if own or "demo" in model else " (prompts built with the demo tokenizer: lengths approximate)"
        return BenchSource(
            model,
            None,
            self.max_model_len,
            self.num_gpus,
            make_client,
            target=f"{model} at {root}{note}",
            tokenizer_factory=tokenizer,
        )


def _checkpoint_tokenizer_dir(model: str) -> Path | None:
    """`vllm serve /path/to/ckpt` serves the model under its path: its tokenizer is right here."""
    path = Path(model).expanduser()
    if path.is_dir() and ((path / "tokenizer.json").is_file() or (path / "tiktoken.model").is_file()):
        return path
    return None
