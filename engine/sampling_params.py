"""Per-request generation settings (vLLM's SamplingParams, the subset kimitui serves)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kimitui.engine.structured.params import StructuredOutputs

MAX_LOGPROBS = 20
# Temperatures below this are greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to sample one request. ``temperature`` 0 (or below SAMPLING_EPS) is greedy; ``top_k`` 0 or -1 disables top-k."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # special tokens kept in the text even with skip_special_tokens (chat: <think> and tool-call tags)
    keep_special_token_ids: list[int] | None = None
    n: int = 1
    # OpenAI / vLLM penalties (engine/sampling/penalties.py); the defaults are off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # best_of: sample this many, return the n with the highest cumulative log-prob (None: n)
    best_of: int | None = None
    # grammar-constrained decoding (JSON schema, JSON object, tool calls): engine/structured/
    structured_outputs: StructuredOutputs | None = None
    # Scoring (KL measurements, logits dumps): hand out the full-vocabulary float32 log-prob row of
    # every position this request scores (prompt positions 1.. and each sampled position) in
    # ``RequestOutput.logprob_rows``, only the rows of the latest step, so memory stays at one
    # step's rows however long the prompt. Prompt rows need every prompt position computed, so such
    # a request takes no prefix-cache hits (as prompt_logprobs).
    logprob_rows: bool = False
    # Teacher forcing: output token i is forced_token_ids[i] whatever the sampler would pick (past
    # the list's end the sampler picks again). Log-probs and rows are those of the model's own
    # distribution at each position, so a reference continuation runs through the decode path.
    forced_token_ids: list[int] | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_strings = tuple(s for s in (self.stop or []) if s)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if 0 < self.temperature < SAMPLING_EPS:
            # As vLLM (vllm/sampling_params.py, _SAMPLING_EPS): so small a temperature is greedy. Left
            # as it is, logits / 1e-40 overflow to inf, the softmax is NaN and every draw is token 0.
            self.temperature = 0.0
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (math.isfinite(self.temperature), f"temperature must be finite, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}"),
            (-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                0.0 < self.repetition_penalty <= 100.0,
                f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}",
            ),
            (self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
            ),
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.best_of is None or self.best_of >= self.n, f"best_of must be >= n ({self.n}), got {self.best_of}"),
        ]
        checks.append(
            (
                self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputs),
                "structured_outputs must be an engine.structured.StructuredOutputs",
            )
        )
        if self.forced_token_ids is not None:
            self.forced_token_ids = list(self.forced_token_ids)
            checks.append(
                (
                    all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.forced_token_ids),
                    "forced_token_ids must be a list of non-negative token ids",
                )
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            checks.append((v is None or 0 <= v <= MAX_LOGPROBS, f"{name} must be in 0..{MAX_LOGPROBS}, got {v}"))
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    @property
    def needs_prompt_rows(self) -> bool:
        """Every prompt position must be computed (no prefix-cache hits): prompt log-probs or rows."""
        return self.prompt_logprobs is not None or self.logprob_rows

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
