"""LLM: the offline, synchronous API (vLLM's, so users know it)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from kimitui.engine.args import EngineArgs
from kimitui.engine.engine import LLMEngine, PromptError
from kimitui.engine.outputs import LogprobRows, RequestOutput
from kimitui.engine.sampling_params import SamplingParams
from kimitui.engine.text.chat_format import chat_format_for


class LLM:
    """Load a checkpoint (or the built-in demo when ``model`` is None or "demo") and generate."""

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        enable_prefix_caching: bool = True,
        cpu_offload: str | int = "auto",
        gpu_memory_gb: float | None = None,
        progress=None,
        **kwargs,
    ):
        args = EngineArgs(
            model=model,
            dtype=dtype,
            device=device,
            tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=enable_prefix_caching,
            cpu_offload=cpu_offload,
            gpu_memory_gb=gpu_memory_gb,
            **kwargs,
        )
        self.engine = LLMEngine(args, progress)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop tensor-parallel workers now (they also stop when the LLM is garbage-collected)."""
        self.engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def generate(
        self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Prompts: a str, a list of token ids, a {"prompt_token_ids": [...]} dict, or a list of these."""
        prompts = _as_prompt_list(prompts)
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
            params = sampling_params
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        ids = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.engine.add_request(None, p, sp))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r] for r in ids]

    def score_logits(self, prompt, decode_from: int | None = None, chunk: int | None = None) -> Iterator[LogprobRows]:
        """The model's full-vocabulary float32 log-probs at every position 1..n-1 of ``prompt``
        (token ids or text), in position order, as ``LogprobRows`` pieces of at most ``chunk``
        rows: row i of a piece is the distribution of the token at ``first_pos + i``.

        ``decode_from`` (d, 1 <= d < n): positions 1..d come from the prefill path and positions
        d+1..n-1 from the decode path, the reference tokens fed back one by one (teacher forcing),
        so the two paths can be measured separately; None: every position from prefill. Memory
        stays bounded: the engine hands out each step's rows (at most ``max_num_batched_tokens``
        prompt positions, or one row per decode) and keeps none."""
        _text, ids = self.engine._prompt_ids(prompt)
        n = len(ids)
        if n < 2:
            raise PromptError(f"scoring needs at least 2 tokens, got {n}")
        if n > self.engine.max_model_len:
            raise PromptError(f"{n} tokens to score; the context limit is max_model_len={self.engine.max_model_len}")
        if chunk is not None and chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        d = n if decode_from is None else decode_from
        if not 1 <= d <= n:
            raise ValueError(f"decode_from must be in 1..{n} (the prompt's length), got {decode_from}")
        forced = ids[d:]
        params = SamplingParams(
            temperature=0.0,
            max_tokens=max(1, len(forced)),
            ignore_eos=True,
            logprob_rows=True,
            forced_token_ids=forced or None,
            skip_special_tokens=False,
        )
        rid = self.engine.add_request(None, {"prompt_token_ids": ids[:d]}, params)
        done = False
        try:
            while not done:
                for out in self.engine.step():
                    if out.request_id != rid:
                        continue
                    done = out.finished
                    for rows in out.logprob_rows or []:
                        keep = min(rows.num_rows, n - rows.first_pos)  # nothing past the last token
                        step = chunk or max(keep, 1)
                        for at in range(0, keep, step):
                            yield LogprobRows(rows.first_pos + at, rows.values[at : min(at + step, keep)], rows.path)
        finally:
            if not done:
                self.engine.abort_request(rid)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        thinking: bool | None = None,
        tools: list[dict] | None = None,
        thinking_effort: str | None = None,
        preserve_thinking: bool | None = None,
    ) -> list[RequestOutput]:
        """Render the checkpoint's chat format (Kimi K2's, or K3's XTML) and generate; stops at
        the end of the assistant turn. ``thinking_effort`` (low / high / max) is a K3
        option: a K2 checkpoint ignores it with a logged note. Parse a reply's text with
        ``engine.chat_format.chat_format_for(llm.get_tokenizer()).reply_parser(...)``."""

        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError(f"{self.engine.model_dir} has no tokenizer files; chat needs one")
        fmt = chat_format_for(tok)
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        params = sampling_params or SamplingParams()
        stop_ids = list(dict.fromkeys(list(params.stop_token_ids or []) + fmt.stop_token_ids()))
        params = replace(params, stop_token_ids=stop_ids)
        prompts = [
            {
                "prompt_token_ids": fmt.encode(
                    c,
                    thinking=thinking,
                    tools=tools,
                    thinking_effort=thinking_effort,
                    preserve_thinking=preserve_thinking,
                ).ids
            }
            for c in conversations
        ]
        return self.generate(prompts, params)


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise TypeError("prompts must be a str, a list of token ids, a dict with 'prompt_token_ids', or a list of these")
