"""Request fields -> engine SamplingParams, with the checks that turn bad values into 400s."""

from __future__ import annotations

from kimitui.engine import SamplingParams
from kimitui.server.errors import bad_request
from kimitui.server.limits import check_stop
from kimitui.server.protocol import SamplingFields

MAX_N = 128  # OpenAI's limit on n; best_of has the same bound here


def check_supported(req: SamplingFields) -> None:
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be in 1..{MAX_N}, got {req.n}", param="n")
    if req.best_of is not None and not req.n <= req.best_of <= MAX_N:
        raise bad_request(f"best_of must be in n..{MAX_N} (n={req.n}), got {req.best_of}", param="best_of")
    if req.stream and (req.best_of or req.n) > req.n:
        raise bad_request("best_of > n cannot be streamed (the choices are known only at the end)", param="best_of")
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by this server", param="logit_bias")
    # Values that would overflow the int64 tensors of a batched step: caught here, because a
    # failing step fails every request in the batch, not just this one.
    for name, value, lo, hi in (
        ("seed", req.seed, -(2**63), 2**64 - 1),
        ("top_k", req.top_k, -1, 2**31),
        ("min_tokens", req.min_tokens, 0, 2**31),
    ):
        if value is not None and not lo <= value <= hi:
            raise bad_request(f"{name} must be in {lo}..{hi}, got {value}", param=name)
    check_stop(req.stop, req.stop_token_ids)
    if any(not 0 <= t < 2**63 for t in req.stop_token_ids or ()):
        raise bad_request("stop_token_ids must be non-negative token ids", param="stop_token_ids")


def resolve_max_tokens(
    requested: int | None, prompt_len: int, max_model_len: int, param: str = "max_tokens", allow_zero: bool = False
) -> int:
    """``requested`` checked against the context; None means all of the context that is left.
    ``allow_zero``: 0 is accepted (and returned; the caller decides what it means)."""
    lowest = 0 if allow_zero else 1
    if requested is not None and requested < lowest:
        raise bad_request(f"{param} must be >= {lowest}, got {requested}", param=param)
    if prompt_len >= max_model_len:
        raise bad_request(
            f"prompt has {prompt_len} tokens, which leaves no room to generate within max_model_len {max_model_len}",
            param="prompt",
        )
    if requested is None:
        return max_model_len - prompt_len
    if prompt_len + requested > max_model_len:
        raise bad_request(
            f"prompt has {prompt_len} tokens and {param} is {requested}: together "
            f"{prompt_len + requested} exceed max_model_len {max_model_len}",
            param=param,
        )
    return requested


def build_sampling_params(
    req: SamplingFields,
    *,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    extra_stop_token_ids: list[int] = (),
    skip_special_tokens: bool = True,
    logprobs_param: str = "logprobs",
    keep_special_token_ids: list[int] | None = None,
    structured_outputs=None,
) -> SamplingParams:
    stop_ids = list(req.stop_token_ids or [])
    stop_ids += [t for t in extra_stop_token_ids if t not in stop_ids]
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
            frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=stop_ids,
            ignore_eos=req.ignore_eos,
            seed=req.seed,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=skip_special_tokens,
            keep_special_token_ids=keep_special_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            n=req.n,
            best_of=req.best_of,
            structured_outputs=structured_outputs,
        )
    except ValueError as e:
        # The engine's messages start with the field name ("top_p must be in (0, 1], got 2.0").
        field = str(e).split(" ", 1)[0]
        if field == "logprobs":
            field = logprobs_param
        raise bad_request(str(e), param=field) from None
