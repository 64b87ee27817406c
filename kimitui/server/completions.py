"""POST /v1/completions: text or token-id prompts, ``n`` choices per prompt, streaming or not.

Choice ``i * n + j`` is sample ``j`` of prompt ``i``, as OpenAI numbers them; the ``n`` samples of a
prompt are one engine request (engine/sampling/fanout.py), so they share its computed prompt."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kimitui.engine import RequestOutput, SamplingParams
from kimitui.server.body import read_body
from kimitui.server.errors import bad_request, engine_error, error_body
from kimitui.server.limits import MAX_PROMPTS
from kimitui.server.logprobs import TextOffsets, TokenIdText, TokenText, completion_logprobs
from kimitui.server.protocol import CompletionRequest
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
from kimitui.server.structured import compile_constraint, completion_constraint

# max_tokens of a /v1/completions request that sends none: 16, as OpenAI's legacy completions API
# (https://platform.openai.com/docs/api-reference/completions/create) and vLLM's CompletionRequest.
DEFAULT_MAX_TOKENS = 16
_PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of token-id lists"


@dataclass
class _Prompt:
    text: str | None
    ids: list[int]
    params: SamplingParams
    # max_tokens 0 (vLLM takes it: prompt log-probs only, with echo): the engine samples one token,
    # which the response leaves out
    zero: bool = False


def in_pieces(streams: list, limit: int) -> list:
    """At most ``limit`` of one request's prompts in the engine at a time; each next one is added
    when one ends. The scheduler serves first come first served, so 8,000 prompts added at once
    would put every other client's request behind all of them; added in pieces, a request that
    arrives meanwhile waits for one prompt, not for the list. (An engine request is added when its
    stream is first read, AsyncLLM.generate, so a stream waiting here costs nothing.)"""
    if len(streams) <= limit:
        return streams
    gate = asyncio.Semaphore(limit)

    async def admitted(stream):
        async with gate:
            async with aclosing(stream):
                async for out in stream:
                    yield out

    return [admitted(s) for s in streams]


def normalize_prompts(prompt) -> list[str | list[int]]:
    """``prompt`` as a list of single prompts (str or token ids); 400 for any other shape."""

    def is_ids(x) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if len(prompt) > MAX_PROMPTS and not is_ids(prompt):
            raise bad_request(
                f"prompt is a list of {len(prompt)} prompts; the limit is {MAX_PROMPTS} per request", param="prompt"
            )
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if is_ids(prompt):
            return [prompt]
        if all(is_ids(p) for p in prompt):
            return list(prompt)
    if isinstance(prompt, list) and not prompt:
        raise bad_request("prompt is empty", param="prompt")
    raise bad_request(f"prompt must be {_PROMPT_SHAPES}", param="prompt")


async def create_completion(request: Request) -> Response:
    state = server_state(request)
    req = await read_body(request, CompletionRequest, state.max_body_bytes)
    state.check_model(req.model)
    check_supported(req)
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    constraint = completion_constraint(req)  # response_format: the completion text is the JSON
    await compile_constraint(state, constraint, "response_format")
    prompts = [await _prepare(state, req, p, constraint) for p in normalize_prompts(req.prompt)]
    rid = f"cmpl-{uuid.uuid4().hex}"
    # a streamed request's prompts go to the engine now, unless they are too many for one piece
    eager = req.stream and len(prompts) <= state.prompts_in_flight
    open_stream = functools.partial(start_stream, state.llm) if eager else state.llm.generate
    streams = [
        open_stream({"prompt_token_ids": p.ids, "prompt": p.text}, p.params, f"{rid}-{i}")
        for i, p in enumerate(prompts)
    ]
    streams = in_pieces(streams, state.prompts_in_flight)
    if req.stream:
        return sse_response(_stream(state, req, rid, prompts, streams), owned=streams if eager else ())
    connected, finals = await unless_disconnected(request, _collect(streams))
    if not connected:
        state.metrics.observe_aborted(len(prompts))
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
    return JSONResponse(_response(state, req, rid, prompts, finals))


async def _prepare(state: ServerState, req: CompletionRequest, prompt: str | list[int], constraint=None) -> _Prompt:
    if isinstance(prompt, str):
        text, ids = prompt, await state.encode(prompt)
    else:
        text, ids = None, list(prompt)
    state.check_token_ids(ids)
    requested = req.max_tokens
    if requested is None:  # OpenAI's default for completions (chat's is the rest of the context)
        requested = max(1, min(DEFAULT_MAX_TOKENS, state.max_model_len - len(ids)))
    max_tokens = resolve_max_tokens(requested, len(ids), state.max_model_len, allow_zero=True)
    k = req.logprobs
    params = build_sampling_params(
        req,
        max_tokens=max(1, max_tokens),
        logprobs=k,
        prompt_logprobs=k if req.echo and k is not None else None,
        skip_special_tokens=req.skip_special_tokens,
        structured_outputs=constraint,
    )
    return _Prompt(text, ids, params, zero=max_tokens == 0)


def _shown(p: _Prompt, c) -> tuple[str, list[int], list, str | None]:
    """(text, token ids, log-prob entries, finish reason) of a completion as the client sees it:
    nothing generated for max_tokens 0."""
    if p.zero:
        return "", [], [], "length" if c.finish_reason is not None else None
    return c.text, list(c.token_ids), list(c.logprobs or []), c.finish_reason


def _names(state: ServerState, req: CompletionRequest) -> TokenText:
    return TokenIdText(state.tokenizer) if req.return_tokens_as_token_ids else TokenText(state.tokenizer)


async def _collect(streams) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        async with aclosing(merged(streams)) as events:
            async for i, out in events:
                finals[i] = out
    except Exception as e:  # noqa: BLE001 - becomes this request's error response
        raise engine_error(e) from None
    return finals


def _echo_text(state: ServerState, req: CompletionRequest, p: _Prompt) -> str:
    if p.text is not None:
        return p.text
    tok = state.tokenizer
    return "" if tok is None else tok.decode(p.ids, skip_special_tokens=req.skip_special_tokens)


def _usage(prompts: list[_Prompt], outs: list[RequestOutput]) -> dict:
    prompt_tokens = sum(len(p.ids) for p in prompts)
    completion_tokens = sum(0 if p.zero else len(c.token_ids) for p, o in zip(prompts, outs) if o for c in o.outputs)
    cached = sum((o.metrics.num_cached_tokens if o and o.metrics else 0) for o in outs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _response(
    state: ServerState, req: CompletionRequest, rid: str, prompts: list[_Prompt], finals: list[RequestOutput]
) -> dict:
    names = _names(state, req)
    choices = []
    for i, (p, out) in enumerate(zip(prompts, finals)):
        state.metrics.observe_finished(out.metrics, out.outputs[0].finish_reason)
        prefix = _echo_text(state, req, p) if req.echo else ""
        for c in out.outputs:
            text, ids, entries, finish = _shown(p, c)
            logprobs = None
            if req.logprobs is not None:
                if req.echo:
                    ids, entries = p.ids + ids, list(out.prompt_logprobs or [None] * len(p.ids)) + entries
                offsets = TextOffsets(state.tokenizer, req.skip_special_tokens)
                logprobs = completion_logprobs(names, ids, entries, req.logprobs, offsets)
            choices.append(
                {
                    "index": i * req.n + c.index,
                    "text": prefix + text,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                    "stop_reason": None if p.zero else c.stop_reason,
                }
            )
            if req.return_token_ids:
                choices[-1]["token_ids"] = [] if p.zero else list(c.token_ids)
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.served_model_name,
        "choices": choices,
        "usage": _usage(prompts, finals),
    }


@dataclass
class _Progress:
    chars: int = 0  # characters of the completion sent
    tokens: int = 0  # tokens whose log-probs were sent
    ids: int = 0  # token ids sent (return_token_ids)
    offsets: TextOffsets | None = None
    started: bool = False
    final: RequestOutput | None = None


async def _stream(state: ServerState, req: CompletionRequest, rid: str, prompts: list[_Prompt], streams):
    names = _names(state, req)
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.served_model_name}
    n = req.n
    progress = [
        _Progress(offsets=TextOffsets(state.tokenizer, req.skip_special_tokens)) for _ in range(len(prompts) * n)
    ]
    finals: list[RequestOutput | None] = [None] * len(prompts)
    try:
        async with aclosing(until_shutdown(state.ended, merged(streams))) as events:
            async for i, out in events:
                if out.finished:
                    finals[i] = out
                    state.metrics.observe_finished(out.metrics, out.outputs[0].finish_reason)
                for c in out.outputs:
                    prog = progress[i * n + c.index]
                    if n > 1 and prog.final is not None:
                        continue  # this choice has ended; its siblings still run
                    if n > 1 and len(c.token_ids) == prog.tokens and c.finish_reason is None:
                        continue  # nothing new for this choice in this step
                    choice = _chunk_choice(state, req, names, prompts[i], prog, out, c)
                    yield sse({**head, "choices": [{"index": i * n + c.index, **choice}]})
        if req.include_usage:
            yield sse({**head, "choices": [], "usage": _usage(prompts, finals)})
    except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, then end the stream
        err = engine_error(e)
        yield sse(error_body(err.status, err.message, err.param, err.code))
    finally:
        state.metrics.observe_aborted(sum(f is None for f in finals))
    yield SSE_DONE


def _chunk_choice(
    state: ServerState, req: CompletionRequest, names: TokenText, p: _Prompt, prog: _Progress, out: RequestOutput, c
) -> dict:
    """The new part of choice ``c`` of one cumulative engine output, as a streamed choice."""
    done = c.finish_reason is not None  # this choice has ended (its siblings may still run)
    shown_text, shown_ids, shown_entries, finish = _shown(p, c)
    # A stop string can complete several tokens later and cut text already produced: hold back
    # enough characters that nothing sent is ever taken back.
    hold = max((len(s) for s in p.params.stop_strings), default=1) - 1
    end = len(shown_text) if done else max(prog.chars, len(shown_text) - hold)
    text = shown_text[prog.chars : end]
    prog.chars = end
    ids, entries = shown_ids[prog.tokens :], shown_entries[prog.tokens :]
    prog.tokens = len(shown_ids)
    if not prog.started:
        prog.started = True
        if req.echo:
            text = _echo_text(state, req, p) + text
            ids = p.ids + ids
            entries = list(out.prompt_logprobs or [None] * len(p.ids)) + entries
    logprobs = None
    if req.logprobs is not None:
        logprobs = completion_logprobs(names, ids, entries, req.logprobs, prog.offsets)
    if done:
        prog.final = out
    chunk = {
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish if done else None,
        "stop_reason": c.stop_reason if done and not p.zero else None,
    }
    if req.return_token_ids:
        chunk["token_ids"] = [] if p.zero else list(c.token_ids[prog.ids :])
        prog.ids = len(c.token_ids)
    return chunk
