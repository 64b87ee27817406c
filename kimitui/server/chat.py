"""POST /v1/chat/completions: Kimi chat format in, reasoning / content / tool calls out."""

from __future__ import annotations

import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from functools import partial

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kimitui.engine import RequestOutput, SamplingParams
from kimitui.engine.outputs import CompletionOutput
from kimitui.engine.text.chat_format import ChatFormat, chat_format_for
from kimitui.engine.text.k2 import StreamDelta, ToolCall
from kimitui.engine.text.xtml.options import THINKING_EFFORTS, OptionError, response_format_type, tool_choice_name
from kimitui.server.body import read_body
from kimitui.server.errors import bad_request, engine_error, error_body
from kimitui.server.limits import check_prompt_chars_of
from kimitui.server.logprobs import TokenText, chat_logprobs
from kimitui.server.protocol import ChatCompletionRequest
from kimitui.server.sampling import build_sampling_params, check_supported, resolve_max_tokens
from kimitui.server.state import ServerState, server_state
from kimitui.server.streaming import (
    SSE_DONE,
    merged,
    sse,
    sse_response,
    start_stream,
    unless_disconnected,
    until_shutdown,
)
from kimitui.server.structured import chat_constraint, compile_constraint
from kimitui.server.tools import check_tools

log = logging.getLogger(__name__)


@dataclass
class _Chat:
    ids: list[int]
    params: SamplingParams
    fmt: ChatFormat  # the checkpoint's chat format (K2's or K3's XTML): renders and parses
    started_in_thinking: bool
    report_tools: bool
    top_logprobs: int | None


async def create_chat_completion(request: Request) -> Response:
    state = server_state(request)
    req = await read_body(request, ChatCompletionRequest, state.max_body_bytes)
    state.check_model(req.model)
    check_supported(req)
    chat = await _prepare(state, req)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    if req.stream:
        stream = start_stream(state.llm, chat.ids, chat.params, rid)
        return sse_response(_stream(state, req, rid, chat, stream), owned=[stream])
    stream = state.llm.generate(chat.ids, chat.params, rid)
    connected, final = await unless_disconnected(request, _collect(stream))
    if not connected:
        state.metrics.observe_aborted()
        return Response(status_code=499)
    return JSONResponse(_response(state, rid, chat, final))


def _template_options(kwargs: dict | None) -> dict:
    """``chat_template_kwargs`` as ChatFormat.encode options: ``thinking`` (Qwen-style clients
    send ``enable_thinking``), ``thinking_effort`` (K3; a K2 checkpoint ignores it) and
    ``preserve_thinking`` (keep the reasoning of earlier turns). Other keys are template hints
    this server's renderers do not take."""
    kwargs = kwargs or {}
    options: dict = {"thinking": None, "thinking_effort": None, "preserve_thinking": None}
    for key, option in (
        ("thinking", "thinking"),
        ("enable_thinking", "thinking"),
        ("preserve_thinking", "preserve_thinking"),
    ):
        value = kwargs.get(key)
        if value is not None and options[option] is None:
            if not isinstance(value, bool):
                raise bad_request(
                    f"chat_template_kwargs.{key} must be true or false, got {value!r}",
                    param=f"chat_template_kwargs.{key}",
                )
            options[option] = value
    effort = kwargs.get("thinking_effort")
    if effort is not None:
        if effort not in THINKING_EFFORTS:
            raise bad_request(
                f"chat_template_kwargs.thinking_effort must be one of {', '.join(THINKING_EFFORTS)}, got {effort!r}",
                param="chat_template_kwargs.thinking_effort",
            )
        options["thinking_effort"] = effort
    return options


def _check_option(check, value):
    try:
        return check(value)
    except OptionError as e:
        raise bad_request(str(e), param=e.param) from None


def _check_tool_choice(req: ChatCompletionRequest) -> bool:
    """Validate ``tool_choice`` against ``tools`` (OpenAI's rules); True when replies may call tools.
    Every choice is rendered by the chat format (K3 writes "none" and "required" as system messages);
    "required" and a named function are enforced by constrained decoding, not by the prompt."""
    check_tools(req.tools)  # rendered into the prompt even when no constraint reads them
    choice = req.tool_choice
    name = _check_option(tool_choice_name, choice)
    if (name is not None or choice == "required") and not req.tools:
        raise bad_request(f"tool_choice {choice!r} needs tools", param="tool_choice")
    if name is not None and name not in {(t.get("function") or t).get("name") for t in req.tools}:
        raise bad_request(f"tool_choice names function {name!r}, which is not in tools", param="tool_choice")
    return bool(req.tools) and choice != "none"


async def _prepare(state: ServerState, req: ChatCompletionRequest) -> _Chat:
    tok = state.require_tokenizer("chat messages")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    report_tools = _check_tool_choice(req)
    _check_option(response_format_type, req.response_format)
    messages = []
    for i, m in enumerate(req.messages):
        # The checkpoint template would render an image part as a media placeholder with no
        # image behind it: refuse rather than let the model answer about a picture it never saw.
        for part in m.content if isinstance(m.content, list) else ():
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(
                    f"content part of type {part.get('type')!r} is not supported: this server takes text only",
                    param=f"messages.{i}.content",
                )
        d = m.model_dump(exclude_none=True)
        if d["role"] == "developer":  # OpenAI's newer name for the system role
            d["role"] = "system"
        messages.append(d)
    tools = req.tools or None
    size = sum(len(str(m.get("content", ""))) for m in messages) + len(str(tools or ""))
    check_prompt_chars_of(state, size, "messages")
    fmt = chat_format_for(tok)
    options = _template_options(req.chat_template_kwargs)
    try:
        prompt = await state.run_blocking(
            size,
            partial(
                fmt.encode,
                messages,
                tools=tools,
                tool_choice=req.tool_choice,
                response_format=req.response_format,
                reasoning_effort=req.reasoning_effort,
                **options,
            ),
            param="messages",
        )
    except OptionError as e:  # a request option the format does not take (reasoning_effort "medium" on K3)
        raise bad_request(str(e), param=e.param) from None
    except Exception as e:  # noqa: BLE001 - ChatError, template errors: the messages are at fault
        raise bad_request(f"cannot render the messages in the chat format: {e}", param="messages") from None
    if prompt.note:
        log.info("chat request: %s", prompt.note)
    ids = prompt.ids
    state.check_token_ids(ids, param="messages")
    requested, param = (
        (req.max_completion_tokens, "max_completion_tokens")
        if req.max_completion_tokens is not None
        else (req.max_tokens, "max_tokens")
    )
    max_tokens = resolve_max_tokens(requested, len(ids), state.max_model_len, param)
    k = (req.top_logprobs or 0) if req.logprobs else None
    # response_format / tool_choice "required" or named: grammar-constrained decoding (engine/structured)
    constraint, field = chat_constraint(req, fmt, tok, prompt.started_in_thinking)
    await compile_constraint(state, constraint, field)
    # The reply parser needs the format's tags (K2: <think> and tool-call tokens; K3's XTML
    # brackets are text anyway); other special tokens are dropped.
    params = build_sampling_params(
        req,
        max_tokens=max_tokens,
        logprobs=k,
        extra_stop_token_ids=fmt.stop_token_ids(),
        skip_special_tokens=True,
        logprobs_param="top_logprobs",
        keep_special_token_ids=fmt.keep_special_ids(),
        structured_outputs=constraint,
    )
    return _Chat(ids, params, fmt, prompt.started_in_thinking, report_tools, k)


async def _collect(stream) -> RequestOutput:
    final = None
    try:
        async with aclosing(merged([stream])) as events:
            async for _, out in events:
                final = out
    except Exception as e:  # noqa: BLE001 - becomes this request's error response
        raise engine_error(e) from None
    return final


def _reply_text(state: ServerState, c: CompletionOutput) -> str:
    """Generated text without the stop token's own text (``[EOS]`` would otherwise reach content)."""
    if c.finish_reason == "stop" and isinstance(c.stop_reason, int):
        tail = state.tokenizer.decode([c.stop_reason], skip_special_tokens=False)
        if tail and c.text.endswith(tail):
            return c.text[: -len(tail)]
    return c.text


def _tool_call(call: ToolCall, index: int | None = None) -> dict:
    d = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}
    return d if index is None else {"index": index, **d}


def _usage(chat: _Chat, out: RequestOutput | None) -> dict:
    completion = sum(len(c.token_ids) for c in out.outputs) if out else 0
    cached = out.metrics.num_cached_tokens if out and out.metrics else 0
    return {
        "prompt_tokens": len(chat.ids),
        "completion_tokens": completion,
        "total_tokens": len(chat.ids) + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _finish_reason(c: CompletionOutput, had_tool_calls: bool) -> str | None:
    return "tool_calls" if had_tool_calls else c.finish_reason


def _response(state: ServerState, rid: str, chat: _Chat, out: RequestOutput) -> dict:
    state.metrics.observe_finished(out.metrics, out.outputs[0].finish_reason)
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": state.served_model_name,
        "choices": [_choice(state, chat, c) for c in out.outputs],
        "usage": _usage(chat, out),
    }


def _choice(state: ServerState, chat: _Chat, c: CompletionOutput) -> dict:
    """One finished choice: the reply parsed into reasoning, content and tool calls."""
    parser = chat.fmt.reply_parser(chat.started_in_thinking)
    parser.feed(_reply_text(state, c))
    parser.finish()
    calls = parser.tool_calls if chat.report_tools else []
    message = {
        "role": "assistant",
        "content": parser.content if parser.content or not calls else None,
        "reasoning_content": parser.reasoning or None,
    }
    if calls:
        message["tool_calls"] = [_tool_call(t) for t in calls]
    logprobs = None
    if chat.top_logprobs is not None:
        logprobs = chat_logprobs(TokenText(state.tokenizer), c.token_ids, c.logprobs or [], chat.top_logprobs)
    return {
        "index": c.index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": _finish_reason(c, bool(calls)),
        "stop_reason": c.stop_reason,
    }


class _StreamState:
    """What one chat stream has sent so far."""

    def __init__(self, chat: _Chat):
        self.parser = chat.fmt.reply_parser(chat.started_in_thinking)
        self.chars = 0
        self.tokens = 0
        self.role_sent = False
        self.num_tool_calls = 0
        self.seen = 0  # tokens of this choice already looked at
        self.final: CompletionOutput | None = None


async def _stream(state: ServerState, req: ChatCompletionRequest, rid: str, chat: _Chat, stream):
    names = TokenText(state.tokenizer)
    head = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": state.served_model_name}
    sts = [_StreamState(chat) for _ in range(req.n)]  # one per choice index
    hold = max((len(s) for s in chat.params.stop_strings), default=1) - 1
    final = None
    try:
        async with aclosing(until_shutdown(state.ended, merged([stream]))) as events:
            async for _, out in events:
                if out.finished:
                    final = out
                    state.metrics.observe_finished(out.metrics, out.outputs[0].finish_reason)
                for c in out.outputs:
                    st = sts[c.index]
                    if req.n > 1 and (
                        st.final is not None or (len(c.token_ids) == st.seen and c.finish_reason is None)
                    ):
                        continue  # nothing new for this choice (or it has ended while its siblings run)
                    st.seen = len(c.token_ids)
                    choice = _chunk_choice(state, chat, names, st, c, hold)
                    if choice is not None:
                        yield sse({**head, "choices": [choice]})
        if req.include_usage:
            yield sse({**head, "choices": [], "usage": _usage(chat, final)})
    except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, then end the stream
        err = engine_error(e)
        yield sse(error_body(err.status, err.message, err.param, err.code))
    finally:
        if final is None:
            state.metrics.observe_aborted()
    yield SSE_DONE


def _chunk_choice(
    state: ServerState, chat: _Chat, names: TokenText, st: _StreamState, c: CompletionOutput, hold: int
) -> dict | None:
    """The delta for choice ``c`` of one cumulative engine output, or None when it completed nothing
    to show."""
    done = c.finish_reason is not None  # this choice has ended (its siblings may still run)
    text = _reply_text(state, c)
    # Hold back text a stop string could still cut (see completions._chunk_choice).
    end = len(text) if done else max(st.chars, len(text) - hold)
    d = st.parser.feed(text[st.chars : end])
    st.chars = end
    if done:
        tail = st.parser.finish()
        d = StreamDelta(d.reasoning + tail.reasoning, d.content + tail.content, d.tool_calls + tail.tool_calls)
    delta: dict = {}
    if d.reasoning:
        delta["reasoning_content"] = d.reasoning
    if d.content:
        delta["content"] = d.content
    calls = d.tool_calls if chat.report_tools else []
    if calls:
        delta["tool_calls"] = [_tool_call(t, st.num_tool_calls + j) for j, t in enumerate(calls)]
        st.num_tool_calls += len(calls)
    if not delta and not done:
        return None  # tokens held back inside a tag; their log-probs go with the next chunk
    if not st.role_sent:
        delta = {"role": "assistant", **delta}
        st.role_sent = True
    logprobs = None
    if chat.top_logprobs is not None:
        logprobs = chat_logprobs(names, c.token_ids[st.tokens :], (c.logprobs or [])[st.tokens :], chat.top_logprobs)
        st.tokens = len(c.token_ids)
    finish = None
    if done:
        st.final = c
        finish = _finish_reason(c, st.num_tool_calls > 0)
    return {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
