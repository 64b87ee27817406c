"""State shared by every route: the engine, the model's public name, limits and metrics."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from fastapi import Request

from kimitui.engine import AsyncLLM
from kimitui.server.errors import APIError, bad_request
from kimitui.server.metrics import ServerMetrics

DEFAULT_MAX_BODY_BYTES = 16 * 2**20
# Longer prompts are tokenized in a worker thread so one huge request cannot stall the others.
_INLINE_TOKENIZE_CHARS = 32_768


@dataclass
class ServerState:
    """What every handler needs: the engine, the model's public name, limits, metrics."""

    llm: AsyncLLM
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: ServerMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.served_model_name)

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.llm.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.llm.config.vocab_size

    def check_model(self, requested: str | None) -> None:
        # Omitted `model` means the one we serve, as in vLLM.
        if requested is not None and requested != self.served_model_name:
            raise APIError(404, f"The model `{requested}` does not exist. This server serves "
                                f"`{self.served_model_name}`.", param="model", code="model_not_found")

    def require_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise bad_request(f"this checkpoint has no tokenizer files, so {what} cannot be used; "
                              "send token ids instead", param="prompt")
        return self.tokenizer

    async def encode(self, text: str) -> list[int]:
        tok = self.require_tokenizer("text prompts")
        try:
            return await self.run_blocking(len(text), tok.encode, text)
        except TypeError:  # the Rust tokenizer refuses strings holding lone surrogates ("\ud800")
            raise bad_request("prompt is not valid Unicode text (it contains a lone surrogate)",
                              param="prompt") from None

    def check_token_ids(self, ids: list[int], param: str = "prompt") -> None:
        if not ids:
            raise bad_request("prompt is empty: at least one token is needed", param=param)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary (vocab_size {self.vocab_size})",
                              param=param)

    async def run_blocking(self, size: int, fn, *args, **kwargs):
        """``fn(*args)`` inline when ``size`` is small, else in a worker thread."""
        if size <= _INLINE_TOKENIZE_CHARS:
            return fn(*args, **kwargs)
        return await asyncio.to_thread(fn, *args, **kwargs)


def server_state(request: Request) -> ServerState:
    return request.app.state.server
