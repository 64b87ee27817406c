"""State shared by every route: the engine, the model's public name, limits and metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from functools import cached_property

from fastapi import Request

from kimitui.engine import AsyncLLM
from kimitui.server.errors import APIError, bad_request
from kimitui.server.limits import check_prompt_chars
from kimitui.server.metrics import ServerMetrics
from kimitui.server.streaming import EndSignal

DEFAULT_MAX_BODY_BYTES = 16 * 2**20
DEFAULT_REQUEST_READ_TIMEOUT_S = 60.0  # as nginx's client_header_timeout and client_body_timeout
log = logging.getLogger(__name__)
# Longer prompts are tokenized in a worker thread so one huge request cannot stall the others.
_INLINE_TOKENIZE_CHARS = 32_768


@dataclass
class ServerState:
    """What every handler needs: the engine, the model's public name, limits, metrics."""

    llm: AsyncLLM
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # seconds a client has to send a request's head (read_timeout.py) and its body (body.py)
    request_read_timeout: float | None = DEFAULT_REQUEST_READ_TIMEOUT_S
    # Host header values accepted (lower case, port included or not); None accepts any
    allowed_hosts: frozenset[str] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: ServerMetrics = field(init=False)
    # Shutdown: ``closing`` once it starts (new requests get 503); ``ended`` is set when the
    # grace period is over, and every running request then ends as its client can read it.
    closing: bool = field(default=False, init=False)
    ended: EndSignal = field(default_factory=EndSignal, init=False)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.served_model_name)

    def begin_shutdown(self, grace_s: float) -> None:
        """Called in the server's event loop when shutdown starts: running requests get
        ``grace_s`` seconds to finish."""
        self.closing = True
        log.info("shutting down: running requests get %.1f s to finish", grace_s)
        asyncio.get_running_loop().call_later(grace_s, self.ended.set)

    def end_now(self) -> None:
        """In the server's event loop: the grace period is over now."""
        self.closing = True
        self.ended.set()

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.llm.engine.max_model_len

    @property
    def prompts_in_flight(self) -> int:
        """Prompts of one /v1/completions request in the engine at once (completions.in_pieces):
        half the running batch, so a list of prompts fills the batch no more than half."""
        seqs = getattr(getattr(getattr(self.llm, "engine", None), "args", None), "max_num_seqs", None)
        return max(1, (seqs or 64) // 2)

    @property
    def vocab_size(self) -> int:
        return self.llm.config.vocab_size

    def check_model(self, requested: str | None) -> None:
        # Omitted `model` means the one we serve, as in vLLM.
        if requested is not None and requested != self.served_model_name:
            raise APIError(
                404,
                f"The model `{requested}` does not exist. This server serves `{self.served_model_name}`.",
                param="model",
                code="model_not_found",
            )

    def require_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise bad_request(
                f"this checkpoint has no tokenizer files, so {what} cannot be used; send token ids instead",
                param="prompt",
            )
        return self.tokenizer

    @cached_property
    def max_prompt_chars(self) -> int:
        """Characters beyond which a text cannot fit max_model_len whatever it says: each token
        covers at most the longest token's characters (its byte-level spelling, one symbol per
        byte, is at least as long)."""
        tok = self.tokenizer
        longest = max((len(t) for t in tok.convert_ids_to_tokens(range(tok.vocab_size)) if t), default=1)
        return self.max_model_len * max(1, longest)

    async def encode(self, text: str, param: str = "prompt", allow_special: bool = False) -> list[int]:
        tok = self.require_tokenizer("text prompts")
        check_prompt_chars(text, self.max_prompt_chars, param)
        try:
            return await self.run_blocking(len(text), tok.encode, text, allow_special=allow_special, param=param)
        except TypeError:  # the Rust tokenizer refuses strings holding lone surrogates ("\ud800")
            raise bad_request(
                f"{param} is not valid Unicode text (it contains a lone surrogate)", param=param
            ) from None

    def check_token_ids(self, ids: list[int], param: str = "prompt") -> None:
        if not ids:
            raise bad_request("prompt is empty: at least one token is needed", param=param)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary (vocab_size {self.vocab_size})", param=param)

    async def run_blocking(self, size: int, fn, *args, param: str = "prompt", **kwargs):
        """``fn(*args)`` (tokenizer work) inline when ``size`` is small, else in a worker thread.

        A Rust panic in the tokenizer reaches Python as pyo3's PanicException, a BaseException
        that no ``except Exception`` (ours, Starlette's) catches: it is this input's fault, a 400.
        """
        try:
            if size <= _INLINE_TOKENIZE_CHARS:
                return fn(*args, **kwargs)
            return await asyncio.to_thread(fn, *args, **kwargs)
        except (Exception, KeyboardInterrupt, SystemExit, asyncio.CancelledError, GeneratorExit):
            raise
        except BaseException as e:  # noqa: BLE001 - see above
            reason = (str(e).splitlines() or [""])[0][:200]
            raise bad_request(f"the tokenizer failed on {param} ({type(e).__name__}: {reason})", param=param) from None


def server_state(request: Request) -> ServerState:
    return request.app.state.server
