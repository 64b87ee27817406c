"""What the evaluation screen measures: the model the app already has.

Recall talks to that very model: the bridge's ``AsyncLLM`` (driven from the job's own event loop,
as the benchmark drives it) or the remote server (kimitui.eval.recall's HTTP target). KL needs
full-vocabulary log-probs of given tokens and a float32 reference, which only an in-process
``engine.LLM`` gives, so it loads the reference and the path under test from the app's engine
flags, exactly as `kimitui eval kl` does; against a remote server it is not offered here (the
command's ``--base-url`` mode holds the approximation, and it needs the checkpoint locally).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from kimitui.eval.haystack import Haystack
from kimitui.eval.recall import RecallTarget, http_target

KL_REMOTE_NOTE = (
    "KL is measured in this process (a float32 reference beside the path under test); this app "
    "talks to a remote server, so run `kimitui eval kl --base-url URL --model CHECKPOINT` instead."
)


def is_remote(bridge: Any) -> bool:
    return hasattr(bridge, "root") and not hasattr(bridge, "engine_args")


def recall_target(bridge: Any) -> RecallTarget:
    """A recall target over the app's bridge; ValueError (one line) when nothing is loaded."""
    if is_remote(bridge):
        if getattr(bridge, "model", None) is None:
            raise ValueError(f"not connected to {bridge.root} yet")
        source = bridge.bench_source()
        return http_target(bridge.root, bridge.model, lambda _name: source.resolve_tokenizer(), bridge.api_key)
    llm = getattr(bridge, "llm", None)
    if llm is None:
        raise ValueError("the model is not loaded yet")
    return async_engine_target(llm, bridge.engine_args.model or "demo")


def async_engine_target(llm: Any, name: str) -> RecallTarget:
    """The loaded ``AsyncLLM``: prompts in its checkpoint's chat format, thinking off, greedy,
    all codes of one length in flight together (the engine batches them)."""
    from kimitui.engine.sampling_params import SamplingParams
    from kimitui.engine.text.chat_format import chat_format_for

    tok = llm.tokenizer
    if tok is None:
        raise ValueError(f"{name}: the checkpoint has no tokenizer; the recall prompts need one")
    fmt = chat_format_for(tok)
    started_in_thinking = fmt.encode([{"role": "user", "content": "x"}], thinking=False).started_in_thinking

    def encode(messages: list[dict]) -> list[int]:
        return fmt.encode(messages, thinking=False).ids

    async def one(ids: list[int], params) -> str:
        text = ""
        async for out in llm.generate({"prompt_token_ids": ids}, params):
            text = out.outputs[0].text
        parser = fmt.reply_parser(started_in_thinking)
        parser.feed(text)
        parser.finish()
        return parser.result().content

    async def all_codes(hay: Haystack, max_tokens: int) -> list[str]:
        params = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            stop_token_ids=fmt.stop_token_ids(),
            keep_special_token_ids=fmt.keep_special_ids(),
        )
        return list(await asyncio.gather(*(one(ids, params) for ids in hay.prompts)))

    def answer(hay: Haystack, max_tokens: int) -> list[tuple[str, int]]:
        replies = asyncio.run(all_codes(hay, max_tokens))  # the job's worker thread has no running loop
        return [(r, len(ids)) for r, ids in zip(replies, hay.prompts)]

    engine = getattr(llm, "engine", None)
    # close: nothing; the engine belongs to the app's chat
    return RecallTarget(
        f"{name} in-process ({fmt.name} chat format)",
        encode,
        lambda s: len(tok.encode(s)),
        getattr(engine, "max_model_len", None),
        answer,
    )


def kl_engine_args(engine_args: Any, prompt_len: int) -> tuple[Any, Any]:
    """(reference, under test) engine args: float32 on one process for the reference, the app's
    flags for the test, both with room for the prompts, as `kimitui eval kl` builds them."""
    if engine_args.max_model_len is None:
        engine_args = replace(engine_args, max_model_len=prompt_len + 8)
    elif prompt_len > engine_args.max_model_len:
        raise ValueError(f"KL prompt length {prompt_len} is above max_model_len {engine_args.max_model_len}")
    ref = replace(
        engine_args,
        dtype="float32",
        tensor_parallel_size=1,
        speculative_config=None,
        max_num_seqs=1,
        enable_prefix_caching=False,
    )
    test = replace(engine_args, enable_prefix_caching=False)
    return ref, test
