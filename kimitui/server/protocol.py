"""Request bodies of the OpenAI-compatible endpoints (pydantic), with vLLM's extra sampling fields.

Unknown fields are ignored, as vLLM and OpenAI do, so clients that send extras (``user``,
``repetition_penalty: 1.0`` from ``vllm bench``) work. Fields we cannot honour with a non-default
value are declared and rejected in ``sampling.py`` instead of being silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_tokens: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's penalties and vLLM's repetition_penalty (engine/sampling/penalties.py)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    # str, list[str], list[int] or list[list[int]]; checked by completions.normalize_prompts so
    # the error names the accepted shapes instead of listing four union branches.
    prompt: Any = Field(...)
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    skip_special_tokens: bool = True
    response_format: dict[str, Any] | None = None
    return_token_ids: bool = False  # vLLM's extra: each choice also carries its generated token ids
    # vLLM's extension: name tokens "token_id:<id>" in logprobs, so clients get ids, not text
    return_tokens_as_token_ids: bool = False


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow")  # keep vendor fields the chat template may read

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    # "auto", "none", "required" or {"type": "function", "function": {"name": ...}} (OpenAI's shapes).
    tool_choice: str | dict[str, Any] | None = None
    # {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}.
    response_format: dict[str, Any] | None = None
    # OpenAI's effort names; Kimi K3 maps them onto its thinking effort (engine/text/xtml/options.py).
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
