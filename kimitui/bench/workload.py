"""The `random` workload of `vllm bench serve`, reproduced token for token.

vLLM (benchmarks/datasets RandomDataset) draws, from one `numpy.random.default_rng(seed)`:
input lengths, output lengths, offsets, then the shared prefix, then any filler tokens used
while decoding/re-encoding prompts. We keep that order so the same seed gives the same
lengths and tokens as vLLM for the same tokenizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

# vLLM retries decode -> encode -> pad/truncate this many times before giving up.
_MAX_RETRY = 10


class BenchTokenizer(Protocol):
    vocab_size: int
    special_ids: set[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: `prompt` is the text sent over HTTP (None when only ids were
    built), `prompt_token_ids` what an in-process engine receives."""

    prompt: str | None
    prompt_token_ids: list[int]
    prompt_len: int
    expected_output_len: int


@dataclass(frozen=True)
class Workload:
    """Sampled requests plus a human-readable note when anything was clipped or drifted."""

    requests: list[SampleRequest]
    note: str | None = None


def length_bounds(length: int, range_ratio: float, low_min: int = 0) -> tuple[int, int]:
    """Inclusive integer bounds [floor(L(1-r)), ceil(L(1+r))], as vLLM samples them."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low = max(math.floor(length * (1 - range_ratio)), low_min)
    high = max(math.ceil(length * (1 + range_ratio)), low_min)
    return low, high


def allowed_token_ids(tokenizer: BenchTokenizer) -> np.ndarray:
    """Every vocabulary id except special ones, sorted (vLLM's set difference iterates in
    the same ascending order for small ints)."""
    special = set(getattr(tokenizer, "special_ids", set()) or set())
    allowed = np.array([t for t in range(tokenizer.vocab_size) if t not in special], dtype=np.int64)
    if allowed.size == 0:
        raise ValueError("the tokenizer has no non-special tokens to build random prompts from")
    return allowed


def _decode_to_target_len(
    tokenizer: BenchTokenizer,
    ids: list[int],
    target: int,
    rng: np.random.Generator,
    allowed: np.ndarray,
) -> tuple[str, list[int], int]:
    # vLLM's gen_prompt_decode_to_target_len: N random tokens do not always re-tokenize to
    # N tokens, so iterate decode/encode and pad (random allowed ids) or truncate.
    remaining = _MAX_RETRY
    mismatch = 0
    while True:
        prompt = tokenizer.decode(ids)
        ids = list(tokenizer.encode(prompt))
        if remaining <= 0:
            mismatch = len(ids) - target
            break
        if len(ids) == target:
            break
        if len(ids) < target:
            extra = allowed[rng.integers(0, len(allowed), size=target - len(ids))]
            ids.extend(int(t) for t in extra)
        else:
            ids = ids[:target]
        remaining -= 1
    return prompt, ids, mismatch


def sample_random(
    tokenizer: BenchTokenizer,
    num_prompts: int,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    max_model_len: int | None = None,
    text: bool = True,
) -> Workload:
    """Build `num_prompts` random requests with vLLM's `random` dataset semantics.

    `text=False` skips the decode/re-encode round trip (in-process targets take ids, and
    checkpoints without tokenizer files cannot decode); token ids then have exactly the
    sampled length. `max_model_len` clips prompt + output to the model context.
    """
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if prefix_len < 0:
        raise ValueError(f"--random-prefix-len must be >= 0, got {prefix_len}")
    # Our tokenizer's encode() never adds special tokens, so vLLM's
    # num_special_tokens_to_add() is 0 here.
    in_low, in_high = length_bounds(input_len, range_ratio)
    out_low, out_high = length_bounds(output_len, range_ratio, low_min=1)
    if prefix_len + in_low < 1:
        raise ValueError(
            "--random-input-len is too small: prefix + shortest sampled input is 0 tokens; "
            "raise --random-input-len or --random-prefix-len, or lower --random-range-ratio"
        )

    rng = np.random.default_rng(seed)
    input_lens = rng.integers(in_low, in_high + 1, size=num_prompts)
    output_lens = rng.integers(out_low, out_high + 1, size=num_prompts)
    offsets = rng.integers(0, tokenizer.vocab_size, size=num_prompts)
    allowed = allowed_token_ids(tokenizer)

    prefix: list[int] = []
    if prefix_len > 0:
        prefix = allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist()
        if text:
            _, prefix, _ = _decode_to_target_len(tokenizer, prefix, prefix_len, rng, allowed)

    requests: list[SampleRequest] = []
    mismatch_total = 0
    for i in range(num_prompts):
        n = int(input_lens[i])
        inner = allowed[(int(offsets[i]) + i + np.arange(n)) % len(allowed)].tolist()
        ids = prefix + inner
        target = prefix_len + n
        prompt = None
        if text:
            prompt, ids, mismatch = _decode_to_target_len(tokenizer, ids, target, rng, allowed)
            mismatch_total += mismatch
        requests.append(SampleRequest(prompt, ids, len(ids), int(output_lens[i])))

    notes = []
    if mismatch_total:
        notes.append(
            f"decode/re-encode left {abs(mismatch_total)} "
            f"{'more' if mismatch_total > 0 else 'fewer'} prompt tokens than sampled (as vLLM warns)"
        )
    if max_model_len is not None:
        requests, clip_note = clip_to_context(requests, max_model_len, tokenizer if text else None)
        if clip_note:
            notes.append(clip_note)
    return Workload(requests, "; ".join(notes) or None)


def clip_to_context(
    requests: list[SampleRequest], max_model_len: int, tokenizer: BenchTokenizer | None = None
) -> tuple[list[SampleRequest], str | None]:
    """Shorten requests so prompt + output fits `max_model_len`: output first, then the
    prompt (keeping at least one output token). Returns the requests and a note, or None."""
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2 to benchmark, got {max_model_len}")
    out: list[SampleRequest] = []
    cut_prompts = cut_outputs = 0
    for r in requests:
        ids, prompt, out_len = r.prompt_token_ids, r.prompt, r.expected_output_len
        if len(ids) > max_model_len - 1:
            ids = ids[: max_model_len - 1]
            # A shortened text may re-tokenize a little differently; the server reports the
            # real prompt length back through usage.prompt_tokens.
            prompt = tokenizer.decode(ids) if tokenizer is not None and prompt is not None else None
            cut_prompts += 1
        if len(ids) + out_len > max_model_len:
            out_len = max_model_len - len(ids)
            cut_outputs += 1
        out.append(SampleRequest(prompt, ids, len(ids), out_len))
    if not (cut_prompts or cut_outputs):
        return out, None
    return out, (
        f"clipped to max_model_len={max_model_len}: {cut_prompts} prompt(s) truncated, "
        f"{cut_outputs} output length(s) shortened, of {len(requests)} requests"
    )
